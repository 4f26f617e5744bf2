"""Max-Gram's host time per decoding step as `auto` spends it (`match_length`, then `propose` of 8 on the same context;
the next step's context one token longer), at several context lengths, microseconds per step, the median of
`--rounds` runs of 400 steps. Run it at two commits to compare (a GPU step of ~3 ms is where tens of microseconds
count).

    python scripts/maxgram_step_time.py [--lengths 300 1000 4000 --rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from speculant.drafters.maxgram import MaxGramDrafter

STEPS = 400
VOCAB = 1000  # small enough that suffixes recur: matches found and followed


def step_time(length: int, seed: int) -> float:
    rng = random.Random(seed)
    prompt, out = [rng.randrange(VOCAB) for _ in range(length)], []
    drafter = MaxGramDrafter().begin(prompt)
    began = time.perf_counter()
    for _ in range(STEPS):
        context = prompt + out
        drafter.match_length(context)
        drafter.propose(context, 8)
        out.append(rng.randrange(VOCAB))
    return (time.perf_counter() - began) / STEPS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 1000, 4000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({f"us per step at {length}": statistics.median(step_time(length, seed)
                                                                    for seed in range(args.rounds))
                      for length in args.lengths}))


if __name__ == "__main__":
    main()
