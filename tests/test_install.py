"""Install once: nothing pip installs compiles llama.cpp; `speculant peers build-llamacpp` is its one native build
(the tools and the library the llama.cpp backend runs on) and installs llama-cpp-python's bindings without a
library of their own; without that build the llama.cpp backend says in one line how to make it. No network and no
compiler here: pip and cmake are stood in for."""

import io
import json
import sys
import tarfile
import types
import tomllib
from pathlib import Path

import pytest

from speculant.errors import ModelNotAvailable
from speculant.models.backends import llamacpp
from speculant.models.backends import llamacpp_build

ROOT = Path(__file__).parent.parent


def test_no_extra_compiles_llama_cpp_and_ci_installs_every_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [r for group in extras.values() for r in group] + project["dependencies"]
    assert not [r for r in requirements if r.lower().replace("_", "-").startswith("llama-cpp-python")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert '-e ".[models,llamacpp,serve,ray,test]"' in ci
    assert set(extras) == {"models", "llamacpp", "serve", "ray", "test"}
    assert ci.count("speculant peers build-llamacpp") == 1 and "CMAKE_ARGS" not in ci


@pytest.fixture
def no_llama_cpp(tmp_path, monkeypatch):
    """A process where llama_cpp has not been imported, no library is chosen and the cache is empty; returns a
    folder on sys.path for a stand-in `llama_cpp` package."""
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "unset")
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")  # restored (or removed again) after the test
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


def test_without_the_bindings_the_backend_says_to_build(no_llama_cpp, monkeypatch):
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name, *a: None)
    assert not llamacpp.available()
    with pytest.raises(ModelNotAvailable, match="run `speculant peers build-llamacpp`"):
        llamacpp._import()


def test_bindings_without_a_library_say_to_build_and_the_build_s_library_is_chosen(no_llama_cpp, monkeypatch):
    package = no_llama_cpp / "llama_cpp"
    package.mkdir()
    # As llama-cpp-python's bindings do when installed with -DLLAMA_BUILD=OFF and pointed nowhere.
    (package / "__init__.py").write_text('raise FileNotFoundError("Shared library with base name llama not found")\n')
    assert not llamacpp.available()
    with pytest.raises(ModelNotAvailable, match="run `speculant peers build-llamacpp`"):
        llamacpp._import()
    elsewhere = no_llama_cpp / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "libllama.so").write_text("")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(elsewhere))
    assert llamacpp.available()
    with pytest.raises(ModelNotAvailable, match="cannot load llama.cpp.*not found.*speculant peers build-llamacpp"):
        llamacpp._import()  # the bindings' own error, in one line
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    root = llamacpp_build.build_root()
    (root / "build" / "bin").mkdir(parents=True)
    (root / "build" / "bin" / "libllama.so").write_text("")
    folder = str(root / "build" / "bin")
    (root / "manifest.json").write_text(json.dumps({"bin": folder, "lib": folder}))
    assert llamacpp.available()  # choose_library pointed the bindings at the build
    assert llamacpp.os.environ["LLAMA_CPP_LIB_PATH"] == folder


def test_the_version_built_is_the_installed_bindings_else_the_pinned_one(monkeypatch):
    monkeypatch.setattr(llamacpp_build, "installed_version", lambda: None)
    assert llamacpp_build.build_version() == llamacpp_build.VERSION
    monkeypatch.setattr(llamacpp_build, "installed_version", lambda: "0.3.99")
    assert llamacpp_build.build_version() == "0.3.99"


class FakeTools:
    """Stands in for pip and cmake in `build` (`subprocess.Popen`'s process, done at once): pip download writes a
    small sdist, cmake --build writes the tools and libllama; every command is recorded with its CMAKE_ARGS."""

    def __init__(self):
        self.commands: list[tuple[list[str], str | None]] = []

    def __call__(self, command, stdout=None, stderr=None, env=None, start_new_session=False):
        self.commands.append((list(command), (env or {}).get("CMAKE_ARGS")))
        if command[1:4] == ["-m", "pip", "download"]:
            into = Path(command[command.index("-d") + 1])
            with tarfile.open(into / f"llama_cpp_python-{llamacpp_build.VERSION}.tar.gz", "w:gz") as tar:
                name = f"llama_cpp_python-{llamacpp_build.VERSION}/vendor/llama.cpp/{llamacpp_build.AMX_FILE}"
                data = f"  {llamacpp_build.AMX_BROKEN}\n".encode()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        if command[:2] == ["cmake", "--build"]:
            bin_dir = Path(command[2]) / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            for name in (*llamacpp_build.TOOLS, "libllama.so"):
                (bin_dir / name).write_text("")
        return types.SimpleNamespace(pid=0, wait=lambda: 0)


def test_one_native_build_then_the_bindings_alone_from_the_same_sdist(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp_build, "installed_version", lambda: None)
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda program: f"/usr/bin/{program}")
    fake = FakeTools()
    monkeypatch.setattr(llamacpp_build.subprocess, "Popen", fake)
    bin_dir = llamacpp_build.build(jobs=2, say=lambda line: None)
    assert bin_dir.parent.parent == llamacpp_build.build_root(llamacpp_build.VERSION) and bin_dir.name == "bin"
    steps = [c for c, _ in fake.commands]
    assert [c[:2] for c in steps if c[0] == "cmake"] == [["cmake", "-S"], ["cmake", "--build"]]  # one native build
    install = [(c, args) for c, args in fake.commands if c[1:4] == ["-m", "pip", "install"]]
    assert len(install) == 1 and steps.index(install[0][0]) == len(steps) - 1  # after the build
    command, cmake_args = install[0]
    assert "-DLLAMA_BUILD=OFF" in cmake_args.split() and "--no-cache-dir" in command
    assert command[-1].endswith(f"llama_cpp_python-{llamacpp_build.VERSION}.tar.gz")  # the sdist just downloaded
    built = llamacpp_build.manifest()
    assert built["lib"] == str(bin_dir) and built["amx_fix"] and built["version"] == llamacpp_build.VERSION
    # Built already: only the missing bindings are installed (by name, still without a library).
    fake.commands.clear()
    assert llamacpp_build.build(say=lambda line: None) == bin_dir
    [(command, cmake_args)] = fake.commands
    assert command[-1] == f"llama-cpp-python=={llamacpp_build.VERSION}" and "-DLLAMA_BUILD=OFF" in cmake_args.split()
    # Built, bindings installed: nothing runs.
    fake.commands.clear()
    monkeypatch.setattr(llamacpp_build, "installed_version", lambda: llamacpp_build.VERSION)
    assert llamacpp_build.build(say=lambda line: None) == bin_dir and fake.commands == []


def test_a_build_stopped_by_ctrl_c_or_sigterm_stops_its_compilers_too(tmp_path, monkeypatch):
    """Each build command runs in a session of its own, whose whole group is killed when the build is interrupted
    (cmake's compilers would go on writing into the build directory the interrupted build removes)."""
    from speculant.errors import Terminated

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp_build, "installed_version", lambda: None)
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda program: f"/usr/bin/{program}")
    sessions, killed = [], []

    def stopped(command, stdout=None, stderr=None, env=None, start_new_session=False):
        sessions.append(start_new_session)

        def wait():
            if not killed:
                raise Terminated
            return -9
        return types.SimpleNamespace(pid=4242, wait=wait)

    monkeypatch.setattr(llamacpp_build.subprocess, "Popen", stopped)
    monkeypatch.setattr(llamacpp_build.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    with pytest.raises(Terminated):
        llamacpp_build.build(jobs=2, say=lambda line: None)
    assert sessions == [True] and killed == [(4242, llamacpp_build.signal.SIGKILL)]
