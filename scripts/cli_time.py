"""Wall seconds of one `speculant` command in a fresh process, each checkout's code in turn (A B B A ...), and of any
other command beside them in the same alternation (llama.cpp's own tool on the same GGUF), so process start-up
compares on one machine in one run:
`python scripts/cli_time.py --checkouts /tmp/before . --repeats 4 --beside "$(python -c 'from
speculant.models.backends.llamacpp_build import tool; print(tool("llama-completion"))') -m
~/.cache/speculant/models/qwen2.5-coder-0.5b-gguf/model.gguf -p 'def add(a, b):' -n 8 -no-cnv --temp 0" -- generate
"def add(a, b):" --target qwen2.5-coder-0.5b --max-new-tokens 8`. Each checkout runs with PYTHONPATH set to it and
Python's -P (so the working directory's package does not stand in for it); run the command once first (a first run
repacks and profiles)."""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--checkouts", nargs="+", required=True, help="source trees, each run with PYTHONPATH set to it")
parser.add_argument("--beside", action="append", default=[], help="another command line, timed in the same turns")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the speculant command line")
args = parser.parse_args()
command = args.command[1:] if args.command[:1] == ["--"] else args.command
runs = {checkout: ([sys.executable, "-P", "-m", "speculant.cli", *command],  # -P: the working directory's own
                   # `speculant` (the repository root's) must not shadow the checkout PYTHONPATH names
                   {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}) for checkout in args.checkouts}
runs |= {line: ([os.path.expanduser(word) for word in shlex.split(line)], dict(os.environ)) for line in args.beside}
walls: dict[str, list[float]] = {name: [] for name in runs}
for repeat in range(args.repeats):
    for name in list(runs) if repeat % 2 == 0 else list(runs)[::-1]:
        argv, env = runs[name]
        start = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        walls[name].append(time.perf_counter() - start)
        if done.returncode != 0:
            sys.exit(f"{name}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
for name, seconds in walls.items():
    print(f"{name}: median {statistics.median(seconds):.2f} s ({', '.join(f'{s:.2f}' for s in seconds)})")
