"""Equal-growth draft trees (Yggdrasil, Guan et al., section 4.1): every drafting step adds exactly
`width` nodes, the frontier candidates with the highest path probability anywhere in the tree, and
scores them in one batched tree forward of the drafter model, so shapes stay static (fewer only where fewer
candidates have any probability: under structured output, where the grammar allows fewer)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from speculant.drafters.base import Draft, Drafter
from speculant.drafters.model import guided
from speculant.models.base import CausalLM, DraftCache
from speculant.models.wrappers.metered import Usage, metered
from speculant.trees.tree import TokenTree


class TreeDrafter(Drafter):
    """Greedy tree drafting with a model: `depth` steps of `width` nodes (depth x width drafted nodes), as a
    Drafter whose drafts are trees (`propose`: k steps of its `width`; `propose_tree` for other shapes and the
    latency-aware stop). `model` may be a chain drafter's DraftCache: the tree then catches up from where the
    chain left it. With a `chooser` (`trees.shape.WidthChooser`), each tree's width is chosen after its context,
    from the drafter's distribution at its root, instead; with a `shape` (a tree of ranks, `trees.baselines`),
    every tree has that shape, drafted level by level (Sequoia-style and N-way trees). With `graph`, a tree of a
    depth decided before drafting, on a model that `drafts_trees` (the static backend), grows on the device in one
    call (one compiled graph: `trees.levels`). Its `verifier` (the target) bounds a tree's nodes, by the positions its
    cache has left and the nodes one of its tree forwards takes, as the drafter's own positions do: trees are cut to
    fit. Under structured output (the verifier's `draft_guide`) each node's children are those the grammar allows
    after its path, as a chain drafter's tokens are (the target rejects any other at once), drafted level by level."""

    def __init__(self, model: CausalLM | DraftCache, width: int,
                 chooser: Callable[[torch.Tensor, int, bool], int] | None = None, shape: TokenTree | None = None,
                 graph: bool = False, verifier: CausalLM | None = None):
        self.cache = model if isinstance(model, DraftCache) else DraftCache(metered(model))
        self.model = self.cache.model
        self.name = self.model.name
        self.width = width
        self.chooser = chooser
        self.shape = shape
        self.guide = verifier.draft_guide if verifier is not None else None
        self.graph = graph and self.model.capabilities.drafts_trees and self.guide is None
        self.positions = [m.max_positions for m in (verifier, self.model) if m is not None and m.max_positions]
        self.most_nodes = verifier.capabilities.tree_nodes if verifier is not None else None

    def free(self, length: int) -> int | None:
        """The nodes a tree after a context of `length` tokens may draft: each takes a cache slot of the verifier's
        (and, but for the last level, of the drafter's) after the context's, and one verification takes at most
        the verifier's `tree_nodes`; None where nothing bounds them."""
        bounds = [n - length for n in self.positions] + ([self.most_nodes] if self.most_nodes is not None else [])
        return min(bounds) if bounds else None

    def fit(self, length: int, depth: int, width: int) -> tuple[int, int]:
        """`depth` levels of `width` nodes cut to the slots left after a context of `length`: fewer levels, and
        where not one level fits, one narrower level (no level where no slot is left)."""
        free = self.free(length)
        if free is None or depth * width <= free:
            return depth, width
        return (free // width, width) if free >= width else (min(depth, 1) if free > 0 else 0, max(free, 1))

    def most(self, context: list[int]) -> int | None:
        """The levels of its width a tree after `context` can hold (`fit`; one narrower level where no whole one
        fits, 0 where no slot is left); None where nothing bounds them."""
        return None if self.free(len(context)) is None else self.fit(len(context), 1 << 30, self.width)[0]

    def propose(self, context: list[int], k: int) -> Draft:
        return self.propose_tree(context, k, self.width)

    def lag(self, context: list[int]) -> int:
        """Tokens of `context` the drafter's cache lacks: what its next tree runs before drafting."""
        return self.cache.lag(context)

    def propose_tree(self, context: list[int], depth: int, width: int,
                     cost: Callable[[int], float] | None = None) -> Draft:
        """A tree rooted at context[-1], with each node's path probability under the drafter.

        With `cost`, the target's forward time T(n) for n tokens, `depth` is a cap: drafting stops as
        soon as no further step can raise the latency-aware objective (Yggdrasil Eq. 3), expected
        accepted length / (drafting time + T(tree size)), path probabilities standing in for acceptance.
        The drafter's `chooser` replaces `width` by its choice for a tree of up to `depth` levels (without `cost`:
        of `depth` levels, a depth decided).
        """
        depth = self.fit(len(context), depth, 1)[0]  # (no slot left, no tree; the width is fitted once known)
        if depth <= 0:
            return self.root_only(context, Usage())
        if self.shape is not None:
            return self.propose_shape(context, depth)
        before = self.model.usage
        logits = self.cache.run(context)  # the tree nodes cached after it are dropped by the next run
        if self.guide is not None and (logits := guided(self.guide, logits, context)) is None:
            return self.root_only(context, self.model.usage - before)
        if self.chooser is not None:
            width = self.chooser(torch.softmax(logits[-1].float(), -1), depth, cost is None)
        depth, width = self.fit(len(context), depth, width)
        if self.graph and cost is None and depth > 1:
            tokens, parents, scores = self.model.draft_tree(logits[-1], depth, width)
            tokens[0] = context[-1]
            return self._drafted(tokens, parents, scores, before)
        tokens, parents, scores = [context[-1]], [-1], [0.0]
        frontier: list[tuple[float, int, int]] = []  # (path log-probability, parent node, token)
        new_nodes = [0]
        for step in range(depth):
            rows = torch.log_softmax(logits, -1) if self.guide is None or step == 0 else \
                self._guided_rows(logits, context, tree, new_nodes)
            for node, row in zip(new_nodes, rows):
                if row is None:  # (the grammar allows nothing after its path)
                    continue
                values, ids = row.topk(width)
                frontier += [(scores[node] + value, node, token) for value, token in zip(values.tolist(), ids.tolist())
                             if value > -math.inf]
            frontier.sort(reverse=True)
            chosen, frontier = frontier[:width], frontier[width:]
            if not chosen:  # (no token the drafter gives a probability, or the grammar allows)
                break
            new_nodes = list(range(len(tokens), len(tokens) + len(chosen)))
            for score, parent, token in chosen:
                tokens.append(token)
                parents.append(parent)
                scores.append(score)
            if step == depth - 1:  # the last step's children would never be used
                break
            spent = self.model.usage - before
            if cost is not None and not worth_another_step(scores, frontier, new_nodes, width, cost, spent.seconds,
                                                           spent.seconds / max(spent.steps, 1)):
                break
            tree = TokenTree(tuple(tokens), tuple(parents))
            logits = self.model.forward(tokens[-len(chosen):], tree=tree)
        return self._drafted(tokens, parents, scores, before)

    def propose_shape(self, context: list[int], depth: int) -> Draft:
        """The drafter's `shape`, its levels up to `depth`: a node of rank r is the drafter's r-th likeliest token
        after its parent; one forward per level, over that level's nodes."""
        assert self.shape is not None
        before = self.model.usage
        depths = self.shape.depths
        free = self.free(len(context))
        while free is not None and depth > 0 and sum(0 < d <= depth for d in depths) > free:
            depth -= 1  # (the levels whose nodes fit the slots left)
        if depth == 0:
            return self.root_only(context, Usage())
        logits = self.cache.run(context)[-1:]  # rows: the last level's nodes, in order
        tokens, parents, scores = [context[-1]], [-1], [0.0]
        row_of = {0: 0}  # the last level's nodes, each's row in `logits`
        tree = TokenTree((context[-1],), (-1,))
        for d in range(1, min(depth, max(depths)) + 1):
            if self.guide is None:
                rows = torch.log_softmax(logits.float(), -1)
            else:  # (a node the grammar allows no child of keeps the shape's children: they are rejected)
                allowed = self._guided_rows(logits.float(), context, tree, list(row_of))
                rows = [torch.log_softmax(plain.float(), -1) if row is None else row
                        for row, plain in zip(allowed, logits)]
            added = []
            for node in (n for n in range(len(self.shape)) if depths[n] == d):
                parent = self.shape.parents[node]
                values, ids = rows[row_of[parent]].topk(self.shape.tokens[node] + 1)
                tokens.append(int(ids[-1]))
                parents.append(parent)
                scores.append(scores[parent] + float(values[-1]))
                added.append(node)
            if d < min(depth, max(depths)):
                tree = TokenTree(tuple(tokens), tuple(parents))
                logits = self.model.forward(tokens[-len(added):], tree=tree)
            row_of = {node: i for i, node in enumerate(added)}
        return self._drafted(tokens, parents, scores, before)

    def _guided_rows(self, logits: torch.Tensor, context: list[int], tree: TokenTree,
                     nodes: list[int]) -> list[torch.Tensor | None]:
        """The log-probabilities of the children of each of `tree`'s `nodes` (`logits`, a row per node) with what the
        guide forbids after the node's path at -inf; None for a node after which it allows nothing."""
        rows: list[torch.Tensor | None] = []
        for node, row in zip(nodes, logits):
            allowed = guided(self.guide, row, context + [tree.tokens[n] for n in tree.path_to(node)[1:]])
            rows.append(None if allowed is None else torch.log_softmax(allowed, -1))
        return rows

    def _drafted(self, tokens: list[int], parents: list[int], scores: list[float], before: Usage) -> Draft:
        """The tree of `tokens` and `parents` with its nodes' path probabilities (from the log-probabilities
        `scores`), and the drafter's usage since `before`."""
        return Draft([], usage={self.name: self.model.usage - before}, tree=TokenTree(tuple(tokens), tuple(parents)),
                     path_probs=[math.exp(v) for v in scores])

    def root_only(self, context: list[int], usage: Usage) -> Draft:
        """The tree of the root alone (the context's last token): a draft of nothing, where no node fits or the
        grammar allows none."""
        return Draft([], usage={self.name: usage}, tree=TokenTree((context[-1],), (-1,)), path_probs=[1.0])


def worth_another_step(scores: list[float], frontier: list[tuple[float, int, int]], new_nodes: list[int], width: int,
                       cost: Callable[[int], float], spent: float, step_seconds: float) -> bool:
    """Whether one more drafting step could raise expected accepted length / (drafting time + T(n)).

    The step adds `width` nodes, each no likelier than a leftover frontier candidate or a parent among
    the newest nodes, so their summed path probability is at most the top `width` of those; later
    steps add less at more cost, so when this bound does not pay, no deeper tree does.
    """
    value = sum(math.exp(v) for v in scores[1:])
    candidates = [math.exp(v) for v, _, _ in frontier] + [math.exp(scores[n]) for n in new_nodes] * width
    bound = sum(sorted(candidates, reverse=True)[:width])
    now = (1 + value) / (spent + cost(len(scores)))
    after = (1 + value + bound) / (spent + step_seconds + cost(len(scores) + width))
    return after > now
