"""OpenAI's `logit_bias` on the target: a constant added to chosen tokens' logits in every row the target returns.

Speculation stays exact because the bias is part of the target that verifies: greedy output equals greedy
`ar` on the same biased target token for token, and sampling follows the biased distribution. Drafts are
proposed without it; a draft token the bias rules out is simply rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from speculant.config import as_integer, as_number
from speculant.errors import ConfigError
from speculant.models.base import CausalLM, Wrapper
from speculant.trees.tree import TokenTree

LIMIT = 100.0  # OpenAI's range: -100 bans a token, 100 forces it


def check_bias(bias: Mapping[int, float], vocab_size: int) -> None:
    """A ConfigError naming the first token id that is not an integer in the vocabulary, or bias that is not a number
    in [-100, 100] (`config.as_integer`, `as_number`)."""
    check_bias_type(bias)
    for token, value in bias.items():
        if as_integer(token) is None:
            raise ConfigError(f"logit_bias token ids must be integers, got {token!r}")
        if not 0 <= token < vocab_size:
            raise ConfigError(f"logit_bias token ids must lie in [0, {vocab_size}), got {token!r}")
        if as_number(value) is None:
            raise ConfigError(f"logit_bias values must be numbers, got {value!r} for {token}")
        if not -LIMIT <= value <= LIMIT:
            raise ConfigError(f"logit_bias values must lie in [-{LIMIT:g}, {LIMIT:g}], got {value!r} for {token}")


def check_bias_type(bias: Any) -> None:
    """A ConfigError where `bias` is not a mapping of token ids to biases."""
    if not isinstance(bias, Mapping):
        raise ConfigError(f"logit_bias must map token ids to biases ({{id: bias}}), got {type(bias).__name__}")


class Biased(Wrapper):
    """A CausalLM whose logits carry `bias` ({token id: added logit}); everything else passes through."""

    def __init__(self, model: CausalLM, bias: Mapping[int, float]):
        check_bias(bias, model.vocab_size)
        super().__init__(model)
        self._ids = torch.tensor([int(token) for token in bias], dtype=torch.long)
        self._values = torch.tensor([float(value) for value in bias.values()], dtype=torch.float32)

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., self._ids.to(logits.device)] += self._values.to(logits.device, logits.dtype)
        return logits

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return self._biased(self.model.prefill(ids))

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        return self._biased(self.model.forward(ids, positions, tree=tree))
