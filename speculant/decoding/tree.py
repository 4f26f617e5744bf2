"""Token-tree speculative decoding (SpecInfer; Yggdrasil): the drafter proposes a tree, the target
scores every node in one forward with tree attention, greedy verification keeps the longest path
that matches the target's argmax, and the target's KV cache keeps only that path."""

from __future__ import annotations

from speculant.config import SamplingConfig
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.drafters.tree import TreeDrafter
from speculant.models.base import CausalLM
from speculant.models.metered import metered
from speculant.sampling import next_token
from speculant.verify import verify_tree_greedy


def tree_speculative(
    target: CausalLM,
    drafter: TreeDrafter,
    prompt_ids: list[int],
    depth: int,
    width: int,
    max_new_tokens: int,
) -> Decoder:
    """Greedy tree speculation; output equals greedy autoregressive decoding."""
    stats = GenerationStats(method="tree")
    out: list[int] = []
    target = metered(target)
    logits = target.prefill(prompt_ids)
    pending = [next_token(logits, SamplingConfig(), None)]
    while not (yield from emit(pending, out, max_new_tokens, target.eos_token_ids)):
        tree, usage = drafter.propose_tree(prompt_ids + out, min(depth, max_new_tokens - len(out) - 1), width)
        cached = target.cache_len
        target_logits = target.forward(list(tree.tokens), tree=tree)  # [len(tree), vocab]
        path, token = verify_tree_greedy(tree, target_logits)
        target.keep(list(range(cached)) + [cached + node for node in [0, *path]])
        # Per iteration: the tree's depth (the most that could be accepted) and the accepted depth.
        stats.record_draft(max(tree.depths), len(path), {drafter.name: usage})
        stats.drafted_nodes += len(tree) - 1
        pending = [tree.tokens[node] for node in path] + [token]
    stats.new_tokens = len(out)
    stats.record_target(target.usage)
    return stats
