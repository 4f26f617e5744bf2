"""Token-tree speculative decoding (SpecInfer; Yggdrasil): the drafter proposes a tree, the target
scores every node in one forward with tree attention, verification keeps the longest accepted path
(greedy: the target's argmax; sampling: multi-draft rejection sampling) and the target's KV cache
keeps only that path. Verify-width pruning may shrink the tree before the target sees it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from speculant.config import SamplingConfig
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.drafters.tree import TreeDrafter
from speculant.models.base import CausalLM
from speculant.models.metered import metered
from speculant.tree import TokenTree
from speculant.tree_depth import DepthPredictor, Recent, features
from speculant.sampling import logits_to_probs, next_token
from speculant.tree_prune import prune
from speculant.verify import verify_tree_greedy, verify_tree_sampling


def tree_speculative(
    target: CausalLM,
    drafter: TreeDrafter,
    prompt_ids: list[int],
    depth: int,
    width: int,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    verify_width: int | None = None,
    cost: Callable[[int], float] | None = None,
    predictor: DepthPredictor | None = None,
    log: list[tuple[list[float], int]] | None = None,
) -> Decoder:
    """Lossless tree speculation: greedy output equals greedy autoregressive decoding, samples follow p.

    `verify_width` caps the drafted nodes the target verifies (default: all depth x width); `cost`,
    T(n) of the target in seconds, makes `depth` a cap and lets the latency-aware objective decide how
    deep to draft and how many nodes to verify: level by level, or with a depth `predictor` (and `cost`)
    before drafting. `log` collects what a predictor trains on: each tree of all `depth` drafting steps'
    (features, accepted depth).
    """
    stats = GenerationStats(method="tree", tree_shape=(depth, width, verify_width))
    out: list[int] = []
    target = metered(target)
    last = target.prefill(prompt_ids)  # the target's logits at the last committed token
    pending = [next_token(last, sampling, generator)]
    recent, step_s = Recent(), None  # the trees' acceptance; the drafter's seconds per level, once measured
    while not (yield from emit(pending, out, max_new_tokens, target.eos_token_ids)):
        room = min(depth, max_new_tokens - len(out) - 1)
        x = features(last, recent) if predictor is not None or log is not None else None
        if predictor is not None and cost is not None and step_s is not None and room > 0:
            draft = drafter.propose_tree(prompt_ids + out, min(room, predictor.depth(x, cost, step_s, width)), width)
        else:
            draft = drafter.propose_tree(prompt_ids + out, room, width, cost)
        if draft.usage.steps:
            step_s = draft.usage.seconds / draft.usage.steps
        tree = draft.tree
        if verify_width is not None and (verify_width < len(tree) - 1 or cost is not None):
            tree = tree.subtree(prune(tree, draft.path_probs, verify_width, cost, draft.usage.seconds))
        path, token, last = verify_tree(target, tree, sampling, generator)
        if log is not None and room == depth:  # a tree of every drafting step
            log.append((x, len(path)))
        recent.observe(len(path), max(tree.depths))
        # Per iteration: the tree's depth (the most that could be accepted) and the accepted depth.
        stats.record_draft(max(tree.depths), len(path), {drafter.name: draft.usage})
        stats.drafted_nodes += len(draft.tree) - 1
        stats.verified_sizes.append(len(tree) - 1)  # the verify width this iteration used
        pending = [tree.tokens[node] for node in path] + [token]
    stats.new_tokens = len(out)
    stats.record_target(target.usage)
    return stats


def verify_tree(target: CausalLM, tree: TokenTree, sampling: SamplingConfig,
                generator: torch.Generator | None) -> tuple[list[int], int, torch.Tensor]:
    """One target forward over a tree rooted at the last committed token, with tree attention, then tree
    verification: (accepted nodes, the target's token after them, the logits it was chosen from). The
    target's cache keeps the root and the accepted path."""
    cached = target.cache_len
    target_logits = target.forward(list(tree.tokens), tree=tree)  # [len(tree), vocab]
    if sampling.greedy:
        path, token = verify_tree_greedy(tree, target_logits)
    else:
        path, token = verify_tree_sampling(tree, logits_to_probs(target_logits, sampling), generator)
    target.keep(list(range(cached)) + [cached + node for node in [0, *path]])
    return path, token, target_logits[path[-1] if path else 0]
