"""llama.cpp built for this machine: its shared libraries and its own tools (`llama-bench`,
`llama-completion`, `llama-speculative-simple`, and `llama-server`, the serving peer), compiled natively
(`-march=native`) from the sdist of the installed llama-cpp-python, once per version and CPU, into the cache
(`speculant peers build-llamacpp`; a build that lacks a tool is made again).

One line of ggml is fixed on the way. Its AMX matmul loads the tile configuration with the compiler's
`_tile_loadconfig`, which GCC 12 declares as reading 8 bytes (`"m" (*(const void **)config)`); at -O3 the
stores to the other 56 bytes of the 64-byte configuration are then dead, `ldtilecfg` reads stack garbage and
faults at the first matmul on an AMX CPU (what crashed native builds on the Xeon). The fixed line names the
whole configuration as its operand; nothing else changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from speculant.cache import cache_root
from speculant.errors import ConfigError, ModelNotAvailable
from speculant.machine import cpu_info

TOOLS = ("llama-bench", "llama-completion", "llama-speculative-simple", "llama-server")
PACKAGE = "llama-cpp-python"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON")
AMX_FILE = "ggml/src/ggml-cpu/amx/mmq.cpp"
AMX_BROKEN = "_tile_loadconfig(&tc);"
AMX_FIXED = '__asm__ volatile("ldtilecfg %0" :: "m"(tc));  /* all 64 bytes: see speculant.models.llamacpp_build */'


def installed_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        raise ConfigError(f"llama.cpp's tools are built from the installed {PACKAGE}: "
                          'pip install "speculant[llamacpp]"') from None


def machine_key() -> str:
    """The CPU a native build is for: its model and feature flags (a build for one CPU may fault on another)."""
    model, flags = cpu_info()
    return hashlib.sha256(f"{model}|{' '.join(sorted(flags))}".encode()).hexdigest()[:12]


def build_root(version: str | None = None) -> Path:
    return cache_root() / "llamacpp" / f"{version or installed_version()}-{machine_key()}"


def manifest() -> dict | None:
    """What the finished build for this version and machine holds, or None when there is none."""
    try:
        return json.loads((build_root() / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


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


def fetch_source(version: str, into: Path, run: Callable[[list[str]], None]) -> Path:
    """llama.cpp's tree as vendored in the llama-cpp-python sdist of `version` (pip downloads it)."""
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         f"{PACKAGE}=={version}", "-d", str(into)])
    archive = next(into.glob("*.tar.gz"))
    prefix = archive.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(into, members=members, filter="data")
    return into / prefix


def build(jobs: int | None = None, say: Callable[[str], None] = print) -> Path:
    """Build llama.cpp natively into the cache (see the module docstring); returns the directory of the tools."""
    version = installed_version()
    root = build_root(version)
    built = manifest()
    if built is not None and not missing(Path(built["bin"])):
        say(f"already built: {root}")
        return Path(built["bin"])
    for program in ("cmake", "c++"):
        if shutil.which(program) is None:
            raise ConfigError(f"building llama.cpp needs {program} on PATH")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log = root / "build.log"

    def run(command: list[str]) -> None:
        with log.open("a") as out:
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise ConfigError(f"building llama.cpp failed: `{' '.join(command[:4])} ...` (log: {log})")

    with tempfile.TemporaryDirectory() as scratch:
        say(f"fetching the {PACKAGE} {version} sdist ...")
        source = fetch_source(version, Path(scratch), run)
        patched = patch_amx(source)
        build_dir = root / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        say(f"configuring llama.cpp (native, {'AMX fix applied' if patched else 'no AMX fix needed'}) ...")
        run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_FLAGS])
        say(f"building {', '.join(TOOLS)} and libllama (a few minutes) ...")
        run(["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 1), "--target", "llama", *TOOLS])
    bin_dir = build_dir / "bin"
    if lacking := missing(bin_dir):
        raise ConfigError(f"building llama.cpp left no {', '.join(lacking)} (log: {log})")
    (root / "manifest.json").write_text(json.dumps({
        "version": version, "cpu": cpu_info()[0], "bin": str(bin_dir), "lib": str(bin_dir),
        "amx_fix": patched, "cmake": list(CMAKE_FLAGS)}, indent=1))
    say(f"built: {bin_dir}")
    return bin_dir
