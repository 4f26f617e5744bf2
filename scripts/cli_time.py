"""Wall seconds of one `speculant` command in a fresh process, each checkout's code in turn (A B B A ...), so two
commits' process start-up compares on the same machine in one run:
`python scripts/cli_time.py --checkouts /tmp/before . --repeats 3 -- generate "def add(a, b):" --target
qwen2.5-coder-0.5b@gguf --max-new-tokens 8`. Each checkout runs with PYTHONPATH set to it; run one warm-up of the
command first (a first run repacks and profiles)."""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--checkouts", nargs="+", required=True, help="source trees, each run with PYTHONPATH set to it")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the speculant command line")
args = parser.parse_args()
command = args.command[1:] if args.command[:1] == ["--"] else args.command
walls: dict[str, list[float]] = {checkout: [] for checkout in args.checkouts}
for repeat in range(args.repeats):
    for checkout in args.checkouts if repeat % 2 == 0 else args.checkouts[::-1]:
        env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "speculant.cli", *command], env=env, capture_output=True, text=True)
        walls[checkout].append(time.perf_counter() - start)
        if done.returncode != 0:
            sys.exit(f"{checkout}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
for checkout, seconds in walls.items():
    print(f"{checkout}: median {statistics.median(seconds):.2f} s ({', '.join(f'{s:.2f}' for s in seconds)})")
