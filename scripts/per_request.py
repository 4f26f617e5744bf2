"""Per-request and per-category decode speed of one method over another in a `speculant bench` run: what "never
slower than plain decoding, per request" is checked against (docs/results/auto-per-request).

    python scripts/per_request.py docs/results/auto-per-request/results.json --method auto --baseline ar

Decode speed is a generation's tokens after its first over its time after the first token (TTFT excluded), as the
bench's decode columns count it. A request (a prompt) is compared with the baseline's same prompt over all the
run's repeats of both (total tokens over total time: the bench runs them A B, then B A, so a drift of the machine
within the prompt's runs weighs on both alike); each single run with the baseline's run of the same repeat too (the
noise of one generation on a shared machine); the baseline against itself, its even repeats over its odd ones (how
far apart the same method's runs of a request fall, minutes apart, the machine's drift over the run included); each
category by its total tokens over total time. Pure Python."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def decode_time(row: dict) -> tuple[int, float]:
    """(tokens after the first, seconds after the first token) of one generation."""
    stats = row["stats"]
    return stats["new_tokens"] - 1, stats["wall_s"] - stats["ttft_s"]


def ratio(mine: list[dict], base: list[dict]) -> float:
    """Decode tokens per second over all of `mine` over the same of `base`."""
    (n, s), (base_n, base_s) = ([sum(x) for x in zip(*map(decode_time, rows))] for rows in (mine, base))
    return (n / s) / (base_n / base_s)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a bench's results.json, or the folder that holds it")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--baseline", default="ar")
    parser.add_argument("--below", type=float, default=0.95, help="list the requests below this ratio")
    parser.add_argument("--short", type=int, default=0, help="list the requests whose replies are shorter than this, "
                        "with what the method's first step chose (a model drafter first catches up on the prompt)")
    args = parser.parse_args(argv)
    results = args.results / "results.json" if args.results.is_dir() else args.results
    if not results.is_file():
        parser.error(f"no bench results at {results}")
    rows = json.loads(results.read_text())["rows"]
    runs = collections.defaultdict(lambda: collections.defaultdict(list))  # prompt -> method -> its repeats' rows
    category = {}
    for row in rows:
        if row["stats"]["new_tokens"] > 1 and row["method"] in (args.method, args.baseline):
            runs[row["prompt_id"]][row["method"]].append(row)
            category[row["prompt_id"]] = row["category"]
    pairs = {p: (sorted(m[args.method], key=lambda r: r["repeat"]), sorted(m[args.baseline], key=lambda r: r["repeat"]))
             for p, m in runs.items() if len(m[args.method]) == len(m[args.baseline]) > 0}
    requests = sorted((ratio(mine, base), prompt, len(mine)) for prompt, (mine, base) in pairs.items())
    singles = sorted((ratio([a], [b]), prompt, a["repeat"]) for prompt, (mine, base) in pairs.items()
                     for a, b in zip(mine, base))
    below = [r for r in requests if r[0] < args.below]
    print(f"{args.method} over {args.baseline}, decode: {len(requests)} requests (each over its repeats), "
          f"{len(below)} below {args.below}x; lowest {requests[0][0]:.3f}x")
    for value, prompt, repeats in below:
        print(f"  {value:.3f}x  {prompt} ({repeats} repeats)")
    single_below = [r for r in singles if r[0] < args.below]
    print(f"single runs: {len(singles)}, {len(single_below)} below {args.below}x; lowest {singles[0][0]:.3f}x "
          f"({singles[0][1]}, repeat {singles[0][2]})")
    halves = sorted((ratio(base[0::2], base[1::2]), prompt) for prompt, (_, base) in pairs.items() if len(base) > 1)
    if halves:  # the noise floor: the baseline against itself, its even repeats over its odd ones
        apart = [r for r in halves if not args.below < r[0] < 1 / args.below]
        print(f"{args.baseline} against itself (even repeats over odd, a run's length apart): {len(apart)} of "
              f"{len(halves)} requests beyond {args.below}x either way; {halves[0][0]:.3f}x to {halves[-1][0]:.3f}x")
    for name in sorted(set(category.values())):
        mine = [r for p, (m, _) in pairs.items() if category[p] == name for r in m]
        base = [r for p, (_, b) in pairs.items() if category[p] == name for r in b]
        print(f"  {name}: {ratio(mine, base):.3f}x")
    print(f"  all: {ratio([r for m, _ in pairs.values() for r in m], [r for _, b in pairs.values() for r in b]):.3f}x")
    short = [(value, prompt, pairs[prompt][0]) for value, prompt, _ in requests
             if args.short and max(r["stats"]["new_tokens"] for r in pairs[prompt][0]) < args.short]
    if short:  # where a drafter's catch-up on the prompt has the fewest tokens to be repaid over
        print(f"replies under {args.short} tokens: {len(short)} requests")
        for value, prompt, mine in short:
            first = collections.Counter(r["stats"]["choices"][0] for r in mine if r["stats"].get("choices"))
            print(f"  {value:.3f}x  {prompt} ({max(r['stats']['new_tokens'] for r in mine)} tokens; first step: "
                  f"{', '.join(f'{c} x{n}' for c, n in first.items())})")


if __name__ == "__main__":
    main(sys.argv[1:])
