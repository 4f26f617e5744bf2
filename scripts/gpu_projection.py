"""Projections, not measurements: a CPU bench's speculation replayed at a GPU's measured costs. The acceptance is
the CPU run's (the real catalog pair, every tree and forward recorded in each row's stats); the costs are the
compiled static steps' T(W) from a lent GPU's `scripts/gpu_static.py` run (random weights of the same shapes, so
the same costs). Each decode's device time is priced as a latency twin prices it: every target forward is
ceil(rows / 16) compiled x16 steps (a tree's verify width + 1 rows), every drafter forward one compiled x16 step of
the drafter, `ar` one target step a token; the host's work between forwards is left out, so a projected speedup is
an upper bound. Stage-scheduled rows would overlap drafting with verification on a second stream, which is not
priced, so they are left out.

    python scripts/gpu_projection.py docs/results/tree-breakdown/results.json [--gpu docs/results/gpu-h100.json]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

ROWS = 16  # the compiled steps' width on a GPU


def step_costs(gpu: dict) -> tuple[float, float]:
    """The compiled x16 forward of the target (1.5B) and of the drafter (0.5B), in seconds."""
    compiled = gpu["compiled T(W) ms"]
    return compiled["1.5b compiled x16"]["16"] / 1e3, compiled["0.5b compiled x16"]["16"] / 1e3


def device_seconds(stats: dict, target: float, drafter: float) -> float:
    """One decode's device time after its first token at these costs."""
    if not stats["target_steps"]:  # ar: one forward a token after the first
        return (stats["new_tokens"] - 1) * target
    sizes = stats.get("verified_sizes") or []
    forwards = sum(math.ceil((size + 1) / ROWS) for size in sizes) + stats["target_steps"] - len(sizes)
    return forwards * target + sum(stats["drafter_steps"].values()) * drafter


def project(rows: list[dict], target: float, drafter: float) -> dict[str, dict]:
    """Per method: the projected decode tokens per second over all its rows, and the ratio to `ar`'s."""
    tokens, seconds = defaultdict(int), defaultdict(float)
    for row in rows:
        stats = row["stats"]
        if stats is None or row["method"].startswith("llamacpp") or "schedule=stage" in row["method"]:
            continue
        tokens[row["method"]] += stats["new_tokens"] - 1
        seconds[row["method"]] += device_seconds(stats, target, drafter)
    rate = {method: tokens[method] / seconds[method] for method in tokens}
    return {method: {"tok/s": rate[method], "over ar": rate[method] / rate["ar"]} for method in rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a CPU bench's results.json (with `ar` among its methods)")
    parser.add_argument("--gpu", default="docs/results/gpu-h100.json", help="a gpu_static.py run's JSON")
    args = parser.parse_args()
    with open(args.gpu) as f:
        gpu = json.load(f)
    with open(args.results) as f:
        rows = json.load(f)["rows"]
    target, drafter = step_costs(gpu)
    print(f"projected on {gpu['device']} (target step {target * 1e3:.2f} ms, drafter step {drafter * 1e3:.2f} ms; "
          "device time only)\n")
    print("| method | projected decode tok/s | over `ar` |\n|---|---|---|")
    for method, row in project(rows, target, drafter).items():
        print(f"| `{method}` | {row['tok/s']:.0f} | {row['over ar']:.2f}x |")


if __name__ == "__main__":
    main()
