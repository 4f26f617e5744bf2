"""Distributed speculative inference: speculation parallelism (Timor et al. 2025, "Distributed
Speculative Inference", Algorithm 1 with lookahead, Appendices C-D).

A drafter thread drafts one token at a time and never waits for verification. Every `lookahead` new
drafts become a job for an idle target server, which scores them against the speculated sequence
in one forward. The coordinator (this generator) commits, position by position, every row whose
prefix is already committed: the target's own token there is final whatever the server, so greedy
output equals the target's greedy output. A token that differs from the draft is a rejection: the
drafter restarts from the corrected sequence, in-flight jobs built on the rejected draft are
preempted (cancelled, their results discarded) and a job on the bare committed prefix starts at once
on an idle server, so a stretch of rejections costs no more than the target alone (Theorem 1).
Sampling decides each position by speculative sampling with the draft's q shipped alongside.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from speculant.config import SamplingConfig
from speculant.decoding.dsi.jobs import Canceller, Job, JobResult
from speculant.decoding.dsi.record import Bar, DSIRecord, ServerRecord
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.drafters.base import Drafter
from speculant.errors import SpeculantError
from speculant.models.metered import Usage
from speculant.sampling import sample
from speculant.verify import verify_one


JOB_IDS = itertools.count()  # unique across runs, so a late answer from an earlier run sharing an executor is ignored


class DrafterFailed(SpeculantError):
    """The drafter raised or stopped answering; DSI cannot go on without it."""


class DraftWorker:
    """The drafter server: a thread that extends its own context one token at a time, up to `limit`
    tokens, and posts ("draft", epoch, position, token, q, usage, start, end) events. `restart` replaces
    the context (after a rejection); drafts of an older epoch are stale."""

    def __init__(self, drafter: Drafter, events: queue.Queue):
        self.drafter = drafter
        self.events = events
        self.cond = threading.Condition()
        self.context: list[int] = []
        self.epoch = 0
        self.limit = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="dsi-drafter")

    def restart(self, context: list[int], epoch: int, limit: int) -> None:
        with self.cond:
            self.context, self.epoch, self.limit = list(context), epoch, limit
            self.cond.notify()

    def allow(self, limit: int) -> None:
        with self.cond:
            self.limit = limit
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.stopped and len(self.context) >= self.limit:
                    self.cond.wait()
                if self.stopped:
                    return
                context, epoch = list(self.context), self.epoch
            start = time.monotonic()
            try:
                draft = self.drafter.propose(context, 1)
            except Exception as error:  # noqa: BLE001 - reported to the coordinator, which stops
                self.events.put(("drafter_failed", f"{type(error).__name__}: {error}"))
                return
            end = time.monotonic()
            with self.cond:
                if not draft.tokens:  # nothing to propose here: wait until a commit or restart moves on
                    if epoch == self.epoch:
                        self.limit = len(context)
                    continue
                current = epoch == self.epoch and self.context == context
                if current:
                    self.context.append(draft.tokens[0])
            q = draft.probs[0] if draft.probs is not None else None
            self.events.put(("draft", epoch if current else -1, len(context), draft.tokens[0], q, draft.usage,
                             start, end))


class Coordinator:
    """DSI's state: the committed sequence, the speculated one (committed + drafts), jobs in flight."""

    def __init__(self, executor: Any, worker: DraftWorker, prompt: list[int], max_new_tokens: int,
                 lookahead: int, sampling: SamplingConfig, generator: torch.Generator | None,
                 fallback: Callable[[int], Any], events: queue.Queue, timeout_s: float):
        self.executor, self.worker, self.events = executor, worker, events
        self.sampling, self.generator, self.lookahead = sampling, generator, lookahead
        self.fallback, self.timeout_s = fallback, timeout_s
        n = len(executor.spec.devices)
        self.seq = list(prompt)  # committed tokens, then drafts
        self.n_committed = len(prompt)
        self.cap = len(prompt) + max_new_tokens - 1  # drafts beyond this position are never needed
        self.max_ahead = lookahead * (n + 1)
        self.frontier = len(prompt)  # the first position no live job has been asked to predict
        self.q_rows: dict[int, torch.Tensor] = {}
        self.epoch = 0
        self.alive, self.idle = set(range(n)), set(range(n))
        self.running: dict[int, tuple[Job, float]] = {}  # server -> (job, dispatch time)
        self.buffered: list[tuple[Job, JobResult]] = []
        self.local: Any = None  # the in-process server once every server is lost
        self.in_process = n  # its index
        self.t0 = time.monotonic()
        self.record = DSIRecord(executor.name, [ServerRecord(i) for i in range(n)], lookahead)
        self.stats = GenerationStats(method="dsi")
        self.target_usage = Usage()

    # --- drafting ---------------------------------------------------------------------------------
    def limit(self) -> int:
        return min(self.cap, self.n_committed + self.max_ahead)

    def restart_drafter(self) -> None:
        self.epoch += 1
        self.worker.restart(self.seq, self.epoch, self.limit())

    def on_draft(self, epoch: int, pos: int, token: int, q: torch.Tensor | None, usage: dict[str, Usage],
                 start: float, end: float) -> None:
        self.stats.record_usage(usage)
        kept = epoch == self.epoch and pos >= len(self.seq)
        self.record.bars.append(Bar(-1, start - self.t0, end - self.t0, "kept" if kept else "discarded"))
        if epoch != self.epoch:
            return
        if pos < len(self.seq):  # the target committed this position before the drafter reached it
            if self.seq[pos] != token:
                self.restart_drafter()
            return
        self.seq.append(token)
        if q is not None:
            self.q_rows[pos] = q

    # --- dispatching ------------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Give idle servers work: a job on the bare prefix when nothing live predicts the next
        position, otherwise one as soon as `lookahead` new drafts (or the last ones) are waiting."""
        while True:
            wanted = len(self.seq) + 1 - self.frontier  # positions frontier .. len(seq)
            drafter_waits = len(self.seq) >= self.limit()
            ready = wanted >= 1 and (self.frontier <= self.n_committed or wanted >= self.lookahead or drafter_waits)
            if not ready or (not self.idle if self.alive else self.in_process in self.running):
                return
            job = Job(next(JOB_IDS), tuple(self.seq), self.frontier)
            self.frontier = len(self.seq) + 1
            if not self.alive:  # every server lost: finish as speculative decoding in this process
                if self.local is None:
                    self.local, self.record.fallback = self.fallback(self.in_process), True
                    self.record.servers.append(ServerRecord(self.in_process))
                self.running[self.in_process] = (job, time.monotonic())
                self.events.put(("result", self.local.run(job)))
                return
            self.send(min(self.idle), job)

    def send(self, server: int, job: Job) -> None:
        self.idle.discard(server)
        self.running[server] = (job, time.monotonic())
        self.executor.submit(server, job)

    def warm_up(self) -> None:
        """Every server prefills the prompt at once; the first answer gives the first token."""
        for server in sorted(self.alive):
            self.send(server, Job(next(JOB_IDS), tuple(self.seq), self.n_committed))
        self.frontier = self.n_committed + 1

    # --- results ----------------------------------------------------------------------------------
    def stale(self, job: Job) -> bool:
        n = min(self.n_committed, len(job.tokens))
        return job.tokens[:n] != tuple(self.seq[:n])

    def on_result(self, result: JobResult) -> list[int]:
        job, _ = self.running.get(result.server, (None, 0.0))
        if job is None or job.id != result.job:
            return []  # a late answer from an earlier generation on a shared executor
        del self.running[result.server]
        if result.server in self.alive:
            self.idle.add(result.server)
        self.target_usage += Usage(result.forwards, result.forwards, result.end - result.start)
        rec = self.record.servers[result.server]
        rec.jobs += 1
        rec.forwards += result.forwards
        rec.busy_s += result.end - result.start
        if result.preempted or self.stale(job):
            self.close_bar(job, result, "preempted")
            return []
        self.buffered.append((job, result))
        return self.apply_buffered()

    def close_bar(self, job: Job, result: JobResult, outcome: str) -> None:
        self.record.bars.append(Bar(result.server, result.start - self.t0, result.end - self.t0, outcome, job.id))
        rec = self.record.servers[result.server]
        if outcome == "used":
            rec.used += 1
            return
        rec.wasted_forwards += result.forwards
        rec.preempted += outcome == "preempted"
        rec.redundant += outcome == "redundant"

    def apply_buffered(self) -> list[int]:
        committed: list[int] = []
        progress = True
        while progress:
            progress = False
            for item in list(self.buffered):
                job, result = item
                end = result.rows_start + result.rows  # one past the last predicted position
                stale = self.stale(job)
                if stale or end <= self.n_committed:
                    self.buffered.remove(item)
                    self.close_bar(job, result, "preempted" if stale else "redundant")
                elif result.rows_start <= self.n_committed:
                    self.buffered.remove(item)
                    committed += self.apply(job, result)
                    self.close_bar(job, result, "used")
                    progress = True
        return committed

    def apply(self, job: Job, result: JobResult) -> list[int]:
        """Commit the rows of `result` from the first uncommitted position for as long as the job's own
        tokens agree with what gets committed (later rows were computed after another token)."""
        committed, checked, accepted = [], 0, 0
        pos = self.n_committed
        while pos < result.rows_start + result.rows:
            row = pos - result.rows_start
            draft = self.seq[pos] if pos < len(self.seq) else None
            if self.sampling.greedy:
                token = result.tokens[row]
            elif draft is None:
                token = sample(result.probs[row], self.generator)
            else:
                token = verify_one(draft, result.probs[row], self.q_rows.get(pos), self.generator)
            checked += draft is not None
            accepted += token == draft
            self.commit(pos, token)
            committed.append(token)
            pos += 1
            if pos > len(job.tokens) or job.tokens[pos - 1] != token:
                break
        self.stats.record_draft(checked, accepted, {})
        return committed

    def commit(self, pos: int, token: int) -> None:
        self.n_committed += 1
        self.q_rows.pop(pos, None)
        if pos < len(self.seq) and self.seq[pos] == token:
            pass  # the draft was right
        elif pos < len(self.seq):  # rejection: drop the drafts from here, preempt what built on them
            self.record.rejections.append((time.monotonic() - self.t0, pos))
            del self.seq[pos:]
            self.seq.append(token)
            self.q_rows = {p: q for p, q in self.q_rows.items() if p < pos}
            self.frontier = pos + 1
            for server, (job, _) in self.running.items():
                if server in self.alive and len(job.tokens) > pos and job.tokens[pos] != token:
                    self.executor.cancel(server, job.id)
            self.restart_drafter()
            return
        else:  # a bonus row beyond the drafts: the drafter's next token is checked when it comes
            self.seq.append(token)
            self.frontier = max(self.frontier, pos + 1)
        self.worker.allow(self.limit())

    def on_lost(self, server: int, reason: str) -> None:
        if server not in self.alive:
            return
        self.alive.discard(server)
        self.idle.discard(server)
        self.record.servers[server].lost = reason
        job, _ = self.running.pop(server, (None, 0.0))
        if job is not None and not self.stale(job):  # ask again for what it was asked
            self.frontier = max(self.n_committed, min(self.frontier, job.first_row))

    def finish(self) -> None:
        """Cancel what still runs and wait for those answers, so the servers are idle for the next run."""
        for server, (job, _) in self.running.items():
            if server in self.alive:
                self.executor.cancel(server, job.id)
        deadline = time.monotonic() + self.timeout_s
        while any(server in self.alive for server in self.running) and time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if event[0] == "result":
                self.on_result(event[1])
            elif event[0] == "lost":
                self.on_lost(*event[1:])

    def on_timeout(self) -> None:
        """No event for `timeout_s`: servers that sat on a job that long are lost; a drafter that
        stopped answering while no job runs is an error."""
        now = time.monotonic()
        late = [s for s, (_, since) in self.running.items() if now - since >= self.timeout_s]
        for server in late:
            self.on_lost(server, f"no answer in {self.timeout_s:.0f} s")
        if not late:
            raise DrafterFailed(f"DSI made no progress in {self.timeout_s:.0f} s: the drafter stopped answering")


def dsi(executor: Any, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int, lookahead: int,
        sampling: SamplingConfig, generator: torch.Generator | None, eos_token_ids: frozenset[int],
        timeout_s: float = 300.0, close_executor: bool = True) -> Decoder:
    """Lossless DSI over `executor`'s target servers (see the module docstring). Yields committed tokens;
    returns GenerationStats with `dsi` holding per-server records and the timeline.

    The executor is started here unless it already runs (start it beforehand to keep its start-up out
    of the timing); it is closed at the end when `close_executor`."""
    executor.start()
    events = executor.events
    worker = DraftWorker(drafter, events)
    spec = executor.spec

    def fallback(index: int) -> Any:
        return spec.build(index, Canceller(), own_process=False, device=spec.devices[0])

    state = Coordinator(executor, worker, list(prompt_ids), max_new_tokens, lookahead, sampling, generator,
                        fallback, events, timeout_s)
    out: list[int] = []
    try:
        worker.restart(state.seq, 0, state.limit())
        worker.thread.start()
        state.warm_up()
        done = False
        while not done:
            state.dispatch()
            try:
                event = events.get(timeout=timeout_s)
            except queue.Empty:
                state.on_timeout()
                continue
            if event[0] == "draft":
                state.on_draft(*event[1:])
            elif event[0] == "result":
                done = yield from emit(state.on_result(event[1]), out, max_new_tokens, eos_token_ids)
            elif event[0] == "lost":
                state.on_lost(*event[1:])
            else:
                raise DrafterFailed(f"the drafter failed: {event[1]}")
    finally:
        worker.stop()
        state.finish()
        if worker.thread.is_alive():
            worker.thread.join(timeout=timeout_s)
        while not events.empty():  # the drafter's last drafts: nothing for a later run to see
            events.get_nowait()
        if close_executor:
            executor.close()
    stats = state.stats
    stats.new_tokens = len(out)
    stats.record_target(state.target_usage)
    stats.dsi = state.record
    return stats
