"""Where `auto`'s time goes beside `ar`'s where nothing is accepted (`scripts/auto_no_accept.py`'s models): the time
between the starts of successive target steps, summed over the steps before the governor can fire (the first
`PACE_STEPS`) and over those after them, for each method; and `AutoPolicy.choose`'s own time per call, timed in
place (between forwards, with the caches a forward left), not in a hot loop. Alternated A B B A; medians over the
rounds.

    python scripts/auto_host_time.py [--rounds 10 --layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from auto_no_accept import pair, pair_options

from speculant import Session, generate
from speculant.decoding.adaptive import PACE_STEPS, AutoPolicy
from speculant.models.backends.static import KVPool

PROMPT = 200
PREFILL_ROWS = 20  # a call of more rows than this is the prompt's prefill, not a step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    pair_options(parser)
    args = parser.parse_args()
    target, drafter = pair(args)
    session, prompt = Session(target), torch.randint(0, 500, (PROMPT,)).tolist()
    starts: list[float] = []
    chosen: list[float] = []
    run, choose = KVPool.run, AutoPolicy.choose

    def timed_run(pool: KVPool, rows, *rest, **options):
        if pool is target.pool and len(rows) <= PREFILL_ROWS:
            starts.append(time.perf_counter())
        return run(pool, rows, *rest, **options)

    def timed_choose(policy: AutoPolicy, *rest):
        began = time.perf_counter()
        plan = choose(policy, *rest)
        chosen.append(time.perf_counter() - began)
        return plan

    KVPool.run, AutoPolicy.choose = timed_run, timed_choose
    runs = {"ar": dict(method="ar"), "auto": dict(method="auto", drafters=[drafter, "maxgram"])}
    found: dict[str, dict[str, list[float]]] = {label: {"before": [], "after": [], "choose": []} for label in runs}

    def generation(label: str) -> None:
        starts.clear()
        chosen.clear()
        generate(target, prompt_ids=prompt, max_new_tokens=args.tokens, session=session, **runs[label])
        gaps = [later - earlier for earlier, later in zip(starts, starts[1:])]
        found[label]["before"].append(sum(gaps[:PACE_STEPS]))
        found[label]["after"].append(sum(gaps[PACE_STEPS:]))
        found[label]["choose"].append(statistics.mean(chosen) if chosen else 0.0)

    for label in runs:  # warm-up
        generation(label)
        for values in found[label].values():
            values.clear()
    for _ in range(args.rounds):
        for label in ("ar", "auto", "auto", "ar"):
            generation(label)
    names = {"before": f"steps 1-{PACE_STEPS}, ms", "after": f"steps after {PACE_STEPS}, ms",
             "choose": "choose, us a call"}
    scale = {"before": 1e3, "after": 1e3, "choose": 1e6}
    result = {label: {names[part]: statistics.median(values) * scale[part] for part, values in parts.items()}
              for label, parts in found.items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
