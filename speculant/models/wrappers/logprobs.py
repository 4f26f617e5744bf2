"""Log-probabilities of the tokens a decoder commits (OpenAI's `logprobs`), read off the target's own forwards.

`Recorded` wraps a CausalLM and keeps the logits each forward computed, by the cache position of the token
they follow; rollback and compaction (`keep`) drop and move them as they do the cache. The token a decoder
commits at position P was chosen from the row of position P - 1, which every method computed anyway (the
prefill's last row, a plain step's, or a verification's), so reading it costs no forward: the values are the
target's distribution before temperature, top-k or top-p (vLLM's default), and on a row-invariant backend
they are the same with and without speculation, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import torch

from speculant.models.base import CausalLM, Wrapper
from speculant.trees.tree import TokenTree

MAX_TOP = 20  # the most alternatives a token's entry lists (OpenAI's bound)


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token, its log-probability under the target, and the `top` likeliest tokens there
    (likeliest first, as (token, log-probability))."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Recorded(Wrapper):
    """A CausalLM whose forwards' logits stay readable by cache position until `take` reads them, in the order
    the tokens are committed; everything but prefill, forward, rollback and keep passes straight through."""

    def __init__(self, model: CausalLM, top: int = 0):
        if not 0 <= top <= MAX_TOP:
            raise ValueError(f"top log-probabilities must lie in [0, {MAX_TOP}], got {top}")
        super().__init__(model)
        self.top = top
        self._rows: dict[int, torch.Tensor] = {}  # cache position -> logits of the token after it
        self._next = 0  # the cache position of the next committed token

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        logits = self.model.prefill(ids)
        self._rows = {len(ids) - 1: logits.reshape(-1, logits.shape[-1])[-1].detach().float().clone()}
        self._next = len(ids)
        return logits

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        start = self.model.cache_len
        logits = self.model.forward(ids, positions, tree=tree)
        rows = logits.detach().float().clone()  # a backend may reuse its output buffer
        for j in range(len(ids)):
            self._rows[start + j] = rows[j]
        return logits

    def rollback(self, n: int) -> None:
        self.model.rollback(n)
        self._rows = {p: row for p, row in self._rows.items() if p < n}

    def keep(self, kept: int, path: Sequence[int]) -> None:
        self.model.keep(kept, path)
        self._rows = {p: row for p, row in self._rows.items() if p < kept} | {
            kept + j: self._rows[old] for j, old in enumerate(path) if old in self._rows}

    def take(self, token: int) -> TokenLogprob:
        """The entry of `token`, the next one committed after the prompt and those taken before; the rows before
        it are released."""
        position, self._next = self._next, self._next + 1
        row = self._rows.get(position - 1)
        if row is None:
            raise RuntimeError(f"no target logits recorded before position {position}")
        for p in [p for p in self._rows if p < position]:
            del self._rows[p]
        logprobs = torch.log_softmax(row, dim=-1)
        top = ()
        if self.top:
            values, ids = torch.topk(logprobs, min(self.top, len(logprobs)))  # (a vocabulary smaller than asked)
            top = tuple(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token, float(logprobs[token]), top)
