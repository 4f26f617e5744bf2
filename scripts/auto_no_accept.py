"""`auto` against `ar` where nothing is accepted, on a model whose forward takes ~2 ms or less on a CPU: a GPU's
per-step budget, where auto's own work per step (choosing, Max-Gram's lookups, probing a drafter) is no longer noise
beside a forward. The target: Qwen2-shaped, random weights drawn wide (initializer_range 1) so that its greedy text
does not repeat and Max-Gram finds nothing; the drafter: another random model, never right. The static backend,
eager, one thread, caches of `--span` positions (the prompt and the new tokens fit). `ar` and `auto` (that drafter
and Max-Gram) alternate A B B A in one session (scripts/gpu_static.py's `alternated`); the bar is auto >= 0.97x ar,
read with the 95% bootstrap interval over the A B B A rounds (a shared machine's speed drifts within a run), and in
CPU time of the decoding thread too (whole generations: the same prefill in both), which the neighbours of a shared
machine disturb less than the wall clock: auto's own work is what it adds.

    python scripts/auto_no_accept.py docs/results/auto-no-accept/results.json [--repeats 40 --layers 2 --span 512]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from gpu_static import alternated, timed
from transformers import Qwen2Config, Qwen2ForCausalLM

from speculant import Session
from speculant.bench.bootstrap import ratio_interval
from speculant.machine import machine_info
from speculant.models.backends.static import StaticCausalLM, StaticWeights


def by_round(values: list[float]) -> list[tuple[int, float]]:
    """Each generation's value with its A B B A round (two generations of each method a round)."""
    return [(i // 2, value) for i, value in enumerate(values)]


def mean(rows: list[tuple[int, float]]) -> float:
    return statistics.mean(value for _, value in rows)


def round_of(row: tuple[int, float]) -> int:
    return row[0]


def random_model(layers: int, hidden: int, span: int) -> StaticCausalLM:
    config = Qwen2Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
                         max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, initializer_range=1.0)
    return StaticCausalLM(StaticWeights(Qwen2ForCausalLM(config).eval()), width=4, span=span)


def pair_options(parser: argparse.ArgumentParser) -> None:
    """The options of `pair`, shared by the scripts that time it."""
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="the target's layers: as many as give a forward of "
                                                                "~2 ms (the results carry T(1))")
    parser.add_argument("--span", type=int, default=512, help="cached positions (200 prompt tokens, the new ones)")


def pair(args: argparse.Namespace) -> tuple[StaticCausalLM, StaticCausalLM]:
    """The target and the never-right drafter, from seed 0, on one thread."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return random_model(args.layers, 128, args.span), random_model(1, 64, args.span)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=40, help="A B B A rounds")
    pair_options(parser)
    args = parser.parse_args()
    target, drafter = pair(args)
    target.prefill(list(range(200)))
    t1 = timed(lambda: target.forward([1]), 50, "cpu")  # (the median: a shared machine's forwards spike)
    runs = {"ar": dict(method="ar"), "auto": dict(method="auto", drafters=[drafter, "maxgram"])}
    result = {"machine": machine_info(), "layers": args.layers, "span": args.span, "T(1) ms": t1 * 1e3,
              **alternated(target, runs, args.repeats, args.tokens, Session(target))}
    wall = {label: by_round(result[f"{label} decode tok/s"]) for label in runs}
    cpu = {label: by_round(result[f"{label} thread cpu s"]) for label in runs}  # (seconds: ar's over auto's)
    result["auto / ar per round"] = [mean(wall["auto"][i:i + 2]) / mean(wall["ar"][i:i + 2])
                                     for i in range(0, 2 * args.repeats, 2)]
    result["auto / ar 95% interval over rounds"] = ratio_interval(wall["auto"], wall["ar"], mean, round_of)
    result["auto / ar in CPU time"] = mean(cpu["ar"]) / mean(cpu["auto"])
    result["auto / ar in CPU time, 95% interval"] = ratio_interval(cpu["ar"], cpu["auto"], mean, round_of)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
