"""Greedy agreement of the lean 1.5B with some of its layers left out against all of them (docs/results/cpu.md,
"Self-speculation by layer skipping"), the probe that priced `self@skip` before it was built.

    python scripts/layer_skip_agreement.py                       # ~2 minutes on 2 cores
    python scripts/layer_skip_agreement.py --counts 4 7 10 14

Teacher-forced over three HumanEval prompts (humaneval[10:13]) and the first 3000 characters of the stdlib's
textwrap.py, 160 tokens each: each middle layer's importance is the share of positions whose argmax stays the full
model's when that layer alone is skipped; then the N least important are skipped together, for each N of
--counts, and their agreement printed. Why: self-speculation (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et al.
2025) pays only if a draft that streams fewer bytes still agrees often; Leviathan et al.'s expected improvement
(Theorem 3.8) needs both numbers. `models/backends/layer_skip.py` runs the same ranking on the offline corpus to pick the
layers `self@skip` leaves out.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import sysconfig


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--counts", nargs="+", type=int, default=[4, 7, 10, 14], help="layers skipped together")
    parser.add_argument("--tokens", type=int, default=160, help="positions per text")
    args = parser.parse_args(argv)

    import torch

    from speculant.bench.datasets import load_dataset
    from speculant.models.loading import load_lean

    target = load_lean(args.model)
    texts = [p.text for p in load_dataset("humaneval[10:13]")]
    texts.append(pathlib.Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()[:3000])
    seqs = [target.tokenizer(t)["input_ids"][:args.tokens] for t in texts]

    def choices(skip: set[int]) -> torch.Tensor:
        model = target.skipping(sorted(skip)) if skip else target
        out = []
        for ids in seqs:
            model.rollback(0)
            out.append(model.forward(ids).argmax(-1))
        return torch.cat(out)

    full = choices(set())
    alone = {i: (choices({i}) == full).float().mean().item() for i in range(1, target.config.layers - 1)}
    for n in args.counts:
        skip = set(sorted(alone, key=alone.get, reverse=True)[:n])
        print(n, sorted(skip), round((choices(skip) == full).float().mean().item(), 3))


if __name__ == "__main__":
    main(sys.argv[1:])
