"""llama.cpp built for this machine: its shared libraries and its own tools (`llama-bench`,
`llama-completion`, `llama-speculative-simple`, and `llama-server`, the serving peer), compiled natively
(`-march=native`) from the sdist of llama-cpp-python (the installed release, else `VERSION`), once per version
and CPU, into the cache (`speculant peers build-llamacpp`; a build that lacks a tool, or was made with other CMake
flags or another AMX fix, is made again). One process builds at a time, beside the build others may be running; the
manifest names the new one once it is whole.

It is the only native build of llama.cpp an install makes. llama-cpp-python's bindings, where they are missing,
are installed from the same sdist without their own copy of the library (`-DLLAMA_BUILD=OFF`: pure Python, a
few seconds); speculant points them at this build (`LLAMA_CPP_LIB_PATH`, `models/backends/llamacpp.choose_library`), so
the llama.cpp backend and llama.cpp's tools run the same kernels.

One line of ggml is fixed on the way. Its AMX matmul loads the tile configuration with the compiler's
`_tile_loadconfig`, which GCC 12 declares as reading 8 bytes (`"m" (*(const void **)config)`); at -O3 the
stores to the other 56 bytes of the 64-byte configuration are then dead, `ldtilecfg` reads stack garbage and
faults at the first matmul on an AMX CPU (what crashed native builds on the Xeon). The fixed line names the
whole configuration as its operand; nothing else changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from speculant.cache import cache_root, exclusive, write_json
from speculant.errors import ConfigError, ModelNotAvailable
from speculant.machine import cpu_info

TOOLS = ("llama-bench", "llama-completion", "llama-speculative-simple", "llama-server")
PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"  # the release built where no bindings are installed (the `llamacpp` extra names the same)
# The bindings alone: no llama.cpp, no mtmd (llama-cpp-python's CMakeLists builds both only under LLAMA_BUILD).
BINDINGS_CMAKE_ARGS = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON")
AMX_FILE = "ggml/src/ggml-cpu/amx/mmq.cpp"
AMX_BROKEN = "_tile_loadconfig(&tc);"
AMX_FIXED = '__asm__ volatile("ldtilecfg %0" :: "m"(tc));  /* all 64 bytes: see speculant.models.backends.llamacpp_build */'


def installed_version() -> str | None:
    """The installed llama-cpp-python's version, or None."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def build_version() -> str:
    """The release to build: the installed bindings' (the library must match the functions they declare), else
    `VERSION`, whose bindings the build then installs."""
    return installed_version() or VERSION


def cpu_key() -> str:
    """The CPU a native build is for: its model and feature flags (a build for one CPU may fault on another)."""
    model, flags = cpu_info()
    return hashlib.sha256(f"{model}|{' '.join(sorted(flags))}".encode()).hexdigest()[:12]


def build_key() -> str:
    """What a build is made with beside its version and CPU: the CMake flags and the AMX fix."""
    return hashlib.sha256("\n".join((*CMAKE_FLAGS, AMX_BROKEN, AMX_FIXED)).encode()).hexdigest()[:12]


def build_root(version: str | None = None) -> Path:
    return cache_root() / "llamacpp" / f"{version or build_version()}-{cpu_key()}"


MANIFEST = {"bin": str, "lib": str, "key": str, "amx_fix": bool}  # what is read of a manifest, by its type
NAMED = ("bin", "lib")  # what a manifest must name to name a build (`build` writes all of MANIFEST)


def manifest() -> dict | None:
    """What the finished build for this version and machine holds, or None when there is none (a damaged manifest
    names none: `build` writes it again)."""
    try:
        built = json.loads((build_root() / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(built, dict) or any(key not in built for key in NAMED) or \
            any(key in built and not isinstance(built[key], kind) for key, kind in MANIFEST.items()):
        return None
    return built


def missing(bin_dir: Path, names: tuple[str, ...] = TOOLS) -> list[str]:
    """Those of `names` that `bin_dir` lacks."""
    return [name for name in names if not (bin_dir / name).is_file()]


def tool(name: str) -> Path:
    """The path of one of llama.cpp's tools built for this machine; one line if it is not built yet."""
    built = manifest()
    if built is None or missing(Path(built["bin"]), (name,)):
        raise ModelNotAvailable(f"llama.cpp's {name} is not built on this machine: run `speculant peers "
                                "build-llamacpp` once (a few minutes)")
    return Path(built["bin"]) / name


def patch_amx(source: Path) -> bool:
    """Apply the AMX tile-configuration fix (module docstring) to a llama.cpp tree; False if the line is gone."""
    path = source / AMX_FILE
    if not path.is_file():
        return False
    text = path.read_text()
    if AMX_BROKEN not in text:
        return False
    path.write_text(text.replace(AMX_BROKEN, AMX_FIXED))
    return True


def fetch_sdist(version: str, into: Path, run: Callable[[list[str]], None]) -> Path:
    """The llama-cpp-python sdist of `version` (pip downloads it: only it from source, its build tools as wheels)."""
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-cache-dir", "--no-deps", "--no-binary", PACKAGE,
         f"{PACKAGE}=={version}", "-d", str(into)])
    return next(into.glob("*.tar.gz"))


def extract_source(archive: Path, into: Path) -> Path:
    """llama.cpp's tree as vendored in a llama-cpp-python sdist."""
    prefix = archive.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, members=members, filter="data")
        else:  # (Python 3.11 before 3.11.4 has no extraction filters: plain files and folders inside `into` only)
            inside = into.resolve()
            if odd := next((m for m in members if not (m.isfile() or m.isdir())
                            or not (inside / m.name).resolve().is_relative_to(inside)), None):
                raise ConfigError(f"{archive.name} holds {odd.name}, which is no file or folder inside its tree")
            tar.extractall(into, members=members)
    return into / prefix


def install_bindings(sdist: Path | str, run: Callable[..., None]) -> None:
    """pip-install llama-cpp-python's Python bindings alone (`sdist`: a file or a requirement), with no llama.cpp of
    their own: they load this machine's build. No wheel cache: a library-less wheel cached under the package's
    name would later stand in for a whole one."""
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--no-binary", PACKAGE, str(sdist)],
        env={**os.environ, "CMAKE_ARGS": BINDINGS_CMAKE_ARGS})


def build(jobs: int | None = None, say: Callable[[str], None] = print) -> Path:
    """Build llama.cpp natively into the cache (see the module docstring) and install llama-cpp-python's bindings
    for it where they are missing; returns the directory of the tools."""
    from speculant.models.backends.llamacpp import default_threads

    version = build_version()
    bindings = installed_version() is not None
    root = build_root(version)
    log = root / "build.log"

    def run(command: list[str], env: dict[str, str] | None = None) -> None:
        with log.open("a") as out:
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            # (a session of its own: cmake's compilers die with it when this process is stopped, by Ctrl-C or
            # SIGTERM, rather than go on writing into the build directory it removes)
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                code = process.wait()
            except BaseException:
                with contextlib.suppress(ProcessLookupError):  # (the group gone already: the interrupt stands)
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise
            if code != 0:
                raise ConfigError(f"building llama.cpp failed: `{' '.join(command[:4])} ...` (log: {log})")

    def bind(sdist: Path | str) -> None:
        if not bindings:
            say(f"installing the {PACKAGE} {version} bindings (Python only: they run on this build) ...")
            install_bindings(sdist, run)

    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / "build.lock"):  # (a process that waited here finds the build the other made)
        built = manifest()
        if built is not None and built.get("key") == build_key() and not missing(Path(built["bin"])):
            bind(f"{PACKAGE}=={version}")
            say(f"already built: {root}")
            return Path(built["bin"])
        for program in ("cmake", "c++"):
            if shutil.which(program) is None:
                raise ConfigError(f"building llama.cpp needs {program} on PATH")
        log.write_text("")
        with tempfile.TemporaryDirectory() as scratch:
            build_dir = Path(tempfile.mkdtemp(prefix="build-", dir=root))  # (its tools find its libraries by path)
            try:
                say(f"fetching the {PACKAGE} {version} sdist ...")
                sdist = fetch_sdist(version, Path(scratch), run)
                source = extract_source(sdist, Path(scratch))
                patched = patch_amx(source)
                generator = ["-G", "Ninja"] if shutil.which("ninja") else []
                say(f"configuring llama.cpp (native, {'AMX fix applied' if patched else 'no AMX fix needed'}) ...")
                run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_FLAGS])
                say(f"building {', '.join(TOOLS)} and libllama (about 7 minutes on 2 cores) ...")
                run(["cmake", "--build", str(build_dir), "-j", str(jobs or default_threads()), "--target", "llama",
                     *TOOLS])
                bin_dir = build_dir / "bin"
                if lacking := missing(bin_dir):
                    raise ConfigError(f"building llama.cpp left no {', '.join(lacking)} (log: {log})")
            except BaseException:
                shutil.rmtree(build_dir, ignore_errors=True)
                raise
            write_json(root / "manifest.json", {
                "version": version, "cpu": cpu_info()[0], "bin": str(bin_dir), "lib": str(bin_dir),
                "amx_fix": patched, "cmake": list(CMAKE_FLAGS), "key": build_key()})
            for old in root.iterdir():  # the builds before it, which the manifest no longer names
                if old.is_dir() and old != build_dir:
                    shutil.rmtree(old, ignore_errors=True)
            bind(sdist)
    say(f"built: {bin_dir}")
    return bin_dir
