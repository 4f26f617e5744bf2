"""`auto` against `ar` where nothing is accepted, on a model whose forward takes ~2 ms on this CPU: a GPU's per-step
budget, where auto's own work per step (choosing, Max-Gram's lookups, probing a drafter) is no longer noise beside a
forward. The target: Qwen2-shaped, random weights drawn wide (initializer_range 1) so that its greedy text does
not repeat and Max-Gram finds nothing; the drafter: another random model, never right. The static backend, eager,
one thread. `ar` and `auto` (that drafter and Max-Gram) alternate A B B A in one session (scripts/gpu_static.py's
`alternated`); the bar is auto >= 0.97x ar.

    python scripts/auto_no_accept.py docs/results/auto-no-accept/results.json [--repeats 5 --tokens 256]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from gpu_static import alternated
from transformers import Qwen2Config, Qwen2ForCausalLM

from speculant import Session
from speculant.models.backends.static import StaticCausalLM, StaticWeights


def random_model(layers: int, hidden: int) -> StaticCausalLM:
    config = Qwen2Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
                         max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, initializer_range=1.0)
    return StaticCausalLM(StaticWeights(Qwen2ForCausalLM(config).eval()), width=4, span=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3, help="the target's layers (~2 ms a forward at 3 here)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    target, drafter = random_model(args.layers, 128), random_model(1, 64)
    target.prefill(list(range(200)))
    began = time.perf_counter()
    for _ in range(50):
        target.forward([1])
    t1 = (time.perf_counter() - began) / 50
    runs = {"ar": dict(method="ar"), "auto": dict(method="auto", drafters=[drafter, "maxgram"])}
    result = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "T(1) ms": t1 * 1e3,
              **alternated(target, runs, args.repeats, args.tokens, Session(target))}
    result["auto / ar per round"] = [statistics.mean(result["auto decode tok/s"][i:i + 2]) /
                                     statistics.mean(result["ar decode tok/s"][i:i + 2])
                                     for i in range(0, 2 * args.repeats, 2)]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
