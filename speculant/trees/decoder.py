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
from speculant.decoding.step import verify_step
from speculant.errors import OptionError
from speculant.drafters.base import Draft
from speculant.trees.drafter import TreeDrafter
from speculant.models.base import CausalLM
from speculant.models.wrappers.metered import metered
from speculant.trees.depth import INPUTS, DepthPredictor, Observation, Recent, features
from speculant.sampling import next_token
from speculant.trees.prune import prune
from speculant.trees.stage import Ahead


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
    log: list[tuple[Observation, int]] | None = None,
    schedule: str = "serial",
) -> Decoder:
    """Lossless tree speculation: greedy output equals greedy autoregressive decoding, samples follow p.

    `verify_width` caps the drafted nodes the target verifies (default: all depth x width); `cost`,
    T(n) of the target in seconds, makes `depth` a cap and lets the latency-aware objective decide how
    deep to draft and how many nodes to verify: level by level, or with a depth `predictor` (and `cost`)
    before drafting. `log` collects what a predictor trains on: each tree of all `depth` drafting steps'
    (observation, accepted depth). `schedule="stage"` drafts each next tree during the verification of this one
    (`trees.stage`; such trees stop by the per-level rule, not the predictor).
    """
    stats = GenerationStats(method="tree", tree_shape=(depth, width, verify_width))
    out: list[int] = []
    target = metered(target)
    last = target.prefill(prompt_ids)  # the target's logits at the last committed token
    reads = set(INPUTS) if log is not None else {predictor.inputs} if predictor is not None else set()
    reads_hidden = target.capabilities.hidden_states and "hidden" in reads
    hidden = target.last_hidden[-1] if reads_hidden else None  # its hidden state there
    if predictor is not None and predictor.inputs == "hidden" and hidden is not None and \
            hidden.numel() != predictor.width:  # (a file made for another target: before any token)
        raise OptionError("depth_predictor", f"this depth predictor reads hidden states of {predictor.width} numbers; "
                          f"the target's have {hidden.numel()} (train one for it: speculant train-depth)")
    pending = [next_token(last, sampling, generator)]
    recent, step_s = Recent(), None  # the trees' acceptance; the drafter's seconds per level, once measured
    ahead = Ahead(drafter, stats.record_usage) if schedule == "stage" else None
    try:
        while not (yield from emit(pending, out, max_new_tokens, target.eos_token_ids)):
            context = prompt_ids + out
            room = min(depth, max_new_tokens - len(out) - 1)
            # (the features' softmax over the vocabulary only where they are read: a decode step's cost)
            x = Observation(features(last, recent) if "features" in reads else [],  # (the predictor's on the CPU)
                            hidden.float().cpu() if hidden is not None else None) if reads else None
            draft = ahead.take(context, room) if ahead is not None else None
            if draft is None and predictor is not None and cost is not None and step_s is not None and room > 0:
                draft = drafter.propose_tree(context, min(room, predictor.depth(x, cost, step_s, width)), width)
            elif draft is None:
                draft = drafter.propose_tree(context, room, width, cost)
            usage = draft.usage[drafter.name]
            if usage.steps:
                step_s = usage.seconds / usage.steps
            drafted_nodes = len(draft.tree) - 1
            if drafted_nodes:  # (equal growth: a width's nodes at every level)
                stats.tree_widths.append(draft.tree.depths.count(1))
            if verify_width is not None and (verify_width < drafted_nodes or cost is not None):
                kept = prune(draft.tree, draft.path_probs, verify_width, cost, usage.seconds)
                draft = Draft([], None, draft.usage, draft.tree.subtree(kept))
            if ahead is not None and len(draft.tree) > 1:  # the next tree, drafted while the target verifies this one
                ahead.start(context, draft.tree, depth, width, cost)
            step = verify_step(target, out[-1], draft, sampling, generator)
            last, hidden = step.logits, step.hidden if reads_hidden else None
            if log is not None and drafted_nodes == depth * width:  # a whole tree (none cut to the positions left)
                log.append((x, len(step.accepted)))
            recent.observe(len(step.accepted), step.drafted)
            # Per iteration: the tree's depth (the most that could be accepted) and the accepted depth.
            stats.record_draft(step.drafted, len(step.accepted), draft.usage)
            stats.drafted_nodes += drafted_nodes
            stats.verified_sizes.append(step.width - 1)  # the verify width this iteration used
            pending = step.tokens
    finally:
        if ahead is not None:
            ahead.close()
            stats.stage = ahead.record
    stats.new_tokens = len(out)
    stats.record_target(target.usage)
    return stats
