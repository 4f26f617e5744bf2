"""Equal-growth draft trees (Yggdrasil, Guan et al., section 4.1): every drafting step adds exactly
`width` nodes, the frontier candidates with the highest path probability anywhere in the tree, and
scores them in one batched tree forward of the drafter model, so shapes stay static."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from speculant.drafters.model import resync
from speculant.models.base import CausalLM
from speculant.models.metered import Usage, metered
from speculant.tree import TokenTree


@dataclass(frozen=True)
class TreeDraft:
    tree: TokenTree
    path_probs: list[float]  # per node: the product of draft probabilities from the root (root: 1)
    usage: Usage


class TreeDrafter:
    """Greedy tree drafting with a model: `depth` steps of `width` nodes (depth x width drafted nodes)."""

    def __init__(self, model: CausalLM):
        self.model = metered(model)
        self.name = model.name
        self._cached: list[int] = []

    def propose_tree(self, context: list[int], depth: int, width: int) -> TreeDraft:
        """A tree rooted at context[-1], with each node's path probability under the drafter."""
        if depth == 0:
            return TreeDraft(TokenTree((context[-1],), (-1,)), [1.0], Usage())
        before = self.model.usage
        logits = resync(self.model, self._cached, context)
        self._cached = context  # the tree nodes cached after it are dropped by the next resync
        tokens, parents, scores = [context[-1]], [-1], [0.0]
        frontier: list[tuple[float, int, int]] = []  # (path log-probability, parent node, token)
        new_nodes = [0]
        for step in range(depth):
            for node, row in zip(new_nodes, torch.log_softmax(logits, -1)):
                values, ids = row.topk(width)
                frontier += [(scores[node] + float(v), node, int(t)) for v, t in zip(values, ids)]
            frontier.sort(reverse=True)
            chosen, frontier = frontier[:width], frontier[width:]
            new_nodes = list(range(len(tokens), len(tokens) + len(chosen)))
            for score, parent, token in chosen:
                tokens.append(token)
                parents.append(parent)
                scores.append(score)
            if step < depth - 1:  # the last step's children would never be used
                tree = TokenTree(tuple(tokens), tuple(parents))
                logits = self.model.forward(tokens[-len(chosen):], tree=tree)
        return TreeDraft(TokenTree(tuple(tokens), tuple(parents)), [math.exp(v) for v in scores],
                         self.model.usage - before)
