"""A cache's catch-up on a new prompt run as a forward against the same run as a prefill (docs/results/cpu.md,
"Catch-ups by prefill").

    python scripts/catch_up_prefill.py                 # HumanEval/6 after HumanEval/5, medians of 5

Loads the lean 1.5B and its `@lean` 0.5B drafter; for each, prefills what the two prompts share, then times the
rest of the new prompt as one forward (a logits row per token) and the whole prompt as a prefill (one logits row),
and prints both medians in seconds. Why: where a cache keeps less than an eighth of what it lacks,
`models.base.prefills` catches up by a prefill, and `auto` prices a catch-up as one; this shows the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval[:10]")
    parser.add_argument("--new", type=int, default=6, help="index of the prompt caught up on")
    parser.add_argument("--last", type=int, default=5, help="index of the prompt the cache held")
    parser.add_argument("--repeats", type=int, default=5)
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
    for model in (drafter, target):
        as_forward, as_prefill = [], []
        for _ in range(args.repeats):
            model.prefill(ids[:keep])
            began = time.perf_counter()
            model.forward(ids[keep:])
            as_forward.append(time.perf_counter() - began)
            began = time.perf_counter()
            model.prefill(ids)
            as_prefill.append(time.perf_counter() - began)
        print(model.name, f"kept {keep} of {len(ids)}; as a forward {statistics.median(as_forward):.3f} s, "
              f"as a prefill {statistics.median(as_prefill):.3f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
