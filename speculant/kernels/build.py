"""Compile a C source of speculant's once per machine with the system C compiler, into the cache, and load
it with ctypes (no build step at install)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from speculant.cache import cache_root

HEADERS = Path(__file__).parent  # kernels/: every C source of speculant and the headers they share (tiles.h)


def compile_library(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """`source` built with `flags` (and the headers beside it and in kernels/, which every source may include), or
    None where no C compiler is found or the build fails. The library is keyed by the sources' bytes and the flags,
    so an edit rebuilds it."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    flags = ("-O3", "-ffp-contract=off", *flags, "-fopenmp", "-shared", "-fPIC")
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in sorted({*source.parent.glob("*.h"), *HEADERS.glob("*.h")}) + [source]:
        digest.update(path.read_bytes())
    path = cache_root() / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run([compiler, *flags, f"-I{HEADERS}", "-o", str(tmp), str(source)], check=True,
                           capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            tmp.unlink(missing_ok=True)
            return None
        tmp.replace(path)
    return ctypes.CDLL(str(path))
