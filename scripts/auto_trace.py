"""`auto`'s choices step by step through a bench run: why a request ran slower than `ar` (CHANGELOG, "Bounded caches,
tree sampling verification from one transfer": what a translation's first step paid).

    python scripts/auto_trace.py TRACE.json bench --target qwen2.5-coder-1.5b --prompts prompts/mixed.jsonl \
        --max-new-tokens 128 --methods ar auto --out /tmp/trace-bench

Runs `speculant bench` with the arguments after TRACE.json, and writes to TRACE.json one entry per `auto` generation
(the warm-up first, then in the bench's order), each a list of its steps: tokens produced before it, the candidate
chosen (None: plain) and its draft length, whether it was a probe, the tokens the drafter's cache lagged, the tokens
the policy counted on to repay a catch-up, T(1) in ms as auto saw it then, and for a model drafter its catch-up in ms,
its first-position acceptance estimate and its promise."""

from __future__ import annotations

import argparse
import json
import sys

from speculant import cli
from speculant.decoding import adaptive


def main(argv: list[str]) -> int:
    out, bench = argv[0], argv[1:]
    trace: list[list[dict]] = []
    choose, start = adaptive.AutoPolicy.choose, adaptive.AutoPolicy.__init__

    def begun(policy, *args, **kwargs):
        start(policy, *args, **kwargs)
        trace.append([])

    def chosen(policy, context, produced, eos):
        probed = policy.probed
        repays = adaptive.expected_remaining(policy.lengths or (), produced, policy.max_new_tokens)
        plan = choose(policy, context, produced, eos)
        step = {"produced": produced, "chosen": plan.candidate and plan.candidate.name, "k": plan.k,
                "probe": policy.probed > probed, "behind": plan.behind, "repays": repays,
                "t1_ms": policy.cost(1) * 1e3}
        if plan.candidate is not None and plan.candidate.match is None:
            acceptance = plan.candidate.acceptance()
            step |= {"catch_up_ms": plan.candidate.catch_up_s(context) * 1e3, "acceptance_0": acceptance.rate(0),
                     "promise": acceptance.promise()}
        trace[-1].append(step)
        return plan

    adaptive.AutoPolicy.__init__, adaptive.AutoPolicy.choose = begun, chosen
    try:
        return cli.main(bench)
    finally:
        with open(out, "w") as f:
            json.dump(trace, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="the JSON file the steps are written to")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="`speculant` arguments: bench and its options")
    args = parser.parse_args()
    sys.exit(main([args.trace, *args.bench]))
