"""Per-request and per-category decode speed of one method over another in a `speculant bench` run: what "never
slower than plain decoding, per request" is checked against (docs/results/auto-per-request).

    python scripts/per_request.py docs/results/auto-per-request/results.json --method auto --baseline ar

Decode speed is a generation's tokens after its first over its time after the first token (TTFT excluded), as the
bench's decode columns count it; each request (prompt and repeat) is compared with the baseline's same prompt and
repeat, each category by its total tokens over total time. Pure Python (json)."""

from __future__ import annotations

import argparse
import collections
import json
import sys


def decode_rate(row: dict) -> float:
    stats = row["stats"]
    return (stats["new_tokens"] - 1) / (stats["wall_s"] - stats["ttft_s"])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--baseline", default="ar")
    parser.add_argument("--below", type=float, default=0.95, help="list the requests below this ratio")
    args = parser.parse_args(argv)
    rows = json.loads(open(args.results).read())["rows"]
    pairs = collections.defaultdict(dict)
    for row in rows:
        if row["stats"]["new_tokens"] > 1:
            pairs[row["prompt_id"], row["repeat"]][row["method"]] = row
    ratios, totals = [], collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for (prompt, repeat), rows_of in sorted(pairs.items()):
        if args.method not in rows_of or args.baseline not in rows_of:
            continue
        mine, base = rows_of[args.method], rows_of[args.baseline]
        ratios.append((decode_rate(mine) / decode_rate(base), prompt, repeat, mine["stats"]["new_tokens"]))
        total = totals[mine["category"]]
        for i, row in ((0, base), (2, mine)):
            total[i] += row["stats"]["new_tokens"] - 1
            total[i + 1] += row["stats"]["wall_s"] - row["stats"]["ttft_s"]
    ratios.sort()
    below = [r for r in ratios if r[0] < args.below]
    print(f"{args.method} over {args.baseline}, decode: {len(ratios)} requests, {len(below)} below {args.below}x; "
          f"lowest {ratios[0][0]:.3f}x")
    for ratio, prompt, repeat, tokens in below:
        print(f"  {ratio:.3f}x  {prompt} (repeat {repeat}, {tokens} tokens)")
    for category, (base_n, base_s, n, s) in sorted(totals.items()):
        print(f"  {category}: {(n / s) / (base_n / base_s):.3f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
