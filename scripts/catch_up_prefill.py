"""A cache's catch-up on a new prompt three ways: as a forward (a logits row per token), as `catch_up` (the forward's
rows, the output head for the last only: what `models.base.resync` runs) and as a prefill of the whole prompt
(docs/results/cpu.md, "A drafter's catch-up without the rows it throws away").

    python scripts/catch_up_prefill.py [--out F.json]   # HumanEval/6 after HumanEval/5, medians, A B B A
    python scripts/catch_up_prefill.py --lags 100 400 1000 2000 [--keep 6]   # the 0.5B, a synthetic context

Loads the lean 1.5B and its `@lean` 0.5B drafter; for each, prefills what the two prompts share, then times the rest
of the new prompt each way and prints the medians in seconds. With `--lags`, the 0.5B alone after `--keep` tokens:
`catch_up` and prefill at each lag, beside what its machine profile predicts of each (`LatencyProfile.catch_up_s`,
`prefill_s`) and the way `LatencyProfile.prefills` chooses, which a drafter's cache runs where auto read its profile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval[:10]")
    parser.add_argument("--new", type=int, default=6, help="index of the prompt caught up on")
    parser.add_argument("--last", type=int, default=5, help="index of the prompt the cache held")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the medians (seconds) here as JSON")
    parser.add_argument("--lags", type=int, nargs="*", help="the 0.5B's catch-ups of these lengths after --keep")
    parser.add_argument("--keep", type=int, default=6)
    args = parser.parse_args(argv)

    from speculant.api import encode_prompt
    from speculant.bench.datasets import load_dataset
    from speculant.models.base import common_prefix_len
    from speculant.models.loading import load_lean

    target = load_lean("qwen2.5-coder-1.5b")
    drafter = load_lean("qwen2.5-coder-0.5b", target.tokenizer, draft=True)
    if args.lags:
        return lags(drafter, args)
    prompts = load_dataset(args.dataset)
    ids, last = (encode_prompt(target.tokenizer, prompts[i].text) for i in (args.new, args.last))
    keep = common_prefix_len(ids, last)
    results = {"kept": keep, "prompt": len(ids)}
    for model in (drafter, target):
        results[model.name] = medians(model, ids[:keep], {"forward": lambda: model.forward(ids[keep:]),
                                                          "catch_up": lambda: model.catch_up(ids[keep:]),
                                                          "prefill": lambda: model.prefill(ids)}, args.repeats)
        print(model.name, f"kept {keep} of {len(ids)};", ", ".join(
            f"as a {way} {seconds:.3f} s" for way, seconds in results[model.name].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


def medians(model, kept: list[int], ways: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each way, each run after a prefill of `kept`; every repeat runs the ways in order, then
    back (A B B A: a drift of the machine falls on each alike)."""
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way in [*ways, *reversed(ways)]:
            model.prefill(kept)
            began = time.perf_counter()
            ways[way]()
            times[way].append(time.perf_counter() - began)
    return {way: statistics.median(values) for way, values in times.items()}


def lags(model, args) -> None:
    """`catch_up` against a prefill after `args.keep` tokens, at each of `args.lags`, alternated, medians."""
    from speculant.latency import machine_profile

    profile, keep = machine_profile(model), args.keep
    ids = [(7919 * i + 11) % model.vocab_size for i in range(keep + max(args.lags))]
    results = {}
    for lag in args.lags:
        ways = {"catch_up": lambda: model.catch_up(ids[keep:keep + lag]),
                "prefill": lambda: model.prefill(ids[:keep + lag])}
        results[lag] = {**medians(model, ids[:keep], ways, args.repeats),
                        "profile: catch_up": profile.catch_up_s(keep, lag),
                        "profile: prefill": profile.prefill_s(keep + lag),
                        "chosen": "prefill" if profile.prefills(keep, lag) else "catch_up"}
        print(lag, json.dumps(results[lag]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": model.name, "keep": keep, "seconds": results}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
