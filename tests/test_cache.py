"""What speculant keeps per machine stays bounded: a cache file keeps its most recently used keys, and repacked
weights no model has loaded for weeks go when another repack is written."""

import json
import os
import subprocess
import sys
import time

from tiny_gguf import write_tiny_gguf

from speculant import cache
from speculant.models.backends import lean


def test_a_cache_file_keeps_its_most_recently_used_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setattr(cache, "REMEMBERED_KEYS", 4)
    measured = []

    def remember(key):
        return cache.remembered("f.json", key, lambda: measured.append(key) or key.upper())

    for key in "abcd":
        remember(key)
    assert remember("a") == "A" and measured == list("abcd")  # read back: measured once
    remember("e")  # "a" was used again (moved to the newest end): "b" is the oldest and goes
    assert list(json.loads((tmp_path / "f.json").read_text())) == list("cdae")
    assert remember("b") == "B" and measured == list("abcdeb")
    # a file of JSON that is not an object (edited, or another program's) is no keys, rewritten: it crashed after the
    # measurement with a TypeError
    (tmp_path / "f.json").write_text("[1]")
    assert remember("z") == "Z" and json.loads((tmp_path / "f.json").read_text()) == {"z": "Z"}


def test_a_second_process_waits_for_the_first_s_measurement_instead_of_timing_beside_it(tmp_path, monkeypatch):
    """Two xdist workers once timed the AMX tiles at the same time, and each chose differently. A key found fresh
    is read without waiting, and a measurement may ask for another key of its own file."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    (tmp_path / "f.json").write_text(json.dumps({"known": 1}))
    with cache.exclusive(tmp_path / "f.lock"):  # as a first process measuring "k"
        child = subprocess.Popen([sys.executable, "-c", "from speculant import cache; "
                                  "print(cache.remembered('f.json', 'known', lambda: 2), flush=True); "
                                  "print(cache.remembered('f.json', 'k', lambda: 'measured by the second'))"],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline() == "1\n"
            time.sleep(0.5)
            (tmp_path / "f.json").write_text(json.dumps({"known": 1, "k": "measured by the first"}))
        except BaseException:
            child.kill()
            raise
    assert child.communicate(timeout=60)[0] == "measured by the first\n"
    nested = cache.remembered("f.json", "outer", lambda: cache.remembered("f.json", "inner", lambda: 3) + 1)
    assert nested == 4 and json.loads((tmp_path / "f.json").read_text())["outer"] == 4


def test_a_repack_no_model_loaded_for_weeks_goes_when_another_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    for name in ("old", "used", "new"):
        write_tiny_gguf(tmp_path / f"{name}.gguf", "qwen2", 0, "k", hidden=256)

    def repack_of(name):  # as a new process loads it
        lean.LeanWeights(tmp_path / f"{name}.gguf")
        (directory,) = (tmp_path / "cache" / "lean").glob(f"{name}-*")
        return directory

    old, used = repack_of("old"), repack_of("used")
    weeks_ago = time.time() - (cache.UNUSED_DAYS + 1) * 86400
    for directory in (old, used):
        os.utime(directory / "layout.json", (weeks_ago, weeks_ago))
    assert repack_of("used") == used  # loaded again: dated to now
    repack_of("new")
    assert not old.exists() and used.exists()
