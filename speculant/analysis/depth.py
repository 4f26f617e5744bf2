"""Training Yggdrasil's depth predictor (`speculant.trees.depth`) for a target and drafter: greedy tree decoding
at a fixed depth over prompts logs each tree's features and accepted depth; the MLP is scored on a fifth of the
trees (drawn with a fixed seed) after training on the rest, then trained on all of them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from speculant.trees.decoder import tree_speculative
from speculant.trees.drafter import TreeDrafter
from speculant.trees.depth import DepthPredictor, Observation, train

HELD_OUT = 0.2
# What train-depth logs trees on by default: the prompts shipped beside this module (chat, translation,
# summarization, QA, math, RAG; none of them in any benchmark) and HumanEval's problems 30-59 (the benches use :30).
CORPUS = f"{Path(__file__).with_name('depth_corpus.jsonl')}+humaneval[30:60]"


@dataclass
class DepthReport:
    steps: int  # logged trees
    held_out: int  # of them, scored after training on the rest
    accuracy: float  # held-out share whose accepted depth is the predicted distribution's mode
    baseline: float  # the same share for the training trees' most common accepted depth
    mean_error: float  # held-out mean |expected - accepted| depth
    baseline_error: float  # the same for the training trees' mean accepted depth


def log_trees(target, drafter, prompts: Sequence[list[int]], max_new_tokens: int, depth: int,
              width: int) -> list[tuple[Observation, int]]:
    """(observation, accepted depth) of every full-depth tree of greedy tree decoding over the prompts (the
    hidden state in each observation where the target's backend gives it), each generation stopping where the
    target's positions end (a prompt that fills them is refused, as `generate` refuses it)."""
    from speculant.api import room_for

    log: list[tuple[Observation, int]] = []
    tree_drafter = TreeDrafter(drafter, width, verifier=target)
    for ids in prompts:
        room = min(max_new_tokens, room_for(target, len(ids)))
        for _ in tree_speculative(target, tree_drafter, ids, depth, width, room, log=log):
            pass
    return log


def fit(samples: Sequence[tuple[Observation, int]], max_depth: int,
        inputs: str = "features") -> tuple[DepthPredictor, DepthReport]:
    """The predictor reading `inputs` trained on every sample, and how one trained on four fifths scores on the
    rest."""
    shuffled = random.Random(0).sample(list(samples), len(samples))
    cut = int(len(shuffled) * (1 - HELD_OUT))
    if cut < 2 or cut == len(shuffled):  # (a spread to scale the inputs by needs two trees)
        raise ValueError(f"{len(samples)} logged trees are too few to train and score a depth predictor")
    seen, rest = shuffled[:cut], shuffled[cut:]
    trial = train(seen, max_depth, inputs)
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
    return train(samples, max_depth, inputs), report
