"""Compile a C source of speculant's once per machine with the system C compiler, into the cache, and load
it with ctypes (no build step at install)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from speculant.cache import cache_root, mark_used, unused

HEADERS = Path(__file__).parent  # kernels/: every C source of speculant and the headers they share (tiles.h)
log = logging.getLogger("speculant")
_lock = threading.Lock()  # one build or load at a time: threads that first use a library at once wait for one build
DIGEST_CHARS = 16  # of a library's name: its sources' and flags' digest
_failures: dict[Path, str] = {}  # this process's failed builds: the compiler's last line of error


def compile_library(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """`source` built with `flags` (and the headers beside it and in kernels/, which every source may include), or
    None where no C compiler is found or the build fails: said once per process in a warning with the compiler's
    last line of error (`build_error`), so that a slower path taken instead is visible. The library is keyed by
    the sources' bytes and the flags, so an edit rebuilds it; a build removes the source's libraries of other
    bytes or flags that no process loaded for `cache.UNUSED_DAYS` (an upgrade's, an edit's)."""
    path = _library_path(source, flags)
    with _lock:
        if path in _failures:
            return None
        mark_used(path)  # (first: a build of another version now leaves it be)
        if not path.is_file():
            error = _compile(source, _all_flags(flags), path)
            if error is not None:
                _failures[path] = error
                log.warning(f"speculant: {source.name} with {' '.join(flags) or 'no flags'} did not build ({error}); "
                            f"its kernels will not be used")
                return None
            _remove_unused(path, source.stem)
        return ctypes.CDLL(str(path))


def build_error(source: Path, flags: tuple[str, ...]) -> str | None:
    """Why `compile_library(source, flags)` returned None in this process (the compiler's last line of error), or
    None where it did not."""
    return _failures.get(_library_path(source, flags))


def _remove_unused(path: Path, stem: str) -> None:
    """Remove the libraries of `stem` beside `path` (its source's, of other bytes or flags) unused for
    `cache.UNUSED_DAYS`; a process that has one loaded keeps its mapping."""
    for other in path.parent.glob(f"{stem}-{'?' * DIGEST_CHARS}.so"):
        if other != path and unused(other):
            try:
                other.unlink()
            except OSError:
                pass  # another process removed it first, or it is another user's


def _all_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    return ("-O3", "-ffp-contract=off", *flags, "-fopenmp", "-shared", "-fPIC")


def _library_path(source: Path, flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256(" ".join(_all_flags(flags)).encode())
    for path in sorted({*source.parent.glob("*.h"), *HEADERS.glob("*.h")}) + [source]:
        digest.update(path.read_bytes())
    return cache_root() / "kernels" / f"{source.stem}-{digest.hexdigest()[:DIGEST_CHARS]}.so"


def _compile(source: Path, flags: tuple[str, ...], path: Path) -> str | None:
    """Build the library at `path` (in a temporary directory of its own beside it, then renamed into place: a reader
    sees all of it or nothing); None, or why it failed in one line."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return "no C compiler found: install gcc or set CC"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{path.stem}-", dir=path.parent) as tmp:
        try:
            subprocess.run([compiler, *flags, f"-I{HEADERS}", "-o", f"{tmp}/{path.name}", str(source)], check=True,
                           capture_output=True, text=True, timeout=120)
        except subprocess.CalledProcessError as error:
            return (error.stderr.strip().splitlines() or [f"{compiler} exited with {error.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            return f"{compiler} ran for more than 120 s"
        except OSError as error:
            return f"{compiler}: {error}"
        os.replace(f"{tmp}/{path.name}", path)
    return None
