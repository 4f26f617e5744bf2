"""TokenTree: a draft tree as data, and the pure functions that turn it into attention masks, position
ids and root-to-leaf paths (SpecInfer, Medusa, Sequoia, Yggdrasil all verify such trees in one pass).

Node 0 is the root: the last committed token, which the target has not run yet. Every other node is a
drafted token whose parent comes earlier in the list (topological order).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1; parents[i] < i

    def __post_init__(self) -> None:
        if isinstance(self.tokens, torch.Tensor) or isinstance(self.parents, torch.Tensor):  # (a drafter's own tree)
            raise TypeError("a tree's tokens and parents are tuples of ints, not tensors (use .tolist())")
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a tree needs one parent per token and at least the root")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("parents must precede their children and node 0 must be the root")

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return tuple(depths)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: node i may attend to node j iff j is i or one of its ancestors."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for i in range(1, len(self)):
            mask[i] |= mask[self.parents[i]]
        return mask

    def positions(self, root_position: int) -> list[int]:
        """Position ids: the root's position plus each node's depth."""
        return [root_position + d for d in self.depths]

    @cached_property
    def child_lists(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children, in node order."""
        children: list[list[int]] = [[] for _ in range(len(self))]
        for node in range(1, len(self)):
            children[self.parents[node]].append(node)
        return tuple(map(tuple, children))

    def children(self, node: int) -> list[int]:
        return list(self.child_lists[node])

    def path_to(self, node: int) -> list[int]:
        path = [node]
        while path[-1] != 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def first_child_path(self) -> list[int]:
        """The tokens along each node's first child from the root: a greedy tree drafter's likeliest path."""
        tokens, node = [], 0
        while self.child_lists[node]:
            node = self.child_lists[node][0]
            tokens.append(self.tokens[node])
        return tokens

    def subtree(self, nodes: list[int]) -> TokenTree:
        """The tree of `nodes` (which must include the root and each node's parent), renumbered in order."""
        keep = sorted(set(nodes))
        index = {node: i for i, node in enumerate(keep)}
        if keep[0] != 0 or any(self.parents[n] not in index for n in keep[1:]):
            raise ValueError("a subtree keeps the root and the parent of every node it keeps")
        return TokenTree(tuple(self.tokens[n] for n in keep), (-1, *(index[self.parents[n]] for n in keep[1:])))
