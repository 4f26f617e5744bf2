"""The latency twin: real servers, real tokens, real concurrency, emulated hardware.

A `PaddedModel` computes its real outputs and then waits until the forward has taken as long as a latency profile
says (TTFT for a prefill, TPOT or T(W) for later forwards), so a 2-core machine can play an 8-GPU node: the DSI
paper's online methodology, but driving the real engine. The wait can be cut short by the coordinator (preemption);
a `PacedDrafter` paces a drafter that runs no model alike. Pure mode drops the models too: `OracleLM` is a target
whose next token is a fixed function of the prefix and `SyntheticDrafter` agrees with it with a given probability,
i.i.d. per token, as in the paper's simulations.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speculant.decoding.dsi.jobs import Canceller, pause
from speculant.drafters.base import Draft, Drafter
from speculant.latency import interpolated
from speculant.models.base import Backend, CausalLM, Delegating, Interrupted
from speculant.models.wrappers.metered import Usage
from speculant.trees.tree import TokenTree


@dataclass(frozen=True)
class Latency:
    """Emulated forward latencies in seconds: `first_s` for a prefill (TTFT), `step_s` per later
    forward (TPOT), or T(W) from `widths` (W new tokens -> seconds, ascending; `latency.interpolated`) when profiled."""

    first_s: float
    step_s: float
    widths: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.first_s >= 0 and self.step_s >= 0):
            raise ValueError("latencies must be >= 0")

    def forward(self, n_tokens: int) -> float:
        if not self.widths:
            return self.step_s
        return interpolated(*zip(*self.widths), n_tokens)

    @classmethod
    def from_ms(cls, step_ms: float, first_ms: float | None = None) -> Latency:
        return cls((step_ms if first_ms is None else first_ms) / 1000, step_ms / 1000)

    @classmethod
    def from_profile(cls, profile: Any) -> Latency:
        """From a `latency.LatencyProfile` (TTFT, TPOT and its T(W) curve)."""
        return cls(profile.ttft_s, profile.tpot_s, tuple(sorted(profile.forward_s.items())))


class PacedDrafter(Drafter):
    """A drafter that runs no model (Max-Gram, suffix decoding, a Drafter object) paced in the twin: each drafted token
    takes `latency.step_s` at least, as a model drafter's padded forwards do (`PaddedModel`), so that the twin's
    drafter latency holds whichever drafter drafts. Only `propose` reaches the inner drafter: all DSI's threads ask
    (its `begin` and `end` are the method's, on the inner drafter itself)."""

    def __init__(self, inner: Drafter, latency: Latency):
        self.inner, self.latency, self.name = inner, latency, inner.name

    def propose(self, context: list[int], k: int) -> Draft:
        start = time.monotonic()
        draft = self.inner.propose(context, k)
        pause(max(0.0, start + len(draft.tokens) * self.latency.step_s - time.monotonic()))
        return draft


class PaddedModel(Delegating):
    """A CausalLM whose forwards take at least the emulated latency; a cancellation of the job its
    server is running (`canceller`), or a DSI drafter's restart (`jobs.pause`), interrupts the wait, raising
    `Interrupted` (the real forward, when it is interruptible itself, stops at its next layer boundary)."""

    def __init__(self, model: CausalLM, latency: Latency, canceller: Canceller | None = None):
        super().__init__(model)
        self.latency = latency
        self.canceller = canceller

    def _pad(self, start: float, seconds: float) -> None:
        left = seconds - (time.monotonic() - start)
        if left <= 0:
            return
        if self.canceller is None:
            pause(left)
        elif self.canceller.wait(left):
            raise Interrupted

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        start = time.monotonic()
        logits = self.model.prefill(ids)
        self._pad(start, self.latency.first_s)
        return logits

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        start = time.monotonic()
        logits = self.model.forward(ids, positions, tree=tree)
        self._pad(start, self.latency.forward(len(ids)))
        return logits


class OracleLM(Backend):
    """Pure mode's target: no weights; its greedy next token is a fixed function of the prefix."""

    tokenizer = None
    eos_token_ids: frozenset[int] = frozenset()
    max_positions = None
    device = torch.device("cpu")
    dtype = torch.float32
    numerics = "oracle"

    def __init__(self, vocab_size: int = 64, seed: int = 0):
        self.name = "oracle"
        self.vocab_size = vocab_size
        self.seed = seed
        self._ids: list[int] = []

    def next_token(self, prefix: Sequence[int]) -> int:
        return (prefix[-1] * 31 + len(prefix) * 17 + self.seed) % self.vocab_size

    @property
    def cache_len(self) -> int:
        return len(self._ids)

    def _rows(self, start: int) -> torch.Tensor:
        targets = [self.next_token(self._ids[: i + 1]) for i in range(start, len(self._ids))]
        return torch.zeros(len(targets), self.vocab_size).scatter_(-1, torch.tensor(targets)[:, None], 10.0)

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        self._ids = list(ids)
        return self._rows(len(ids) - 1)[0]

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        if tree is not None:
            raise NotImplementedError("the oracle has no tree attention")
        start = len(self._ids)
        self._ids += list(ids)
        return self._rows(start)

    def rollback(self, n: int) -> None:
        del self._ids[n:]

    def keep(self, kept: int, path: Sequence[int]) -> None:
        self._ids = self._ids[:kept] + [self._ids[i] for i in path]


class SyntheticDrafter:
    """Pure mode's drafter: proposes the oracle's token with probability `acceptance`, i.i.d. per position,
    and a wrong one otherwise; each token costs `latency_s` of sleep (one emulated drafter forward).

    Whether position p's draft is right is drawn once per position, as in the offline simulator's common
    random numbers (`analysis.simulate.draws`): a redraft of p after a preemption draws nothing new, so
    `wrong` hands the simulator the very draws a run was decided by."""

    def __init__(self, oracle: OracleLM, acceptance: float, latency_s: float, seed: int = 0):
        if not 0 <= acceptance <= 1:
            raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
        self.name = "synthetic"
        self.oracle = oracle
        self.acceptance = acceptance
        self.latency_s = latency_s
        self.rng = random.Random(seed)
        self.draws: list[tuple[bool, int]] = []  # per position: right?, and the wrong token's offset

    def draw(self, position: int) -> tuple[bool, int]:
        while len(self.draws) <= position:
            self.draws.append((self.rng.random() < self.acceptance, 1 + self.rng.randrange(self.oracle.vocab_size - 1)))
        return self.draws[position]

    def wrong(self, start: int, n: int) -> list[bool]:
        """Whether the drafts of positions start .. start + n - 1 are wrong."""
        return [not self.draw(p)[0] for p in range(start, start + n)]

    def propose(self, context: list[int], k: int) -> Draft:
        tokens: list[int] = []
        start = time.monotonic()
        for i in range(k):
            pause(max(0.0, start + (i + 1) * self.latency_s - time.monotonic()))
            truth = self.oracle.next_token(context + tokens)
            right, offset = self.draw(len(context) + i)
            tokens.append(truth if right else (truth + offset) % self.oracle.vocab_size)
        return Draft(tokens, None, {self.name: Usage(k, k, time.monotonic() - start)})

    def observe(self, n_accepted: int) -> None:
        pass
