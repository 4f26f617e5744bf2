import os
import sys
from pathlib import Path

# The suite runs on two pytest-xdist workers (pyproject's addopts). Most tests are single-threaded Python around
# tiny models, so each worker gets cores of its own (an equal share; on two cores, one each), set before torch,
# llama.cpp or the kernels count the cores they may use: two workers each running two threads on two cores spin
# against each other and run slower than one.
if "PYTEST_XDIST_WORKER" in os.environ and hasattr(os, "sched_setaffinity"):
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", len(cores)))
    worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) % workers  # (a restarted worker: gw<n> on)
    if len(cores) >= workers:  # (every core in one share: 16 over 6 workers, three of 3 and three of 2)
        os.sched_setaffinity(0, set(cores[worker * len(cores) // workers:(worker + 1) * len(cores) // workers]))
    else:
        os.sched_setaffinity(0, {cores[worker % len(cores)]})

sys.path.insert(0, str(Path(__file__).parent))
# Every Ray cluster the tests start (ray.init's and `ray start`'s) is a throwaway local one: no auth token,
# set before any test imports Ray (a process keeps the mode its first Ray session had).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Tests load llama.cpp as speculant does: the native build for this machine where there is one. Test modules
# import llama_cpp while they are collected, so the choice is made here, first.
from speculant.models.backends.llamacpp import choose_library  # noqa: E402

choose_library()
