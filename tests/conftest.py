import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# Every Ray cluster the tests start (ray.init's and `ray start`'s) is a throwaway local one: no auth token,
# set before any test imports Ray (a process keeps the mode its first Ray session had).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Tests load llama.cpp as speculant does: the native build for this machine where there is one. Test modules
# import llama_cpp while they are collected, so the choice is made here, first.
from speculant.models.llamacpp import choose_library  # noqa: E402

choose_library()
