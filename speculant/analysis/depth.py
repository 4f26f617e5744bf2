"""Training Yggdrasil's depth predictor (`speculant.trees.depth`) for a target and drafter: greedy tree decoding
at a fixed depth over prompts logs each tree's features and accepted depth; the MLP is scored on a fifth of the
trees (drawn with a fixed seed) after training on the rest, then trained on all of them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from speculant.trees.decoder import tree_speculative
from speculant.trees.drafter import TreeDrafter
from speculant.trees.depth import DepthPredictor, train

HELD_OUT = 0.2


@dataclass
class DepthReport:
    steps: int  # logged trees
    held_out: int  # of them, scored after training on the rest
    accuracy: float  # held-out share whose accepted depth is the predicted distribution's mode
    baseline: float  # the same share for the training trees' most common accepted depth
    mean_error: float  # held-out mean |expected - accepted| depth
    baseline_error: float  # the same for the training trees' mean accepted depth


def log_trees(target, drafter, prompts: Sequence[list[int]], max_new_tokens: int, depth: int,
              width: int) -> list[tuple[list[float], int]]:
    """(features, accepted depth) of every full-depth tree of greedy tree decoding over the prompts."""
    log: list[tuple[list[float], int]] = []
    tree_drafter = TreeDrafter(drafter, width)
    for ids in prompts:
        for _ in tree_speculative(target, tree_drafter, ids, depth, width, max_new_tokens, log=log):
            pass
    return log


def fit(samples: Sequence[tuple[list[float], int]], max_depth: int) -> tuple[DepthPredictor, DepthReport]:
    """The predictor trained on every sample, and how one trained on four fifths scores on the rest."""
    shuffled = random.Random(0).sample(list(samples), len(samples))
    cut = int(len(shuffled) * (1 - HELD_OUT))
    if cut < 1 or cut == len(shuffled):
        raise ValueError(f"{len(samples)} logged trees are too few to train and score a depth predictor")
    seen, rest = shuffled[:cut], shuffled[cut:]
    trial = train(seen, max_depth)
    predicted = [trial.accepted(x) for x, _ in rest]
    expected = [float((p * p.new_tensor(range(max_depth + 1))).sum()) for p in predicted]
    depths = [a for _, a in seen]
    common, mean = max(range(max_depth + 1), key=depths.count), sum(depths) / len(depths)
    report = DepthReport(
        len(samples), len(rest),
        sum(int(p.argmax()) == a for p, (_, a) in zip(predicted, rest)) / len(rest),
        sum(a == common for _, a in rest) / len(rest),
        sum(abs(e - a) for e, (_, a) in zip(expected, rest)) / len(rest),
        sum(abs(mean - a) for _, a in rest) / len(rest))
    return train(samples, max_depth), report
