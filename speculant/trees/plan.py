"""Execution-plan search (Yggdrasil, Guan et al., section 5.2): the tree's depth, width and verify width for a run's
schedule, chosen ahead of decoding from the machine's profiled costs, by the latency-aware objective (Eq. 3) over an
acceptance model; and the width of each tree chosen again per context, by the same objective at the tree's depth.

The acceptance model is the drafter's rank coverage c_r: the chance that the target's token at a position is the
drafter's r-th likeliest (measured by teacher forcing over a text: one forward of each model over it), taken as
independent across positions. An equal-growth tree of width w then has, in expectation, the shape that equal growth
gives rank sequences whose path value is the product of their ranks' coverages, and its expected accepted length is
the sum of its nodes' path values (the same stand-in verify-width pruning uses, `trees.prune`). Per context,
`choose_width` puts the drafter's own sorted probabilities at the tree's root in place of c."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from speculant.config import SCHEDULES
from speculant.trees.prune import best_subtrees
from speculant.trees.tree import TokenTree

PLAN_WIDTHS = (1, 2, 3, 4, 6, 8)  # drafting widths a plan may choose (1: a chain)
PLAN_DEPTHS = tuple(range(1, 13))
COVERAGE_RANKS = max(PLAN_WIDTHS)


def expected_tree(coverage: Sequence[float], depth: int, width: int) -> tuple[TokenTree, list[float]]:
    """The equal-growth tree of `depth` steps of `width` nodes over rank sequences, each node's path value the
    product of `coverage` along its path (`coverage[r]`: the chance the accepted token is the drafter's rank-r
    one): (tree, path values; the root's 1). Its tokens are ranks, not token ids."""
    ranks, parents, values = [0], [-1], [1.0]
    frontier: list[tuple[float, int, int]] = []  # (-value, parent, rank): a heap, likeliest first
    new_nodes = [0]
    for _ in range(depth):
        for node in new_nodes:
            for rank, c in enumerate(coverage[:width]):
                heapq.heappush(frontier, (-values[node] * c, node, rank))
        new_nodes = []
        for _ in range(min(width, len(frontier))):
            value, parent, rank = heapq.heappop(frontier)
            new_nodes.append(len(ranks))
            ranks.append(rank)
            parents.append(parent)
            values.append(-value)
    return TokenTree(tuple(ranks), tuple(parents)), values


def expected_accepted(coverage: Sequence[float], depth: int, width: int, verify_width: int | None = None
                      ) -> dict[int, float]:
    """Expected accepted length (drafted tokens, the target's own one excluded) of the expected tree of `depth` x
    `width`, verifying each subtree size up to `verify_width` drafted nodes (default: all): {nodes verified:
    length}, the best subtree of each size (`best_subtrees`)."""
    tree, values = expected_tree(coverage, depth, width)
    most = len(tree) - 1 if verify_width is None else min(verify_width, len(tree) - 1)
    table = best_subtrees(tree, [0.0, *values[1:]], most + 1)
    return {size - 1: value for size, (value, _) in table.items()}


def first_ranks(tree: TokenTree) -> int:
    """The levels of an expected tree's path of rank-0 nodes from its root: the drafter's likeliest path, its
    first-child path (`TokenTree.first_child_path`), which stage scheduling drafts the next tree after."""
    node, levels = 0, 0
    while (node := next((child for child in tree.children(node) if tree.tokens[child] == 0), None)) is not None:
        levels += 1
    return levels


@dataclass(frozen=True)
class Plan:
    """A tree's execution plan and what the objective expects of it: tokens per second over plain decoding's."""

    depth: int
    width: int
    verify_width: int
    speedup: float


def search(coverage: Sequence[float], target_cost: Callable[[int], float], draft_cost: Callable[[int], float],
           depths: Sequence[int] = PLAN_DEPTHS, widths: Sequence[int] = PLAN_WIDTHS, schedule: str = SCHEDULES[0],
           most_nodes: int | None = None) -> Plan:
    """The plan of the best expected goodput, (1 + expected accepted) / step time, over `depths` x `widths` x the
    verify widths each tree allows (at most `most_nodes`), for a run of `schedule`: serial, a step is the drafter's
    forward of the committed token, `depth` - 1 of `width` tokens (`drafting`) and one target forward
    T(1 + verified); stage, the next tree's drafting hidden behind the verification where its head, drafted after
    the tree's first-child path and the drafter's guess of the target's token (`trees.stage`), is the one taken
    (that path and that token accepted: c_1 to the path's length + 1), else paid after it. `speedup` is the goodput
    over plain decoding's 1 / T(1)."""
    plain = 1.0 / target_cost(1)
    best = Plan(0, 1, 0, 1.0)
    for width in widths:
        for depth in depths:
            drafting_s = drafting(depth, width, draft_cost)
            hit = 0.0 if schedule == "serial" else \
                coverage[0] ** (first_ranks(expected_tree(coverage, depth, width)[0]) + 1)
            for nodes, length in expected_accepted(coverage, depth, width, most_nodes).items():
                if nodes == 0:
                    continue
                verify = target_cost(1 + nodes)
                step = hit * max(drafting_s, verify) + (1 - hit) * (drafting_s + verify)  # (serial: no hit)
                speedup = (1 + length) / step / plain
                if speedup > best.speedup:
                    best = Plan(depth, width, nodes, speedup)
    return best


def drafting(depth: int, width: int, draft_cost: Callable[[int], float]) -> float:
    """Seconds to draft an equal-growth tree: the committed token's forward, then `depth` - 1 of `width` nodes."""
    return draft_cost(1) + (depth - 1) * draft_cost(width)


def rank_coverage(target_logits: torch.Tensor, drafter_logits: torch.Tensor, most: int = COVERAGE_RANKS
                  ) -> list[float]:
    """c_1..c_most: how often the target's greedy token at a position is the drafter's r-th likeliest, from both
    models' logits over the same text ([positions, vocab] each, teacher forced)."""
    wanted = target_logits.argmax(-1)
    top = drafter_logits.topk(most, -1).indices  # [positions, most]
    hits = (top == wanted[:, None]).float().mean(0)
    return [float(h) for h in hits]


def choose_width(probs: torch.Tensor, widths: Sequence[int], target_cost: Callable[[int], float],
                 draft_cost: Callable[[int], float], most_nodes: int, depth: int, exact: bool = False) -> int:
    """The width, among `widths`, whose tree the objective prefers after this context, the drafter's distribution
    at the tree's root (`probs`, [vocab]) standing in for the coverage (a peaked one asks for a chain, a flat one
    for width): each width at its best depth up to `depth` with at most `most_nodes` drafted nodes (`exact`: at
    `depth` itself, a predictor's), every node verified. A few hundred operations: paid on every tree."""
    coverage = probs.topk(max(widths)).values.tolist()
    best, chosen = 0.0, widths[0]
    for width in widths:
        levels = depth if exact else max(min(depth, most_nodes // width), 1)
        values = expected_tree(coverage, levels, width)[1]
        for d in (depth,) if exact else range(1, levels + 1):
            # a tree of d steps is the first d x width nodes equal growth adds (nodes, not levels: a later step adds
            # shallow nodes too)
            length = sum(values[1:1 + d * width])
            goodput = (1 + length) / (drafting(d, width, draft_cost) + target_cost(1 + d * width))
            if goodput > best:
                best, chosen = goodput, width
    return chosen
