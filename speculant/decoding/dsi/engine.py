"""Distributed speculative inference: speculation parallelism (Timor et al. 2025, "Distributed
Speculative Inference", Algorithm 1 with lookahead, Appendices C-D).

Drafter threads draft one token at a time and never wait for verification. Every `lookahead` new
drafts become a job for an idle target server, which scores them against the speculated sequence
in one forward (carrying only the tokens that server lacks, see `jobs`). The coordinator (this
generator) commits, position by position, every row whose prefix is already committed: the target's
own token there is final whatever the server, so greedy output equals the target's greedy output. A
token that differs from the draft is a rejection: the drafters restart from the corrected sequence,
in-flight jobs built on the rejected draft are preempted (cancelled inside their forward, their results
discarded) and, when another server stays free for the drafts, a job on the bare committed prefix starts
at once, so a stretch of rejections costs no more than the target alone (Theorem 1). With several
drafters (Algorithm 1 with m > 2 models) a costlier drafter's token replaces a cheaper one's draft.
Sampling decides each position by speculative sampling with the draft's q shipped alongside.
"""

from __future__ import annotations

import contextvars
import itertools
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speculant.config import SamplingConfig
from speculant.decoding.dsi.jobs import Canceller, Job, JobResult
from speculant.decoding.dsi.record import Bar, DSIRecord, ServerRecord
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.drafters.base import Drafter
from speculant.errors import SpeculantError
from speculant.models.base import CausalLM, Interrupted, common_prefix_len
from speculant.models.wrappers.metered import Usage
from speculant.sampling import sample
from speculant.theory import drafts_ahead
from speculant.verify import verify_one


JOB_IDS = itertools.count()  # unique across runs, so a late answer from an earlier run sharing an executor is ignored
REQUEST_IDS = itertools.count()  # one per generation: servers keep the sequence they were sent per request


class DrafterFailed(SpeculantError):
    """The drafter raised or stopped answering; DSI cannot go on without it."""


class DraftWorker:
    """A drafter server: a thread that extends its own context one token at a time, up to `limit`
    tokens, and posts ("draft", index, epoch, position, token, q, usage, start, end) events. The
    coordinator keeps it in step with `sync`; drafts of an older epoch are stale, and a restart cuts the one
    in flight short, as the paper's drafter is terminated and restarted: its `model`'s forward at the next layer
    boundary where the backend is interruptible (`CausalLM.interrupt`), a twin's emulated latency at once
    (`jobs.pause`). A drafter with nothing to propose (Max-Gram without a match) posts ("idle", index, epoch,
    position) and sleeps until its context changes: it never retries a context it had nothing for."""

    def __init__(self, index: int, drafter: Drafter, events: queue.Queue, model: CausalLM | None = None):
        self.index = index  # 0: the cheapest drafter, the leader; higher: costlier, trusted more
        self.drafter = drafter
        self.events = events
        self.model = model if model is not None and model.capabilities.interruptible else None
        self.canceller = Canceller()  # its jobs are epochs: a restart cancels the epoch it leaves
        self.cond = threading.Condition()
        self.context: list[int] = []
        self.epoch = 0
        self.limit = 0
        self.stopped = False
        # (in the step's context: a generation its drafter asks for on a model the step runs is refused, `api.Hold`)
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,), daemon=True,
                                       name=f"dsi-drafter-{index}")

    def sync(self, seq: list[int], committed: int, limit: int) -> None:
        """Keep the context consistent with the speculated sequence `seq` (its first `committed` tokens
        final). Diverged (a rejection, or a costlier drafter's correction): restart, the leader at the
        end of `seq`, the others just past the correction, to review the drafts after it. Behind: the
        leader catches up with `seq`, the others with its committed part (bonus tokens included)."""
        with self.cond:
            context = self.context
            overlap = min(len(context), len(seq))
            if context[:overlap] != seq[:overlap]:
                n = common_prefix_len(context, seq)
                self.context = list(seq if self.index == 0 else seq[: n + 1])
                self.canceller.cancel(self.epoch)
                self.epoch += 1
            elif len(context) < (len(seq) if self.index == 0 else committed):
                self.context = list(seq if self.index == 0 else seq[:committed])
            self.limit = limit
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.canceller.cancel(self.epoch)
            self.cond.notify()

    def _run(self) -> None:
        self.canceller.cuts_pauses()
        if self.model is None:
            return self._draft()
        before, self.model.interrupt = self.model.interrupt, self.canceller.cancelled_now
        try:
            self._draft()
        finally:
            self.model.interrupt = before

    def _draft(self) -> None:
        tried: tuple[int, int] | None = None  # (epoch, length) of a context the drafter had nothing for
        while True:
            with self.cond:
                while not self.stopped and (len(self.context) >= self.limit or tried == (self.epoch, len(self.context))):
                    self.cond.wait()
                if self.stopped:
                    return
                context, epoch = list(self.context), self.epoch
                self.canceller.running = epoch
            start = time.monotonic()
            try:
                draft = self.drafter.propose(list(context), 1)  # (its own copy: one it changed read as stale ever after)
            except Interrupted:  # a restart made it stale
                continue
            except Exception as error:  # noqa: BLE001 - reported to the coordinator, which stops
                self.events.put(("drafter_failed", error))
                return
            end = time.monotonic()
            with self.cond:
                current = epoch == self.epoch and self.context == context
                if not draft.tokens:
                    if current:
                        tried = (epoch, len(context))
                        self.events.put(("idle", self.index, epoch, len(context)))
                    continue
                if current:
                    self.context.append(draft.tokens[0])
            q = draft.probs[0] if draft.probs is not None else None
            self.events.put(("draft", self.index, epoch if current else -1, len(context), draft.tokens[0], q,
                             draft.usage, start, end))


class Coordinator:
    """DSI's state: the committed sequence, the speculated one (committed + drafts), jobs in flight and
    what each server holds of this request's sequence."""

    def __init__(self, executor: Any, workers: list[DraftWorker], prompt: list[int], max_new_tokens: int,
                 lookahead: int, sampling: SamplingConfig, generator: torch.Generator | None,
                 fallback: Callable[[int], Any], events: queue.Queue, timeout_s: float):
        self.executor, self.workers, self.events = executor, workers, events
        self.sampling, self.generator, self.lookahead = sampling, generator, lookahead
        self.fallback, self.timeout_s = fallback, timeout_s
        n = len(executor.spec.devices)
        self.request = next(REQUEST_IDS)
        self.seq = list(prompt)  # committed tokens, then drafts
        self.prompt = len(prompt)
        self.n_committed = len(prompt)
        self.cap = len(prompt) + max_new_tokens - 1  # drafts beyond this position are never needed
        self.max_ahead = drafts_ahead(lookahead, n)
        self.frontier = len(prompt)  # the first position no live job has been asked to predict
        self.q_rows: dict[int, torch.Tensor] = {}
        self.owner: dict[int, int] = {}  # drafted position -> the drafter whose token it holds
        self.stuck: int | None = None  # the leader had nothing to draft after this many tokens of seq
        self.alive, self.idle = set(range(n)), set(range(n))
        self.running: dict[int, tuple[Job, tuple[int, ...], float]] = {}  # server -> (job, its sequence, sent at)
        self.sent: dict[int, tuple[int, ...]] = {}  # server -> the sequence it holds for this request
        self.buffered: list[tuple[Job, tuple[int, ...], JobResult]] = []
        self.local: Any = None  # the in-process server once every server is lost
        self.in_process = n  # its index
        self.t0 = time.monotonic()
        self.record = DSIRecord(executor.name, [ServerRecord(i) for i in range(n)], lookahead,
                                drafters=[getattr(w.drafter, "name", type(w.drafter).__name__) for w in workers])
        self.stats = GenerationStats(method="dsi")
        self.target_usage = Usage()

    # --- drafting ---------------------------------------------------------------------------------
    def limit(self) -> int:
        return min(self.cap, self.n_committed + self.max_ahead)

    def sync_drafters(self) -> None:
        for worker in self.workers:
            worker.sync(self.seq, self.n_committed, self.limit())

    def on_draft(self, index: int, epoch: int, pos: int, token: int, q: torch.Tensor | None,
                 usage: dict[str, Usage], start: float, end: float) -> None:
        self.stats.record_usage(usage)
        kept = epoch == self.workers[index].epoch and self.place(index, pos, token, q)
        self.record.bars.append(Bar(-1 - index, start - self.t0, end - self.t0, "kept" if kept else "discarded"))

    def place(self, index: int, pos: int, token: int, q: torch.Tensor | None) -> bool:
        """Drafter `index`'s token for position `pos` (its context is seq[:pos]). Algorithm 1 with m models:
        a position holds the prediction of the costliest model that made one (j* = argmin over the models
        ordered from the target down), so a costlier drafter's disagreement replaces a cheaper one's draft
        and everything built on it. Returns whether the token was kept."""
        worker, seq = self.workers[index], self.seq
        if pos > len(seq):
            worker.sync(seq, self.n_committed, self.limit())
            return False
        if pos == len(seq):
            self.extend(index, token, q)
            if index:  # the leader drafts on from here
                self.workers[0].sync(seq, self.n_committed, self.limit())
            return True
        # Agreement: an uncommitted draft becomes the costlier drafter's, q included (None: a deterministic one's).
        if seq[pos] == token:
            if pos >= self.n_committed and index > self.owner.get(pos, -1):
                self.owner[pos], self.q_rows[pos] = index, q
            return True
        if pos < self.n_committed or index < self.owner.get(pos, -1):  # the target or a costlier drafter
            worker.sync(seq, self.n_committed, self.limit())  # decided this position otherwise
            return False
        self.replace(pos, token, preempt=False)
        self.owner[pos], self.q_rows[pos] = index, q
        return True

    def on_idle(self, index: int, epoch: int, pos: int) -> None:
        """The leader has nothing to draft after seq[:pos]: pending drafts go to a server now."""
        if index == 0 and epoch == self.workers[0].epoch and pos == len(self.seq):
            self.stuck = pos

    def extend(self, index: int, token: int, q: torch.Tensor | None) -> None:
        pos = len(self.seq)
        self.seq.append(token)
        self.owner[pos], self.stuck = index, None
        if q is not None:
            self.q_rows[pos] = q

    def replace(self, pos: int, token: int, preempt: bool) -> None:
        """`token` now stands at `pos`, uncommitted before: drop the drafts after it and bring every drafter
        in step. After a rejection (`preempt`: pos is committed) the jobs built on the replaced token are
        cancelled; after a drafter's correction they run on, their rows up to pos being still good."""
        del self.seq[pos:]
        self.seq.append(token)
        self.stuck = None
        self.q_rows = {p: q for p, q in self.q_rows.items() if p < pos}
        self.owner = {p: o for p, o in self.owner.items() if p < pos}
        self.frontier = min(self.frontier, pos + 1)
        if preempt:
            for server, (job, tokens, _) in self.running.items():
                if server in self.alive and len(tokens) > pos and tokens[pos] != token:
                    self.executor.cancel(server, job.id)
        self.sync_drafters()

    # --- dispatching ------------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Give idle servers work: a job on the bare prefix when nothing live predicts the next position
        and another server stays free for the drafts (with one server that job would make the drafts wait a
        whole forward: it then runs as pipelined SI), otherwise one as soon as `lookahead` new drafts (or the
        last ones) are waiting. New drafts are those no job carries yet: from max(frontier - 1, n_committed) on
        (the draft at frontier - 1 sits where the last job predicts, but no job carries it)."""
        while True:
            wanted = len(self.seq) + 1 - self.frontier  # positions frontier .. len(seq) to predict
            new = len(self.seq) - max(self.frontier - 1, self.n_committed)
            drafter_waits = len(self.seq) >= self.limit() or self.stuck == len(self.seq)
            bare = self.frontier <= self.n_committed and len(self.idle) >= 2
            ready = wanted >= 1 and (bare or new >= self.lookahead or drafter_waits)
            if not ready or (not self.idle if self.alive else self.in_process in self.running):
                return
            tokens, first_row = tuple(self.seq), self.frontier
            self.frontier = len(self.seq) + 1
            if not self.alive:  # every server lost: finish as speculative decoding in this process
                if self.local is None:
                    self.local, self.record.fallback = self.fallback(self.in_process), True
                    self.record.servers.append(ServerRecord(self.in_process))
                self.events.put(("result", self.local.run(self.job(self.in_process, tokens, first_row))))
                return
            self.send(min(self.idle), tokens, first_row)

    def send(self, server: int, tokens: tuple[int, ...], first_row: int) -> None:
        self.idle.discard(server)
        self.executor.submit(server, self.job(server, tokens, first_row))

    def job(self, server: int, tokens: tuple[int, ...], first_row: int) -> Job:
        """A job asking `server` for the rows from `first_row` on `tokens`, carrying only what it lacks."""
        held = self.sent.get(server, ())
        base = common_prefix_len(held, tokens)
        job = Job(next(JOB_IDS), self.request, base, tokens[base:], first_row, self.prompt)
        self.sent[server] = tokens
        self.running[server] = (job, tokens, time.monotonic())
        rec = self.record.servers[server]
        rec.sent_tokens += len(job.tokens)
        rec.sequence_tokens += len(tokens)
        rec.sent_bytes += len(pickle.dumps(job))
        return job

    def warm_up(self) -> None:
        """Every server prefills the prompt at once; the first answer gives the first token."""
        for server in sorted(self.alive):
            self.send(server, tuple(self.seq), self.n_committed)
        self.frontier = self.n_committed + 1

    # --- results ----------------------------------------------------------------------------------
    def stale(self, tokens: tuple[int, ...]) -> bool:
        n = min(self.n_committed, len(tokens))
        return tokens[:n] != tuple(self.seq[:n])

    def on_result(self, result: JobResult) -> list[int]:
        job, tokens, _ = self.running.get(result.server, (None, (), 0.0))
        if job is None or job.id != result.job:
            return []  # a late answer from an earlier generation on a shared executor
        del self.running[result.server]
        if result.server in self.alive:
            self.idle.add(result.server)
        self.target_usage += result.usage
        rec = self.record.servers[result.server]
        rec.jobs += 1
        rec.forwards += result.forwards
        rec.forwarded += result.forwarded
        rec.busy_s += result.end - result.start
        if result.preempted or self.stale(tokens):
            self.close_bar(job, result, "preempted")
            return []
        self.buffered.append((job, tokens, result))
        return self.apply_buffered()

    def close_bar(self, job: Job, result: JobResult, outcome: str) -> None:
        self.record.bars.append(Bar(result.server, result.start - self.t0, result.end - self.t0, outcome, job.id,
                                    cut_short=result.preempted))
        rec = self.record.servers[result.server]
        if outcome == "used":
            rec.used += 1
            return
        rec.wasted_forwards += result.forwards
        rec.preempted += outcome == "preempted"
        rec.cut_short += result.preempted
        rec.redundant += outcome == "redundant"

    def apply_buffered(self) -> list[int]:
        committed: list[int] = []
        progress = True
        while progress:
            progress = False
            for item in list(self.buffered):
                job, tokens, result = item
                end = result.rows_start + result.rows  # one past the last predicted position
                stale = self.stale(tokens)
                if stale or end <= self.n_committed:
                    self.buffered.remove(item)
                    self.close_bar(job, result, "preempted" if stale else "redundant")
                elif result.rows_start <= self.n_committed:
                    self.buffered.remove(item)
                    committed += self.apply(tokens, result)
                    self.close_bar(job, result, "used")
                    progress = True
        return committed

    def apply(self, tokens: tuple[int, ...], result: JobResult) -> list[int]:
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
            if pos > len(tokens) or tokens[pos - 1] != token:
                break
        self.stats.record_draft(checked, accepted, {})
        return committed

    def commit(self, pos: int, token: int) -> None:
        self.n_committed += 1
        self.q_rows.pop(pos, None)
        self.owner.pop(pos, None)
        if pos < len(self.seq) and self.seq[pos] != token:  # rejection: preempt what built on the draft
            self.record.rejections.append((time.monotonic() - self.t0, pos))
            self.replace(pos, token, preempt=True)
            return
        if pos == len(self.seq):  # a bonus row beyond the drafts
            self.seq.append(token)
            self.stuck = None
            self.frontier = max(self.frontier, pos + 1)
        self.sync_drafters()  # bonus tokens reach the drafters; a wider limit lets them draft on

    def on_lost(self, server: int, reason: str) -> None:
        if server not in self.alive:
            return
        self.alive.discard(server)
        self.idle.discard(server)
        self.record.servers[server].lost = reason
        self.sent.pop(server, None)
        job, tokens, _ = self.running.pop(server, (None, (), 0.0))
        if job is not None and not self.stale(tokens):  # ask again for what it was asked
            self.frontier = max(self.n_committed, min(self.frontier, job.first_row))

    def finish(self) -> None:
        """Cancel what still runs and wait for those answers, so the servers are idle for the next run."""
        for server, (job, _, _) in self.running.items():
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
        late = [s for s, (_, _, since) in self.running.items() if now - since >= self.timeout_s]
        for server in late:
            self.on_lost(server, f"no answer in {self.timeout_s:.0f} s")
        if not late:
            raise DrafterFailed(f"DSI made no progress in {self.timeout_s:.0f} s: the drafter stopped answering")


def dsi(executor: Any, drafters: Drafter | Sequence[Drafter], prompt_ids: list[int], max_new_tokens: int,
        lookahead: int, sampling: SamplingConfig, generator: torch.Generator | None, eos_token_ids: frozenset[int],
        timeout_s: float = 300.0, close_executor: bool = True,
        drafter_models: Sequence[CausalLM | None] = ()) -> Decoder:
    """Lossless DSI over `executor`'s target servers (see the module docstring) with one drafter, or several
    of increasing cost (each in its own thread; a costlier one's draft replaces a cheaper one's). Yields
    committed tokens; returns GenerationStats with `dsi` holding per-server records and the timeline.
    `drafter_models` names each drafter's model (None: it runs none), whose forward a restart interrupts.

    The executor is started here unless it already runs (start it beforehand to keep its start-up out
    of the timing); it is closed at the end when `close_executor`."""
    drafters = list(drafters) if isinstance(drafters, (list, tuple)) else [drafters]
    executor.start()
    events = executor.events
    models = list(drafter_models) or [None] * len(drafters)
    if len(models) != len(drafters):
        raise ValueError(f"{len(models)} drafter models for {len(drafters)} drafters")
    workers = [DraftWorker(index, drafter, events, model)
               for index, (drafter, model) in enumerate(zip(drafters, models))]
    spec = executor.spec

    def fallback(index: int) -> Any:
        return spec.build(index, Canceller(), own_process=False, device=spec.devices[0])

    state = Coordinator(executor, workers, list(prompt_ids), max_new_tokens, lookahead, sampling, generator,
                        fallback, events, timeout_s)
    out: list[int] = []
    try:
        state.sync_drafters()
        for worker in workers:
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
            elif event[0] == "idle":
                state.on_idle(*event[1:])
            elif event[0] == "result":
                done = yield from emit(state.on_result(event[1]), out, max_new_tokens, eos_token_ids)
            elif event[0] == "lost":
                state.on_lost(*event[1:])
            elif isinstance(event[1], SpeculantError):  # (a user's bad draft: the ConfigError the other methods raise)
                raise event[1]
            else:
                raise DrafterFailed(f"the drafter failed: {type(event[1]).__name__}: {event[1]}") from event[1]
    finally:
        for worker in workers:
            worker.stop()
        state.finish()
        for worker in workers:
            if worker.thread.is_alive():
                worker.thread.join(timeout=timeout_s)
        while not events.empty():  # the drafters' last drafts: nothing for a later run to see
            events.get_nowait()
        if close_executor:
            executor.close()
    stats = state.stats
    stats.new_tokens = len(out)
    stats.record_target(state.target_usage)
    stats.dsi = state.record
    return stats
