"""Continuous batching: the forwards of every running request gathered into as few model forwards as possible.

Each request decodes, with any registered method, as a greenlet on the batcher's one worker thread, on
`Row` handles: CausalLMs with a cache of their own whose `prefill` and `forward` park the request with a
`Call`. Once every running request is parked, the worker runs their calls, one forward per set of
weights, and resumes each request with its logits: the target verifies all rows' drafts at once, a
drafter drafts for all rows at once, new requests prefill beside running ones, finished ones leave. On the
transformers, lean and static backends that forward is `hf.forward_rows`, `lean.forward_rows` or
`static.forward_rows`, bit for bit each row's own forward, so a request generates what it would alone; llama.cpp
runs the calls one after another.

One thread runs every forward and every request's tensor work, not a thread per request: CPU kernels
slow down when their thread pools answer to several threads (a forward runs slower once another long-lived
thread has run one), and no request waits on a timer for the others.

A batched forward that raises is run again row by row, so that a fault of one row (its tree, its cache's
capacity, its prompt's memory) fails its request alone: each row's cache is first put back as it was (`rewind`).
That is exact for a prompt's first part (a prefill starts its cache afresh), a pointer cache (`fixed_cache`: lean,
static) and a cache that exports its positions (`reuses_prefixes`: transformers, whose failed forward may have
appended to some layers of each row's cache); the other rows of a failed forward on a backend with neither fail
with it, their caches unknown.

The worker is the one thread every request needs: should it end on an error of its own (outside a call's
forward), every request it held or queued fails with `WorkerStopped`, and so does every later one (the server's
/health then answers 503).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from greenlet import greenlet

from speculant.models.base import Call, CausalLM, Delegating, Interrupted
from speculant.prefixes import PrefixCache
from speculant.trees.tree import TokenTree


PREFILL_TOKENS = 512  # prompt tokens one batch prefills (one prompt at least): what the others wait for
LOG = logging.getLogger("speculant.serve")


CLOSED = "the server is shutting down"


class WorkerStopped(RuntimeError):
    """The batcher's worker ended on an error: what it held or queued fails, and it takes nothing more."""


@dataclass
class _Parked:
    request: greenlet
    handle: CausalLM
    call: Call
    waited: bool = False  # left for a later batch once: then it goes ahead of new prompts' first parts


Fail = Callable[[BaseException], None]  # what tells a request that the worker stopped before it began
Answer = tuple[_Parked, torch.Tensor | None, Exception | None]  # a call's logits, or what it raised


class Batcher:
    """Runs up to `max_rows` requests' work together on one thread; more wait in order. `on_batch(rows,
    tokens, seconds)` hears of each model forward it runs (for metrics)."""

    def __init__(self, max_rows: int = 16, on_batch: Callable[[int, int, float], None] | None = None):
        self.max_rows, self.on_batch = max_rows, on_batch
        self.failure: str | None = None  # why the worker stopped (None: it runs)
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Callable[[], None], Fail]] = deque()
        self._live: dict[greenlet, Fail] = {}  # the running requests, each with what tells it that the worker stopped
        self._parked: list[_Parked] = []
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="speculant-batcher", daemon=True)
        self._worker.start()

    @property
    def load(self) -> int:
        """Requests running now."""
        return len(self._live)

    @property
    def waiting(self) -> int:
        """Requests waiting for a row."""
        return len(self._inbox)

    def start(self, work: Callable[[], None], fail: Fail) -> None:
        """Run `work` (one request's decoding, which must not raise) on the worker once a row is free; `fail(error)`
        instead where the worker stops before `work` began (`WorkerStopped`). Raises WorkerStopped once it has."""
        with self._cond:
            if self.failure is not None:
                raise WorkerStopped(self.failure)
            if self._closed:  # (a request that arrives while the server shuts down)
                raise WorkerStopped(CLOSED)
            self._inbox.append((work, fail))
            self._cond.notify()

    def withdraw(self, work: Callable[[], None]) -> bool:
        """Take `work` out of the queue where it still waits for a row (its request was cancelled: it would hold a
        place that a live request is refused for); whether it was there."""
        with self._cond:
            for i, (waiting, _) in enumerate(self._inbox):
                if waiting is work:
                    del self._inbox[i]
                    return True
        return False

    def run(self, function: Callable[[], Any]) -> Any:
        """`function()` on the worker thread, waited for (warm-ups: their kernels' threads stay the worker's)."""
        done, out = threading.Event(), []

        def work() -> None:
            try:
                out.append((function(), None))
            except Exception as error:  # noqa: BLE001 - raised again in the caller's thread
                out.append((None, error))
            done.set()

        def fail(error: BaseException) -> None:
            out.append((None, error))
            done.set()

        self.start(work, fail)
        done.wait()
        value, error = out[0]
        if error is not None:
            raise error
        return value

    def submit(self, handle: CausalLM, call: Call) -> torch.Tensor:
        """Run `call` on `handle` in the next batch and return its logits. Outside a request on the worker
        (DSI's own threads, a caller's thread) the call runs at once, alone."""
        request = greenlet.getcurrent()
        if request not in self._live:
            return call.run(handle)
        if self.failure is not None:  # (a request unwinding after the worker stopped)
            raise WorkerStopped(self.failure)
        self._parked.append(_Parked(request, handle, call))
        return request.parent.switch()

    @property
    def closed(self) -> bool:
        """Whether `close` was called: later requests are refused (WorkerStopped)."""
        return self._closed

    def close(self) -> None:
        """Stop once the running and waiting requests are done."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._worker.join()

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as error:  # noqa: BLE001 - the one worker: its requests must hear that it stopped
            LOG.error("the batcher's worker stopped", exc_info=error)
            self._stop(f"the server's batching worker stopped on {type(error).__name__} (its log has the details)")

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._parked and not (self._closed and not self._live):
                    self._cond.wait()
                if self._closed and not self._inbox and not self._live:
                    return
                admitted = {}  # (running from here: `load` counts a request the moment it leaves the inbox)
                while self._inbox and len(self._live) + len(admitted) < self.max_rows:
                    work, fail = self._inbox.popleft()
                    admitted[greenlet(work)] = fail
                self._live.update(admitted)  # each starts knowing the others admitted with it (Row.batch_load)
            for request in admitted:
                self._resume(request)
            batch, self._parked = self._next_batch()
            if batch:
                self._run(batch)

    def _stop(self, failure: str) -> None:
        """Fail every request the worker held (a started one hears WorkerStopped where it waits on its call) or
        queued, and refuse later ones, with `failure`."""
        with self._cond:
            self.failure = failure
            queued, self._inbox = [(None, fail) for _, fail in self._inbox], deque()
        self._parked = []
        for request, fail in [*self._live.items(), *queued]:
            try:
                if request:  # started, and waiting on a call: it unwinds, and its work reports the error
                    request.throw(WorkerStopped(failure))
                else:  # queued, not started yet, or ended by the error that stopped the worker
                    fail(WorkerStopped(failure))
            except BaseException:  # noqa: BLE001 - the others must still hear of it
                LOG.exception("a request failed on the stopped worker")
        self._live.clear()

    def _next_batch(self) -> tuple[list[_Parked], list[_Parked]]:
        """(the calls to run now, those left for the next batch): every decoding call, and prompts' prefills up to
        PREFILL_TOKENS (at least one), so that a burst of new requests does not hold every running one (nor each
        other's first token) until all of them are prefilled. Prompts' first parts go before the later parts of
        long ones, oldest first: a short prompt that arrives during a long one's prefill waits for one part of it,
        not for all of them; a part left for a later batch once goes first then, so arrivals never starve it."""
        now, later, budget = [], [], PREFILL_TOKENS
        for parked in sorted(self._parked, key=lambda p: p.call.continues and not p.waited):  # (a stable sort)
            if parked.call.prefill:
                if budget <= 0:
                    parked.waited = True
                    later.append(parked)
                    continue
                budget -= len(parked.call.ids)
            now.append(parked)
        return now, later

    def _resume(self, request: greenlet, logits: torch.Tensor | None = None, error: Exception | None = None) -> None:
        """Let a request run until it parks on its next call or ends."""
        if error is not None:
            request.throw(error)
        elif logits is None:
            request.switch()  # a request's first start
        else:
            request.switch(logits)
        if request.dead:
            self._live.pop(request)

    def _run(self, batch: Sequence[_Parked]) -> None:
        groups: dict[int, list[_Parked]] = {}
        for parked in batch:
            groups.setdefault(weights_of(parked.handle), []).append(parked)
        outcomes: list[Answer] = []
        for group in groups.values():
            start = time.perf_counter()
            rows_forward = batched_forward(group[0].handle)
            if len(group) > 1 and rows_forward is not None:
                lengths = [p.handle.cache_len for p in group]
                try:
                    results = rows_forward([(p.handle, p.call) for p in group])
                    outcomes += [(p, logits, None) for p, logits in zip(group, results)]
                except Exception as error:  # noqa: BLE001 - each row again alone: a faulty row fails by itself
                    outcomes += [alone(p, (length, error)) for p, length in zip(group, lengths)]
            else:
                outcomes += [alone(p) for p in group]
            if self.on_batch is not None:
                self.on_batch(len(group), sum(len(p.call.ids) for p in group), time.perf_counter() - start)
        for parked, logits, error in outcomes:
            self._resume(parked.request, logits, error)


def alone(parked: _Parked, failed: tuple[int, Exception] | None = None) -> Answer:
    """`parked`'s call run by itself. With `failed` (the length its cache had before a batched forward that raised,
    and the error) its cache is put back first (`rewind`); where it cannot be, the call fails with that error."""
    try:
        if failed is not None and not rewind(parked.handle, parked.call, failed[0]):
            return parked, None, failed[1]
        return parked, parked.call.run(parked.handle), None
    except Exception as error:  # noqa: BLE001 - raised in the request that made the call
        return parked, None, error


def rewind(handle: CausalLM, call: Call, length: int) -> bool:
    """Put `handle`'s cache back to the `length` positions it held before a batched forward with `call` raised,
    where that can be done exactly, and say whether it was: a prompt's first part needs nothing (a prefill starts
    afresh), a cache that held nothing is emptied, a pointer cache (`fixed_cache`) moves back (what the forward wrote
    past it is never read), a cache that exports its positions (`reuses_prefixes`) is rebuilt from its first
    `length` (the failed forward may have appended to some of its layers). Any other cache may hold part of the
    failed forward."""
    capabilities = handle.capabilities
    if call.prefill and not call.resumes:
        return True
    if capabilities.fixed_cache or not length:
        handle.rollback(length)
    elif capabilities.reuses_prefixes:
        handle.import_kv([handle.export_kv(0, length)])
    else:
        return False
    return True


def batched_forward(handle: CausalLM) -> Callable[[Sequence[tuple[Any, Call]]], list[torch.Tensor]] | None:
    """The backend's forward of several sequences' rows at once, each row bit for bit its own forward
    (`hf.forward_rows`, `lean.forward_rows`, `static.forward_rows`), or None where rows run one after another (see
    CausalLM)."""
    return handle.rows_forward() if handle.capabilities.batches_rows else None


def weights_of(handle: CausalLM) -> int:
    """Rows with equal keys share their weights and can run as one forward."""
    return handle.weights_key if handle.capabilities.batches_rows else id(handle)


class Row(Delegating):
    """One request's handle on a served model: its own KV cache, its forwards run by the batcher (without
    one, on the calling thread: a request that runs apart from the others). `owner` is the served model,
    under which per-model knowledge (machine profiles, what `auto` learned of acceptance) is kept across
    requests."""

    def __init__(self, batcher: Batcher | None, owner: CausalLM, on_forward: Callable[[Call], None] | None = None,
                 cancelled: Callable[[], bool] | None = None, prefixes: PrefixCache | None = None):
        super().__init__(owner.share())
        self.batcher, self.served, self.on_forward, self.cancelled = batcher, owner, on_forward, cancelled
        self.prefixes = prefixes if batcher is not None else None  # (one thread, the batcher's, touches it)

    @property
    def owner(self) -> CausalLM:
        return self.served

    @property
    def handle(self) -> CausalLM:
        """Its own cache on the served model's weights."""
        return self.model

    def batch_load(self) -> int:
        """How many requests' rows share each of this row's forwards: those running and those waiting to join the
        next batch (1 where the backend runs rows apart). Clients rarely arrive in the same instant: the first of a
        burst decides its next step while the others wait, and counted alone it would start a drafter's catch-up
        that all of them then wait for."""
        if self.batcher is None or batched_forward(self.handle) is None:
            return 1
        return min(self.batcher.load + self.batcher.waiting, self.batcher.max_rows)

    def share(self) -> Row:
        return Row(self.batcher, self.served, self.on_forward, self.cancelled, self.prefixes)

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """A prompt's prefill, from the longest prefix of it the server's prefix cache holds (`speculant.prefixes`;
        what it computes is then kept there). Where the backend runs a long prompt in parts (`prefill_parts`), each
        part waits for a forward of its own, so that the running requests decode between them, and a request whose
        client went away (`cancelled`) stops between parts (`Interrupted`)."""
        cached = self.prefixes.restore(self.handle, ids) if self.prefixes is not None else 0
        rest = ids[cached:]
        parts = self.handle.prefill_parts(rest) if self.batcher is not None and \
            self.handle.capabilities.prefills_in_parts else [list(rest)]
        logits = self._submit(Call(parts[0], prefill=True, restored=cached > 0))
        for part in parts[1:]:
            if self.cancelled is not None and self.cancelled():
                raise Interrupted()
            logits = self._submit(Call(part, prefill=True, continues=True))
        if self.prefixes is not None:
            self.prefixes.store(self.handle, ids)
        return logits

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        return self._submit(Call(list(ids), positions=positions, tree=tree))

    def catch_up(self, ids: Sequence[int], rows: int = 1) -> torch.Tensor:
        """A forward whose logits only the last `rows` tokens need (a drafter catching up): the backend computes the
        output head for those alone, batched or not."""
        return self._submit(Call(list(ids), rows=rows))

    def _submit(self, call: Call) -> torch.Tensor:
        if self.on_forward is not None:
            self.on_forward(call)
        return call.run(self.handle) if self.batcher is None else self.batcher.submit(self.handle, call)
