"""Where speculant keeps what it builds once per machine: de-quantized weights, bigram tables, compiled
kernels, token counts and machine profiles (`$SPECULANT_CACHE`, default `~/.cache/speculant`)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculant.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


def is_file(path: Path) -> bool:
    """Whether `path` is a file: False for a name the system cannot hold, as one too long (Path's test raises)."""
    return _holds(Path.is_file, path)


def is_dir(path: Path) -> bool:
    """Whether `path` is a directory (`is_file`'s sense)."""
    return _holds(Path.is_dir, path)


def exists(path: Path) -> bool:
    """Whether anything is at `path` (`is_file`'s sense)."""
    return _holds(Path.exists, path)


def _holds(test: Callable[[Path], bool], path: Path) -> bool:
    try:
        return test(path)
    except OSError:
        return False


def readable(path: str | Path, what: str, make: str = "") -> Path:
    """`path` as the file to read `what` from (a pipe too, as a shell's `<(...)` gives); a ConfigError where it is a
    directory or nothing (`make`: how to make one)."""
    path = Path(path)
    if is_dir(path):
        raise ConfigError(f"{what} {path} is a directory: give a file")
    if not exists(path):
        raise ConfigError(f"{what} not found: {path}{make}")
    return path


def read_text(path: str | Path, most: int) -> str:
    """The UTF-8 text of `path` (a file, or a pipe as a shell's `<(...)` gives), read up to `most` bytes only: a
    TooLong past that (a device that never ends, such as /dev/zero, was read without end)."""
    with open(path, "rb") as file:
        data = file.read(most + 1)
    if len(data) > most:
        raise TooLong(f"{path} holds more than {most} bytes")
    return data.decode()


class TooLong(ValueError):
    """A file longer than any of its kind (`read_text`)."""


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


UNUSED_DAYS = 14  # a built file (a repack, a kernel library) not used this long goes when another of its kind is built


def mark_used(path: Path) -> None:
    """Date `path` to now: what `unused` reads as its last use (a read-only cache is never pruned either)."""
    try:
        os.utime(path)
    except OSError:
        pass


def unused(path: Path, days: float = UNUSED_DAYS) -> bool:
    """Whether `path` was last used (`mark_used`, or written) more than `days` ago; False where it is gone (another
    process removed it first)."""
    try:
        return path.stat().st_mtime < time.time() - days * 86400
    except OSError:
        return False


REMEMBERED_KEYS = 64  # per file: the most recently used (keys of temporary models and superseded kernels age out)


def remembered(name: str, key: str, measure: Callable[[], Any]) -> Any:
    """`measure()` (a JSON value) for `key`, measured once and kept in the cache's JSON file `name` among its
    REMEMBERED_KEYS most recently used keys (a key used again from the older half moves to the newest end). A key
    found fresh is read without waiting; otherwise one process at a time reads, measures and writes the file (a
    lock beside it), so a second process that wants a key being measured waits for the first's value instead of
    timing the machine while the first does. A `measure` that asks `remembered` of the same file runs unlocked
    within the lock its caller holds. Written through a temporary file: where no lock can be had, a process that
    races another loses at most a measurement, never the file."""
    path = cache_root() / name
    known = _read(path)
    if _fresh(known, key):
        return known[key]
    with exclusive(path.with_suffix(".lock")):
        known = _read(path)
        if _fresh(known, key):
            return known[key]
        known[key] = known.pop(key) if key in known else measure()
        for old in list(known)[:-REMEMBERED_KEYS]:
            del known[old]
        try:
            write_json(path, known)
        except OSError:
            pass  # measured again next time
        return known[key]


def write_json(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, written beside it and renamed over it: a reader sees the old file or the new one,
    never part of one (the temporary file is the writing thread's own: processes and threads may race)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=1))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any]:
    """The file's keys, or none where it is missing, unreadable or not a JSON object (rewritten at the next write)."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _fresh(known: dict[str, Any], key: str) -> bool:
    """Whether `key` is among the newer half of `known`'s keys (an older one is moved to the newest end)."""
    return key in known and list(known).index(key) >= len(known) - REMEMBERED_KEYS // 2


_held = threading.local()  # the lock files this thread holds (`exclusive`)


@contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """`lock` held exclusively for the block (flock: another thread or process waits; let go when the process
    ends, however it ends), or nothing where this thread holds it already or it cannot be had (the cache's
    directory is read-only, or its file system keeps no locks)."""
    held = _held.__dict__.setdefault("paths", set())
    fd = None
    if lock not in held:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.add(lock)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            held.discard(lock)
            os.close(fd)


def cached_array(path: Path, build: Callable[[], np.ndarray],
                 fits: Callable[[np.ndarray], bool] = lambda array: True) -> np.ndarray:
    """The array kept at `path` (.npy), or, where it is missing, unreadable or does not fit, `build()`, kept there
    through a temporary file (a process that races another writes a whole file or none)."""
    import numpy as np

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
