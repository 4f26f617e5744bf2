"""Used and preempted target forwards of DSI runs, from `speculant generate --json` outputs
(docs/results/dsi-preemption.md).

    speculant generate "$P" --method dsi --executor process --servers 2 --max-new-tokens 96 --json > run1.json
    python scripts/dsi_preempted_forwards.py run1.json run2.json run3.json

Reads every server forward in `stats.dsi.bars` (rows >= 0: the servers'; the drafter's are below 0) with its
outcome, and prints, summed over the files: the forwards used and their median ms, the forwards preempted, their
median ms and total seconds, and how many were cut short inside the model. Why: a preempted forward that runs to
completion holds a server for nothing; this measures how soon preemption frees it. Pure Python (json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="outputs of speculant generate --method dsi --json")
    args = parser.parse_args(argv)
    bars = [b for f in args.files for b in json.load(open(f))["stats"]["dsi"]["bars"] if b["row"] >= 0]
    ms = lambda outcome: [1000 * (b["end"] - b["start"]) for b in bars if b["outcome"] == outcome]  # noqa: E731
    used, preempted = ms("used"), ms("preempted")
    median = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    print(f"used {len(used)}, median {median(used):.0f} ms; preempted {len(preempted)}, median "
          f"{median(preempted):.0f} ms, total {sum(preempted) / 1000:.1f} s; cut short inside the model "
          f"{sum(bool(b.get('cut_short')) for b in bars)}")


if __name__ == "__main__":
    main(sys.argv[1:])
