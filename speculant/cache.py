"""Where speculant keeps what it builds once per machine: de-quantized weights, bigram tables, compiled
kernels, token counts and machine profiles (`$SPECULANT_CACHE`, default `~/.cache/speculant`)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from speculant.errors import ConfigError


def cache_root() -> Path:
    """`$SPECULANT_CACHE` (unset or empty: `~/.cache/speculant`); a ConfigError where a file holds its path."""
    root = Path(os.environ.get("SPECULANT_CACHE") or Path.home() / ".cache" / "speculant")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"SPECULANT_CACHE={root} is a file: it names the directory speculant keeps its cache in")
    return root


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


REMEMBERED_KEYS = 64  # per file: the most recently used (keys of temporary models and superseded kernels age out)


def remembered(name: str, key: str, measure: Callable[[], Any]) -> Any:
    """`measure()` (a JSON value) for `key`, measured once and kept in the cache's JSON file `name` among its
    REMEMBERED_KEYS most recently used keys (a key used again from the older half moves to the newest end). One
    process at a time reads, measures and writes a file (a lock beside it): a second process that wants the same
    key waits for the first's value instead of timing the machine while the first does. Written through a temporary
    file: where the lock cannot be had, a process that races another loses at most a measurement, never the file."""
    path = cache_root() / name
    with _exclusive(path.with_suffix(".lock")):
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            if list(known).index(key) >= len(known) - REMEMBERED_KEYS // 2:
                return known[key]
            known[key] = known.pop(key)
        else:
            known[key] = measure()
        for old in list(known)[:-REMEMBERED_KEYS]:
            del known[old]
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # measured again next time
        return known[key]


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """`lock` held exclusively for the block (flock: let go when the process ends, however it ends), or nothing
    where the cache's directory cannot be written."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cached_array(path: Path, build: Callable[[], np.ndarray],
                 fits: Callable[[np.ndarray], bool] = lambda array: True) -> np.ndarray:
    """The array kept at `path` (.npy), or, where it is missing, unreadable or does not fit, `build()`, kept there
    through a temporary file (a process that races another writes a whole file or none)."""
    try:
        array = np.load(path)
        if fits(array):
            return array
    except (OSError, ValueError):
        pass  # built below
    array = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, array)
    tmp.replace(path)
    return array
