"""Seconds of one tree compaction (`keep`) on the lean 1.5B by cached length: what a tree step pays after
verification to keep its accepted path (CHANGELOG, "Tree compaction that costs what it moves").

    python scripts/keep_cost.py --lengths 256 1024 2000

For each length: prefill that many tokens, then `--repeats` times a 4-row forward and a `keep` of the prefix plus
two of the four rows (`keep(n, path)`: what the tree step hands it); prints the median `keep` in ms."""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 2000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    from speculant.models.loading import load_lean

    model = load_lean("qwen2.5-coder-1.5b")
    for n in args.lengths:
        model.prefill([(7919 * i + 11) % 150000 for i in range(n)])
        seconds = []
        for _ in range(args.repeats):
            model.forward([5, 6, 7, 8])
            began = time.perf_counter()
            model.keep(n, [n + 1, n + 3])
            seconds.append(time.perf_counter() - began)
            model.rollback(n)
        print(f"{n} cached positions: keep {statistics.median(seconds) * 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
