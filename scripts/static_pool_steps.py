"""A static handle's step time as the handles sharing its weights grow its pool (1, 4, 16, 64 regions): one decoding
step after a 100-token prompt, median of `--steps`, eager or compiled. A step reads and writes its own region only,
so its time should not depend on the others (gpu.md: compiled, a cache write through a view copied the whole pool).

    python scripts/static_pool_steps.py [--compiled] [--span 2048 --layers 8 --steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from speculant.models.backends.static import StaticCausalLM, StaticWeights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--span", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=2 * args.span,
                         eos_token_id=None, bos_token_id=None)
    handle = StaticCausalLM(StaticWeights(Qwen2ForCausalLM(config).eval()), width=4, span=args.span,
                            compiled=args.compiled)
    others = []
    for regions in (1, 4, 16, 64):
        while len(others) < regions - 1:
            others.append(handle.share())
        handle.prefill(list(range(100)))
        samples = []
        for i in range(args.steps + 3):
            began = time.perf_counter()
            handle.forward([5])
            if i >= 3:
                samples.append(time.perf_counter() - began)
        print(f"{handle.pool.capacity:3d} regions: {statistics.median(samples) * 1e3:8.2f} ms a step", flush=True)


if __name__ == "__main__":
    main()
