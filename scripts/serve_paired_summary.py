"""`auto` / `ar` per pair of passes from `speculant bench-serve`'s results.jsonl, per concurrency
(docs/results/serve-1.5b-http-paired/paired.md; the passes come from scripts/serve_paired.sh).

    python scripts/serve_paired_summary.py docs/results/serve-1.5b-http-paired/3-waiting/results.jsonl
    python scripts/serve_paired_summary.py RUN3/results.jsonl RUN4/results.jsonl     # runs pooled

A pass against port 8021 is `ar`'s, against 8022 `auto`'s; warm-up passes (labels starting "warm") are left out;
passes with the same concurrency and label form a pair. Prints, per concurrency: the pairs, the mean ratio with a
95% Student t-interval, the range, how many pairs are at or above 1, mean tok/s, and the medians over pairs of the
TTFT and TPOT p50 (a request's time per output token after its first). Why: a pair of passes a minute apart sees
the same state of this VM, so the ratio per pair is the comparison, and the interval says whether a few percent are
decided. Pure Python (json, statistics).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict

T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201,
        12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}  # Student's t, 97.5%


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="bench-serve results.jsonl files (pooled)")
    parser.add_argument("--markdown", action="store_true", help="a README table instead of one line per concurrency")
    args = parser.parse_args(argv)
    pairs: dict = defaultdict(dict)
    for i, path in enumerate(args.files):
        for line in open(path):
            if not line.strip():
                continue
            r = json.loads(line)
            if not r["label"].startswith("warm"):
                pairs[r["concurrency"], i, r["label"]]["ar" if r["url"].endswith(":8021/v1") else "auto"] = r
    if args.markdown:
        print("| C | pairs | `auto` / `ar` (95% t-interval) | tok/s `ar` / `auto` | TTFT p50 `ar` / `auto` | "
              "TPOT p50 `ar` / `auto` |")
        print("|---:|---:|---|---|---|---|")
    for c in sorted({c for c, _, _ in pairs}, reverse=not args.markdown):
        both = [p for (cc, _, _), p in sorted(pairs.items()) if cc == c and len(p) == 2]
        ratios = [p["auto"]["throughput_tok_s"] / p["ar"]["throughput_tok_s"] for p in both]
        mean, n = statistics.mean(ratios), len(ratios)
        half = T975[n - 1] * statistics.stdev(ratios) / math.sqrt(n) if n > 1 else float("nan")
        tok = {m: statistics.mean(p[m]["throughput_tok_s"] for p in both) for m in ("ar", "auto")}
        med = lambda m, key: statistics.median(p[m][key]["p50"] for p in both)  # noqa: E731
        if args.markdown:
            print(f"| {c} | {n} | **{mean:.3f}x** ({mean - half:.3f}-{mean + half:.3f}) | {tok['ar']:.1f} / "
                  f"{tok['auto']:.1f} | {med('ar', 'ttft_ms') / 1000:.2f} / {med('auto', 'ttft_ms') / 1000:.2f} s | "
                  f"{med('ar', 'tpot_ms'):.1f} / {med('auto', 'tpot_ms'):.1f} ms |")
            continue
        print(f"C={c}: {n} pairs, auto/ar {mean:.3f} (t-interval {mean - half:.3f}-{mean + half:.3f}; "
              f"{min(ratios):.2f}-{max(ratios):.2f}), {sum(r >= 1 for r in ratios)} at or above 1; tok/s ar "
              f"{tok['ar']:.1f} auto {tok['auto']:.1f}; TTFT p50 {med('ar', 'ttft_ms'):.0f} / "
              f"{med('auto', 'ttft_ms'):.0f} ms; TPOT p50 {med('ar', 'tpot_ms'):.1f} / {med('auto', 'tpot_ms'):.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
