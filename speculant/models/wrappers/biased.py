"""OpenAI's `logit_bias` on the target: a constant added to chosen tokens' logits in every row the target returns.

Speculation stays exact because the bias is part of the target that verifies: greedy output equals greedy
`ar` on the same biased target token for token, and sampling follows the biased distribution. Drafts are
proposed without it; a draft token the bias rules out is simply rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import torch

from speculant.errors import ConfigError
from speculant.models.base import CausalLM, Wrapper
from speculant.trees.tree import TokenTree

LIMIT = 100.0  # OpenAI's range: -100 bans a token, 100 forces it


def check_bias(bias: Mapping[int, float], vocab_size: int) -> None:
    """A ConfigError naming the first token id outside the vocabulary or bias outside [-100, 100]."""
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ConfigError(f"logit_bias token ids must lie in [0, {vocab_size}), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -LIMIT <= value <= LIMIT:
            raise ConfigError(f"logit_bias values must lie in [-{LIMIT:g}, {LIMIT:g}], got {value!r} for {token}")


class Biased(Wrapper):
    """A CausalLM whose logits carry `bias` ({token id: added logit}); everything else passes through."""

    def __init__(self, model: CausalLM, bias: Mapping[int, float]):
        check_bias(bias, model.vocab_size)
        super().__init__(model)
        self._ids = torch.tensor(list(bias), dtype=torch.long)
        self._values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., self._ids.to(logits.device)] += self._values.to(logits.device, logits.dtype)
        return logits

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return self._biased(self.model.prefill(ids))

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        return self._biased(self.model.forward(ids, positions, tree=tree))
