"""Verify-width pruning (Yggdrasil, Guan et al., section 4.2): after drafting, keep the subtree that
maximizes the latency-aware objective, expected accepted length over the cost of drafting plus one
target forward of the kept nodes (Eq. 3), a tree-knapsack dynamic program over subtree sizes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from speculant.trees.tree import TokenTree


def best_subtrees(tree: TokenTree, values: Sequence[float], max_nodes: int) -> dict[int, tuple[float, tuple[int, ...]]]:
    """For each size m <= max_nodes, the subtree of m nodes containing the root (and each kept node's
    parent) with the largest total value: {m: (value, nodes)}. O(len(tree) max_nodes^2)."""
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{} for _ in range(len(tree))]
    for v in reversed(range(len(tree))):  # children come after their parents
        table = {1: (float(values[v]), (v,))}
        for c in tree.child_lists[v]:
            merged = dict(table)  # taking nothing below c
            for m1, (a, nodes_a) in table.items():
                for m2, (b, nodes_b) in best[c].items():
                    m = m1 + m2
                    if m <= max_nodes and (m not in merged or a + b > merged[m][0]):
                        merged[m] = (a + b, nodes_a + nodes_b)
            table = merged
        best[v] = table
    return best[0]


def prune(tree: TokenTree, path_probs: Sequence[float], verify_width: int,
          cost: Callable[[int], float] | None = None, draft_seconds: float = 0.0) -> list[int]:
    """The nodes to verify: at most `verify_width` drafted nodes plus the root.

    A node's path probability stands in for its acceptance probability, so a subtree's expected
    accepted length is 1 plus the sum over its drafted nodes. Without `cost` (T(n), seconds of a target
    forward over n tokens) the largest best subtree is kept; with it, the size that maximizes expected
    accepted length / (draft_seconds + T(n)).
    """
    values = [0.0, *path_probs[1:]]
    table = best_subtrees(tree, values, verify_width + 1)
    if cost is None:
        size = max(table)
    else:
        size = max(table, key=lambda m: (1 + table[m][0]) / (draft_seconds + cost(m)))
    return sorted(table[size][1])
