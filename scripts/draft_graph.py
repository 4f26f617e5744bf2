"""T(draft) of one equal-growth tree, level by level from Python against its levels in one call (`trees.levels`;
one compiled graph where the drafter is compiled), on the static backend: the median milliseconds of a tree of each
depth below a 200-token context, the trees compared (each node's tokens from the root and its path probability;
the order of candidates of equal scores is the device's, `trees.levels`). Compiled on the CPU, a depth is grown to
the next power of two and cut (`StaticCausalLM.draft_tree`), so depth 2, 4 and 8 time their own graphs; on a GPU each
level runs the compiled step, the levels captured as one CUDA graph (`KVPool.levels_in_steps`). The drafter: a
random Qwen2-shaped model (2 layers of 128 by default), eager and compiled, one thread. scripts/gpu_static.py's
`draft` section calls `draft_costs` on a GPU with the 0.5B's shape.

    python scripts/draft_graph.py docs/results/draft-graph/results.json [--depths 2 4 8 --width 4 --repeats 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from speculant.models.backends.static import StaticCausalLM, StaticWeights
from speculant.trees.drafter import TreeDrafter

CONTEXT = 200


def nodes(tree, path_probs) -> list[tuple[tuple[int, ...], float]]:
    """A tree as its nodes' (tokens from the root, path probability), sorted: the tree whatever its nodes' order."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append((*paths[parent], token) if parent >= 0 else (token,))
    return sorted(zip(paths, path_probs))


def draft_costs(weights: StaticWeights, width: int, depths: list[int], repeats: int, compiled: bool,
                rows: int = 4) -> dict:
    """Per depth: the milliseconds of one tree drafted level by level and in one call (median of `repeats` after a
    warm-up, which compiles), and whether both gave the same tree up to the order of its nodes (random weights over a
    large vocabulary give many candidates of equal scores, which the loop orders by parent and token, `topk` as the
    device does). Both drafters draft on one handle (a second would grow its weights' pool: new shapes, compiled
    again)."""
    device = weights.device
    context = torch.randint(0, weights.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    model = StaticCausalLM(weights, width=rows, span=1024, compiled=compiled)
    for depth in depths:
        row = {}
        trees = {}
        for label, graph in (("levels", False), ("one call", True)):
            drafter = TreeDrafter(model, width, graph=graph)
            samples, trees[label] = [], []
            for i in range(repeats + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                began = time.perf_counter()
                draft = drafter.propose_tree(context, depth, width)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples.append(time.perf_counter() - began)
                trees[label].append(nodes(draft.tree, draft.path_probs))
            row[f"{label} ms"] = statistics.median(samples[1:]) * 1e3
            row[f"{label} first ms"] = samples[0] * 1e3
        row["equal"] = trees["levels"] == trees["one call"]  # every tree
        row["levels / one call"] = row["levels ms"] / row["one call ms"]
        out[f"depth {depth}"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = Qwen2Config(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
                         max_position_embeddings=4096, eos_token_id=None, bos_token_id=None)
    weights = StaticWeights(Qwen2ForCausalLM(config).eval())
    result = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "drafter": f"{args.layers} layers x {args.hidden}, vocabulary 4096", "width": args.width}
    for compiled in (False, True):
        result["compiled" if compiled else "eager"] = draft_costs(weights, args.width, args.depths, args.repeats,
                                                                  compiled)
        print(json.dumps(result, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
