"""The static tree shapes Yggdrasil's Fig. 11 sets equal-growth trees against, as trees of drafter ranks (node
tokens are ranks: 0 the drafter's likeliest token after the parent, 1 the next), in depth order (each level's
nodes after the level before: drafted one forward per level).

- Sequoia (Chen et al. 2024, section 3.1): the tree of n nodes with the largest expected accepted length when a
  token of rank r is accepted with probability c_r independently of the rest (their positional acceptance vector;
  here the drafter's rank coverage, `trees.plan.rank_coverage`). A node's value is the product of its path's
  c_r; values fall along a path, so the best n nodes are found best first and form a tree.
- N-way: n chains, the root's n likeliest children each followed by the drafter's greedy continuation (the
  shape of n independent drafts, SpecInfer's and SpecTr's multi-draft baseline)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from speculant.trees.tree import TokenTree


def in_depth_order(ranks: Sequence[int], parents: Sequence[int]) -> TokenTree:
    """The tree renumbered level by level (the root first), each level's nodes in their order of creation."""
    depths = [0] * len(ranks)
    for i in range(1, len(ranks)):
        depths[i] = depths[parents[i]] + 1
    order = sorted(range(len(ranks)), key=lambda i: (depths[i], i))
    index = {old: new for new, old in enumerate(order)}
    return TokenTree(tuple(ranks[i] for i in order), (-1, *(index[parents[i]] for i in order[1:])))


def sequoia_shape(coverage: Sequence[float], nodes: int, depth: int) -> TokenTree:
    """The `nodes` drafted nodes, at most `depth` deep, of the largest total path value under `coverage` (ranks
    0..len(coverage) - 1)."""
    ranks, parents, levels = [0], [-1], [0]
    frontier = [(-c, 0, r) for r, c in enumerate(coverage)]  # (-value, parent, rank)
    heapq.heapify(frontier)
    while frontier and len(ranks) <= nodes:
        value, parent, rank = heapq.heappop(frontier)
        node = len(ranks)
        ranks.append(rank)
        parents.append(parent)
        levels.append(levels[parent] + 1)
        if levels[node] < depth:
            for r, c in enumerate(coverage):
                heapq.heappush(frontier, (value * c, node, r))
    return in_depth_order(ranks, parents)


def nway_shape(ways: int, depth: int) -> TokenTree:
    """`ways` chains of `depth` nodes: the root's `ways` likeliest children, each continued greedily."""
    ranks, parents = [0], [-1]
    for way in range(ways):
        parent = 0
        for level in range(depth):
            ranks.append(way if level == 0 else 0)
            parents.append(parent)
            parent = len(ranks) - 1
    return in_depth_order(ranks, parents)
