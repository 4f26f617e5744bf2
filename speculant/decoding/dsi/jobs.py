"""What travels between the DSI coordinator and its target servers, and what a server computes.

The protocol. A server keeps, per request, the speculated sequence (prompt, committed tokens, drafts)
it was last sent. A job names its request, how many leading tokens of that sequence still hold (`base`),
the tokens from there on, and the first position whose prediction it asks for; the coordinator knows
what each server holds, so a job carries only what the server lacks. The server runs only the tokens its
KV cache lacks (rolling back where its cache disagrees) and returns the target's prediction for every
position from `rows_start` to the end: the argmax when greedy, the distribution p when sampling. A
cancelled job stops at the next layer boundary of the model (`CausalLM.interrupt`), its cache rolled
back to the last consistent length. Everything here is picklable, so the same server code runs in a
thread, a process or a Ray actor.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from speculant.config import SamplingConfig
from speculant.errors import SpeculantError
from speculant.models.base import CausalLM, Interrupted, common_prefix_len
from speculant.models.wrappers.metered import Usage
from speculant.sampling import logits_to_probs


@dataclass(frozen=True)
class Job:
    id: int
    request: int  # the generation it belongs to
    base: int  # leading tokens of the sequence this server was last sent for `request` that still hold
    tokens: tuple[int, ...]  # the speculated sequence from `base` up to the job's last draft
    first_row: int  # the first position (index into the whole sequence, or its length) to predict; >= 1
    prompt: int | None = None  # the request's prompt length: all a server new to the request prefills (None: up to
    # first_row), the rest run as forwards, as plain decoding runs them (llama.cpp's prefill and forward differ in bits)


@dataclass
class JobResult:
    job: int
    server: int
    rows_start: int  # the position the first row predicts
    tokens: list[int] | None  # greedy: the target's argmax per row
    probs: torch.Tensor | None  # sampling: the target's distribution per row [rows, vocab]
    start: float  # time.monotonic() around the server's work (one clock for every process)
    end: float
    forwards: int
    forwarded: int = 0  # tokens run through the model (those its cache lacked)
    preempted: bool = False  # cancelled while it ran: no rows
    prefill_s: float | None = None  # the time of the prompt's prefill where the job ran one (one of its forwards)

    @property
    def usage(self) -> Usage:
        """Its forwards as the target's usage: a prefill is no step, its time none of the steps' (`Usage`)."""
        prefilled = self.prefill_s is not None
        return Usage(self.forwards, self.forwards - prefilled, self.end - self.start - (self.prefill_s or 0.0))

    @property
    def rows(self) -> int:
        return len(self.tokens) if self.tokens is not None else (0 if self.probs is None else self.probs.shape[0])


class _Box:
    def __init__(self, value: int):
        self.value = value


class Canceller:
    """Lets the coordinator cancel, by id, the job a server is running; the server's waits watch it.

    `cancelled` and `event` are shared with the coordinator: threading primitives for thread servers,
    `multiprocessing` ones (a shared integer and an Event) for process servers, so the same object works
    on both sides of the process boundary. `running` is the server's own: the job it is on."""

    def __init__(self, event: Any = None, cancelled: Any = None):
        self.event = event if event is not None else threading.Event()
        self.cancelled = cancelled if cancelled is not None else _Box(-1)
        self.running = -1

    def cancel(self, job_id: int) -> None:
        self.cancelled.value = job_id  # before the event: a waiter that wakes sees the id
        self.event.set()

    def cancelled_now(self) -> bool:
        """Whether the running job is cancelled (the check models run at every layer boundary)."""
        return self.cancelled.value == self.running

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds`; True as soon as the running job is cancelled. The event only wakes the waiter:
        it is cleared before the id is read, so a cancellation landing in between sets it again."""
        deadline = time.monotonic() + seconds
        while True:
            self.event.clear()
            if self.cancelled_now():
                return True
            if (left := deadline - time.monotonic()) <= 0:
                return False
            self.event.wait(left)

    def cuts_pauses(self) -> None:
        """Make this thread's `pause`s wake, raising `Interrupted`, once its running job is cancelled (a DSI drafter's
        thread: a restart cancels the draft it works on)."""
        _drafting.canceller = self


_drafting = threading.local()  # `canceller`: that of the draft this thread works on, in a DSI drafter's thread


def pause(seconds: float) -> None:
    """Sleep `seconds` (an emulated latency of the twin's); in a DSI drafter's thread, a restart that makes its draft
    stale cuts the sleep short, raising `Interrupted`, as it cuts a drafter model's forward (`DraftWorker`)."""
    canceller = getattr(_drafting, "canceller", None)
    if canceller is None:
        time.sleep(seconds)
    elif canceller.wait(seconds):
        raise Interrupted


class ServerDied(SpeculantError):
    """A target server is gone (killed, crashed, timed out; its job runs elsewhere) or could not start."""


class TargetServer:
    """One target model and its KV cache, serving verification jobs one at a time.

    `die_after` makes the server's process (or thread) exit when its next job arrives after that many
    jobs: fault injection for tests and demonstrations, a real death, not a simulated one.
    """

    def __init__(self, index: int, model: CausalLM, sampling: SamplingConfig, die_after: int | None = None,
                 own_process: bool = False, canceller: Canceller | None = None):
        self.index = index
        self.canceller = canceller
        self.model = model
        self.sampling = sampling
        self.die_after = die_after
        self.own_process = own_process  # a crash may exit the process: nothing else runs in it
        self.cached: list[int] = []  # the tokens whose keys and values the model holds
        self.request, self.sequence = -1, []  # the request it serves and the sequence it was sent for it
        self.jobs = 0
        if canceller is not None and model.capabilities.interruptible:
            model.interrupt = canceller.cancelled_now

    def run(self, job: Job) -> JobResult:
        if self.die_after is not None and self.jobs >= self.die_after:
            if self.own_process:
                os._exit(1)  # a real crash: the coordinator sees the process vanish
            raise ServerDied(f"target server {self.index} died (fault injected after {self.die_after} jobs)")
        self.jobs += 1
        if self.canceller is not None:
            self.canceller.running = job.id
        start = time.monotonic()
        if job.request != self.request:
            if job.base:
                raise ValueError(f"job {job.id} builds on {job.base} tokens of request {job.request}, "
                                 f"which this server never saw")
            # A new request's prompt is prefilled whole, as plain decoding does: a backend whose prefill and
            # forward differ in numerics (llama.cpp's ubatches) must not build it on another prompt's cache.
            self.request, self.sequence, self.cached = job.request, [], []
        if job.base > len(self.sequence):
            raise ValueError(f"job {job.id} builds on {job.base} tokens; the server holds {len(self.sequence)}")
        tokens = self.sequence = self.sequence[: job.base] + list(job.tokens)
        forwards = forwarded = 0
        prefill_s = None
        try:
            keep = min(common_prefix_len(self.cached, tokens), job.first_row - 1)
            if keep == 0:  # nothing reusable: prefill the prompt (up to the first wanted row), then the rest
                head = min(job.first_row, job.prompt or job.first_row)
                forwards, forwarded = 1, head
                try:
                    rows = [self.model.prefill(tokens[:head])[None]]
                finally:  # (its time, interrupted or not, is none of the steps')
                    prefill_s = time.monotonic() - start
                if len(tokens) > head:
                    forwards, forwarded = 2, len(tokens)
                    rows.append(self.model.forward(tokens[head:]))
                logits, rows_start = torch.cat(rows)[job.first_row - head:], job.first_row
            else:
                forwards, forwarded = 1, len(tokens) - keep
                self.model.rollback(keep)
                logits, rows_start = self.model.forward(tokens[keep:]), keep + 1
        except Interrupted:
            return JobResult(job.id, self.index, job.first_row, None, None, start, time.monotonic(), forwards,
                             forwarded, preempted=True, prefill_s=prefill_s)
        finally:
            self.cached = tokens[: self.model.cache_len]
        if self.sampling.greedy:
            return JobResult(job.id, self.index, rows_start, logits.argmax(-1).tolist(), None, start,
                             time.monotonic(), forwards, forwarded, prefill_s=prefill_s)
        probs = logits_to_probs(logits, self.sampling)
        if self.own_process:  # results cross a pipe: plain CPU tensors, not CUDA IPC handles
            probs = probs.cpu()
        return JobResult(job.id, self.index, rows_start, None, probs, start, time.monotonic(), forwards, forwarded,
                         prefill_s=prefill_s)
