"""The Drafter protocol: every draft source (model, n-gram, cascade, tree) proposes through it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from speculant.models.metered import Usage


@dataclass
class Draft:
    """New tokens proposed after a context, with the drafter's distribution for each.

    `probs` [len(tokens), vocab] is q, or None for a deterministic drafter (q is then one-hot).
    `usage` holds the model forwards spent on this draft (and their time), per drafter name.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    usage: dict[str, Usage] = field(default_factory=dict)


@runtime_checkable
class Drafter(Protocol):
    name: str

    def propose(self, context: list[int], k: int) -> Draft:
        """Propose up to k tokens to follow `context` (prompt plus everything committed so far)."""
        ...

    def observe(self, n_accepted: int) -> None:
        """Learn how many of the last proposal's tokens the target accepted."""
        ...
