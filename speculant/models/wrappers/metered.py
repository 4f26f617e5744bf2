"""A CausalLM that counts its forwards and times the incremental ones, for cost ratios and SWI."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculant.models.base import CausalLM, Delegating
from speculant.trees.tree import TokenTree


@dataclass(frozen=True)
class Usage:
    """Forwards run (prefills included) and the count and seconds of the incremental ones.

    Prefills are counted but not timed: a cost ratio compares decoding steps, and one prompt
    prefill would otherwise outweigh a hundred of them."""

    forwards: int = 0
    steps: int = 0
    seconds: float = 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.forwards + other.forwards, self.steps + other.steps, self.seconds + other.seconds)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.forwards - other.forwards, self.steps - other.steps, self.seconds - other.seconds)


class Metered(Delegating):
    """A CausalLM whose forwards are counted and timed (`usage`); everything else passes straight through."""

    def __init__(self, model: CausalLM):
        super().__init__(model)
        self.usage = Usage()

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        self.usage = Usage(self.usage.forwards + 1, self.usage.steps, self.usage.seconds)
        return self.model.prefill(ids)

    def forward(
        self, ids: Sequence[int], positions: Sequence[int] | None = None, tree: TokenTree | None = None
    ) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.model.forward(ids, positions, tree=tree)
        self._stepped(time.perf_counter() - start)
        return logits

    def catch_up(self, ids: Sequence[int], rows: int = 1) -> torch.Tensor:
        """The wrapped model's own `catch_up` (it may skip the head for the rows it does not return), counted and
        timed as the forward it is."""
        start = time.perf_counter()
        logits = self.model.catch_up(ids, rows)
        self._stepped(time.perf_counter() - start)
        return logits

    def _stepped(self, seconds: float) -> None:
        u = self.usage
        self.usage = Usage(u.forwards + 1, u.steps + 1, u.seconds + seconds)

    passes_trees = True

    def draft_tree(self, root_logits: torch.Tensor, depth: int, width: int) -> tuple[list[int], list[int], list[float]]:
        """A tree's levels in one call (`drafts_trees`), counted as the forwards it ran: one per level it cached."""
        start, cached = time.perf_counter(), self.model.cache_len
        tree = self.model.draft_tree(root_logits, depth, width)
        levels = (self.model.cache_len - cached) // width
        u = self.usage
        self.usage = Usage(u.forwards + levels, u.steps + levels, u.seconds + time.perf_counter() - start)
        return tree


def metered(model: CausalLM) -> Metered:
    """`model` metered, without metering twice."""
    return model if isinstance(model, Metered) else Metered(model)
