"""Continuous batching: the forwards of every running request gathered into as few model forwards as possible.

Each request decodes in a thread of its own, with any registered method, on `Row` handles: CausalLMs
with a cache of their own whose `prefill` and `forward` hand a `Call` to the `Batcher` and wait for its
logits. The batcher's worker runs what it holds once every running request waits on a call (or a
request has kept the others waiting `max_wait_s`), one forward per set of weights: the target verifies
all rows' drafts at once, a drafter drafts for all rows at once, new rows prefill beside running ones.
On the transformers backend that forward is `hf.forward_rows`, bit for bit each row's own forward, so a
request generates what it would alone; other backends run the calls one after another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from speculant.models.base import Call, CausalLM
from speculant.models.hf import HFCausalLM, batches_rows, forward_rows
from speculant.tree import TokenTree


@dataclass
class _Pending:
    handle: CausalLM
    call: Call
    since: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class Batcher:
    """Runs the calls of many request threads together. `on_batch(rows, tokens, seconds)` hears of each
    model forward it runs (for metrics)."""

    def __init__(self, max_wait_s: float = 0.01, on_batch: Callable[[int, int, float], None] | None = None):
        self.max_wait_s = max_wait_s
        self.on_batch = on_batch
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._running = 0  # request threads inside `running()`
        self._closed = False
        self._last_end = 0.0
        self._worker = threading.Thread(target=self._loop, name="speculant-batcher", daemon=True)
        self._worker.start()

    @contextmanager
    def running(self) -> Iterator[None]:
        """A request thread's time on the batcher: a batch waits for the calls of every running request."""
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def submit(self, handle: CausalLM, call: Call) -> torch.Tensor:
        """Run `call` on `handle` in the next batch; return its logits (or raise its error)."""
        pending = _Pending(handle, call)
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._pending.append(pending)
            self._cond.notify_all()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.logits is not None
        return pending.logits

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._ready():
                    self._cond.wait(self._patience())
                if self._closed and not self._pending:
                    return
                batch, self._pending = self._pending, []
            self._run(batch)
            with self._cond:
                self._last_end = time.perf_counter()

    def _ready(self) -> bool:
        """Every running request waits on a call, or the oldest call has waited long enough."""
        if not self._pending:
            return False
        return len(self._pending) >= self._running or self._patience() <= 0

    def _patience(self) -> float | None:
        if not self._pending:
            return None
        # From the later of the oldest call and the last batch's end: rows of that batch need a moment to
        # come back with their next call, or a row that waited through it would run alone, out of phase.
        return max(self._pending[0].since, self._last_end) + self.max_wait_s - time.perf_counter()

    def _run(self, batch: Sequence[_Pending]) -> None:
        groups: dict[int, list[_Pending]] = {}
        for pending in batch:
            groups.setdefault(weights_of(pending.handle), []).append(pending)
        for group in groups.values():
            start = time.perf_counter()
            try:
                if len(group) > 1 and isinstance(group[0].handle, HFCausalLM) and batches_rows(group[0].handle):
                    results = forward_rows([(p.handle, p.call) for p in group])
                    for pending, logits in zip(group, results):
                        pending.logits = logits
                else:
                    for pending in group:
                        try:
                            pending.logits = pending.call.run(pending.handle)
                        except Exception as error:  # noqa: BLE001 - the caller's thread raises it
                            pending.error = error
            except Exception as error:  # noqa: BLE001 - a batched forward failed: every row hears of it
                for pending in group:
                    pending.error = error
            if self.on_batch is not None:
                self.on_batch(len(group), sum(len(p.call.ids) for p in group), time.perf_counter() - start)
            for pending in group:
                pending.done.set()


def weights_of(handle: CausalLM) -> int:
    """Rows with equal keys share their weights' modules and can run as one forward."""
    return id(handle.model) if isinstance(handle, HFCausalLM) else id(handle)


class Row:
    """One request's handle on a served model: its own KV cache, its forwards run by the batcher.
    `shares` is the served model, under which per-model knowledge (machine profiles, what `auto` learned
    of acceptance) is kept across requests."""

    def __init__(self, batcher: Batcher, shares: CausalLM, on_forward: Callable[[Call], None] | None = None):
        self.batcher, self.shares, self.on_forward = batcher, shares, on_forward
        self.handle = shares.share()

    def __getattr__(self, name: str) -> Any:  # name, tokenizer, vocab_size, eos_token_ids, ...
        return getattr(self.handle, name)

    @property
    def cache_len(self) -> int:
        return self.handle.cache_len

    def share(self) -> Row:
        return Row(self.batcher, self.shares, self.on_forward)

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return self._submit(Call(list(ids), prefill=True))

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        return self._submit(Call(list(ids), positions=positions, tree=tree))

    def rollback(self, n: int) -> None:
        self.handle.rollback(n)

    def keep(self, indices: Sequence[int]) -> None:
        self.handle.keep(indices)

    def _submit(self, call: Call) -> torch.Tensor:
        if self.on_forward is not None:
            self.on_forward(call)
        return self.batcher.submit(self.handle, call)
