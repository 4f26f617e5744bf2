"""Prefix caching: the KV cache of prompts already run, kept by token prefix, so that a request starts from the
longest prefix of its prompt that an earlier request computed (a conversation's history, an agent's system prompt)
instead of prefilling it again.

One radix tree over token ids per set of weights (SGLang's RadixAttention, Zheng et al. 2024, sec. 3): each edge
holds the keys and values of its tokens' positions, so prompts that share a prefix share its memory. The trees
live within a memory budget, the least recently used leaves evicted first.

Exact by construction: a backend that `reuses_prefixes` computes a prompt's whole blocks of positions
(`prefix_block`) with the same bits whichever call runs them, each position a function of the tokens up to it
(not of the later positions in its block), so only whole blocks are kept and restored, though two prompts that
part within a block each keep their side of it; what a request computes after the restored prefix, and so every
token and log-probability it returns, is what it computes without the cache. Positions computed by decoding (a
reply) are never kept: their bits differ from a prefill's, which is how a fresh server would compute them in the
next turn's prompt.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from speculant.models.base import CausalLM, common_prefix_len


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]  # the edge from the parent
    kv: tuple[Any, ...]  # the positions of `tokens`, as the model's `export_kv` gave them
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the cache's clock when last restored or stored

    @property
    def size(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)


def _cut(kv: tuple[Any, ...], start: int, stop: int | None = None) -> tuple[Any, ...]:
    """Positions [start, stop) of an edge's keys and values (`export_kv`'s tensors: positions on their third axis)."""
    return tuple(t[:, :, start:stop].clone() for t in kv)


class PrefixCache:
    """Prompts' leading KV positions for the models of one server, within `budget_mb` (0: off).

    `restore(model, ids)` before a prefill, `store(model, ids)` after it; `on_lookup(hit, tokens_saved)` hears of
    each restore (metrics). Not thread-safe: a server's batcher calls it from its one worker thread."""

    def __init__(self, budget_mb: float, on_lookup: Callable[[bool, int], None] | None = None):
        self.budget = int(budget_mb * 2**20)
        self.on_lookup = on_lookup
        self.roots: dict[Any, _Node] = {}
        self.bytes = 0
        self.clock = 0
        self.hits = self.lookups = self.saved = 0

    def _usable(self, model: CausalLM) -> int | None:
        """The model's block of positions, where the cache can hold its prefixes."""
        if self.budget <= 0 or not model.capabilities.reuses_prefixes:
            return None
        return model.prefix_block

    def _root(self, model: CausalLM) -> _Node:
        return self.roots.setdefault((model.weights_key, model.numerics), _Node((), ()))

    def _walk(self, root: _Node, ids: Sequence[int]) -> list[tuple[_Node, int]]:
        """The edges along `ids` from `root`, each with how many of its tokens match (all but the last's)."""
        path, node, at = [], root, 0
        while at < len(ids) and (child := node.children.get(ids[at])) is not None:
            matched = common_prefix_len(child.tokens, tuple(ids[at:at + len(child.tokens)]))
            path.append((child, matched))
            at += matched
            if matched < len(child.tokens):
                break
            node = child
        return path

    def cached(self, model: CausalLM, ids: Sequence[int]) -> int:
        """How many leading positions of `ids` `restore` would put into `model`'s cache (nothing is touched)."""
        block = self._usable(model)
        if block is None or (root := self.roots.get((model.weights_key, model.numerics))) is None:
            return 0
        return _restorable(self._walk(root, ids), ids, block)

    def restore(self, model: CausalLM, ids: Sequence[int]) -> int:
        """Put into `model`'s cache the longest cached prefix of `ids` in whole blocks, leaving at least the last
        token to run (its logits are the prefill's); return its length (0: nothing restored, the cache untouched)."""
        block = self._usable(model)
        if block is None:
            return 0
        path = self._walk(self._root(model), ids)
        length = _restorable(path, ids, block)
        self.lookups += 1
        self.clock += 1
        if length > 0:
            pieces, at = [], 0
            for node, matched in path:
                take = min(matched, length - at)
                if take <= 0:
                    break
                pieces.append(node.kv if take == len(node.tokens) else tuple(t[:, :, :take] for t in node.kv))
                node.used = self.clock
                at += take
            model.import_kv(pieces)
            self.hits += 1
            self.saved += length
        if self.on_lookup is not None:
            self.on_lookup(length > 0, length)
        return length

    def store(self, model: CausalLM, ids: Sequence[int]) -> None:
        """Keep the whole blocks of `ids`, whose positions `model`'s cache holds as a prefill computed them."""
        block = self._usable(model)
        if block is None:
            return
        ids = tuple(ids[:min(len(ids), model.cache_len) // block * block])
        node, at = self._root(model), 0
        self.clock += 1
        for child, matched in self._walk(node, ids):
            if matched < len(child.tokens):
                if at + matched == len(ids):  # held already, within an edge
                    child.used = self.clock
                    at = len(ids)
                    break
                child = self._split(child, matched)
            child.used = self.clock
            node, at = child, at + matched
        if at < len(ids):
            leaf = _Node(ids[at:], model.export_kv(at, len(ids)), node, used=self.clock)
            node.children[ids[at]] = leaf
            self.bytes += leaf.size
        self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens: a new node holds the first part, `node` the rest below it."""
        head = _Node(node.tokens[:at], _cut(node.kv, 0, at), node.parent, used=node.used)
        node.parent.children[head.tokens[0]] = head
        node.tokens, node.kv, node.parent = node.tokens[at:], _cut(node.kv, at), head
        head.children[node.tokens[0]] = node
        return head

    def _evict(self) -> None:
        """Drop the least recently used leaves until the trees fit the budget (a parent left without children
        becomes a leaf in its turn)."""
        if self.bytes <= self.budget:
            return
        leaves = [(n.used, id(n), n) for root in self.roots.values() for n in _nodes(root)
                  if not n.children and n.parent]
        heapq.heapify(leaves)
        while self.bytes > self.budget and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self.bytes -= leaf.size
            if not parent.children and parent.parent is not None:
                heapq.heappush(leaves, (parent.used, id(parent), parent))

    def tokens(self) -> int:
        """Positions held, over every model."""
        return sum(len(n.tokens) for root in self.roots.values() for n in _nodes(root))


def _restorable(path: list[tuple[_Node, int]], ids: Sequence[int], block: int) -> int:
    """The positions of `ids` a walk's `path` holds, in whole blocks, leaving at least the last token to run."""
    return max(0, min(sum(matched for _, matched in path), len(ids) - 1) // block * block)


def _nodes(root: _Node) -> list[_Node]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
