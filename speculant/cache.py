"""Where speculant keeps what it builds once per machine: de-quantized weights, bigram tables, compiled
kernels and machine profiles (`$SPECULANT_CACHE`, default `~/.cache/speculant`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECULANT_CACHE", Path.home() / ".cache" / "speculant"))


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
