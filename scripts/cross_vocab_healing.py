"""Greedy agreement of a drafter with another tokenizer, with and without token healing (docs/results/cross-vocab.md,
"Token healing").

    python scripts/cross_vocab_healing.py                                   # HumanEval[:8] at 64 tokens, mixed at 48
    python scripts/cross_vocab_healing.py --drafter smollm2-135m --sets "humaneval[:8]:64"

Along the target's greedy continuations (teacher-forced, `speculant.analysis.acceptance.estimate`), the share of
positions where the drafter's string-level greedy draft starts with the target's token, and the mean run of such
matches, once as `drafters/cross_vocab.py` drafts (healing: it drafts from the context without its last token, first
choosing among the tokens that start with that token's text) and once with healing turned off. Why: a drafter's own
tokenization of the committed text often ends inside a word where the target's tokens ended (`quick|sort`), where
its next-token distribution is unnatural (Timor et al. 2025 on drafting across vocabularies).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="smollm2-135m")
    parser.add_argument("--sets", nargs="+", default=["humaneval[:8]:64", "prompts/mixed.jsonl:48"],
                        help="DATASET:NEW_TOKENS, each estimated apart")
    args = parser.parse_args(argv)

    from speculant.analysis.acceptance import estimate
    from speculant.api import encode_prompt
    from speculant.bench.datasets import load_dataset
    from speculant.config import SamplingConfig
    from speculant.drafters.cross_vocab import CrossVocabDrafter
    from speculant.drafters.spec import load_drafter
    from speculant.models import load_model

    target = load_model(args.target)
    drafter = load_drafter(args.drafter, target)
    healed = CrossVocabDrafter._heal
    for spec in args.sets:
        dataset, tokens = spec.rsplit(":", 1)
        prompts = [encode_prompt(target.tokenizer, p.text, p.chat) for p in load_dataset(dataset)]
        for name, heal in (("healed", healed), ("not healed", lambda self, own: (own, [], 0))):
            CrossVocabDrafter._heal = heal
            report = estimate(target, [drafter], prompts, int(tokens), SamplingConfig())[0]
            print(f"{dataset}, {tokens} tokens, {name}: agreement {report.agreement:.1%}, mean run "
                  f"{report.mean_run:.2f} ({report.positions} positions)")
    CrossVocabDrafter._heal = healed


if __name__ == "__main__":
    main(sys.argv[1:])
