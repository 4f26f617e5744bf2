"""Prefill time of the lean 1.5B by prompt length and part size (docs/results/serve-long-prompt.md).

    python scripts/prefill_parts.py
    python scripts/prefill_parts.py --lengths 256 512 1024 2048 --parts 128 256 512 4096

For each prompt length and each value of `models.base.PREFILL_PART` (4096: the whole prompt in one part), the best
of --repeats prefills of a fixed token sequence, in seconds. Compare with llama.cpp's prompt evaluation on the same
GGUF: `llama-bench -m model.gguf -p 256,512,1024,2048 -n 0 -r 2 -fa 1 -ctk bf16 -ctv bf16 -t 2`. Why: a served long
prompt is prefilled in parts so that running requests decode between them; this shows what the part size costs
the prompt itself.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048])
    parser.add_argument("--parts", nargs="+", type=int, default=[128, 256, 512, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from speculant.models import base
    from speculant.models.loading import load_lean

    torch.set_num_threads(args.threads)
    model = load_lean("qwen2.5-coder-1.5b")
    model.prefill([1, 2, 3])  # warm-up
    for n in args.lengths:
        ids = [(7919 * i + 11) % 150000 for i in range(n)]
        for part in args.parts:
            base.PREFILL_PART = part
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                model.prefill(ids)
                seconds.append(time.perf_counter() - start)
            print(n, part, round(min(seconds), 2), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
