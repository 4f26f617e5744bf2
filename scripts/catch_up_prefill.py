"""A cache's catch-up on a new prompt three ways: as a forward (a logits row per token), as `catch_up` (the forward's
rows, the output head for the last only: what `models.base.resync` runs) and as a prefill of the whole prompt
(docs/results/cpu.md, "A drafter's catch-up without the rows it throws away").

    python scripts/catch_up_prefill.py [--out F.json]   # HumanEval/6 after HumanEval/5, medians of 5, interleaved

Loads the lean 1.5B and its `@lean` 0.5B drafter; for each, prefills what the two prompts share, then times the rest
of the new prompt each way and prints the medians in seconds. Why: where a cache keeps less than an eighth of what it
lacks, `models.base.prefills` catches up by a prefill, else by `catch_up`; `auto` prices a prefill as the prefill it
is and a `catch_up` as a forward of its rows (`methods.auto.catch_up_cost`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval[:10]")
    parser.add_argument("--new", type=int, default=6, help="index of the prompt caught up on")
    parser.add_argument("--last", type=int, default=5, help="index of the prompt the cache held")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the medians (seconds) here as JSON")
    args = parser.parse_args(argv)

    from speculant.api import encode_prompt
    from speculant.bench.datasets import load_dataset
    from speculant.models.base import common_prefix_len
    from speculant.models.loading import load_lean

    target = load_lean("qwen2.5-coder-1.5b")
    drafter = load_lean("qwen2.5-coder-0.5b", target.tokenizer, draft=True)
    prompts = load_dataset(args.dataset)
    ids, last = (encode_prompt(target.tokenizer, prompts[i].text) for i in (args.new, args.last))
    keep = common_prefix_len(ids, last)
    results = {"kept": keep, "prompt": len(ids)}
    for model in (drafter, target):
        times: dict[str, list[float]] = {"forward": [], "catch_up": [], "prefill": []}
        for _ in range(args.repeats):
            for way, run in (("forward", lambda: model.forward(ids[keep:])),
                             ("catch_up", lambda: model.catch_up(ids[keep:])), ("prefill", lambda: model.prefill(ids))):
                model.prefill(ids[:keep])
                began = time.perf_counter()
                run()
                times[way].append(time.perf_counter() - began)
        results[model.name] = {way: statistics.median(values) for way, values in times.items()}
        print(model.name, f"kept {keep} of {len(ids)};", ", ".join(
            f"as a {way} {seconds:.3f} s" for way, seconds in results[model.name].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
