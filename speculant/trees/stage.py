"""Stage-based scheduling with ahead-of-time drafting (Yggdrasil, Guan et al., section 5.1): while the target
verifies tree t, the drafter drafts tree t+1 on a thread of its own, assuming that the likeliest path of tree t (each
node's first child, its likeliest) is accepted and that the target's next token is the drafter's own choice after it.
When verification commits exactly that, the next step starts with its tree already drafted; otherwise the tree is
dropped, and the drafter's cache is brought back to the committed context by its next `DraftCache.run` (which rolls
back to the common prefix). Verification is unchanged, so output is too. On a GPU the drafter's thread queues its
work on a CUDA stream of its own, so that its kernels run beside the target's (the paper's two streams), where the
drafter's cache is allocated once (`fixed_cache`: a growing one would free blocks the target's stream could reuse
while the drafter's still reads them); on the CPU the two threads share the cores."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from speculant.drafters.base import Draft
from speculant.drafters.model import guided
from speculant.models.wrappers.metered import Usage
from speculant.trees.drafter import TreeDrafter
from speculant.trees.tree import TokenTree


@dataclass
class StageRecord:
    """Of a generation's trees drafted ahead: how many were `drafted`, how many the committed context matched
    (`hits`), the seconds they took on the drafter's thread (`ahead_s`), and the seconds the decoder then still
    waited for them (`waited_s`): the rest ran during verification (`overlap`)."""

    drafted: int = 0
    hits: int = 0
    ahead_s: float = 0.0
    waited_s: float = 0.0

    def __add__(self, other: StageRecord) -> StageRecord:
        return StageRecord(self.drafted + other.drafted, self.hits + other.hits, self.ahead_s + other.ahead_s,
                           self.waited_s + other.waited_s)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.drafted if self.drafted else 0.0

    @property
    def overlap(self) -> float:  # (a tree queued behind a busy thread is waited for longer than it drafted)
        return max(1 - self.waited_s / self.ahead_s, 0.0) if self.ahead_s > 0 else 0.0


class Ahead:
    """The drafter's thread of one generation: `start` drafts the next tree while the caller verifies this one,
    `take` gives it where the committed context is the one it assumed (None otherwise). The drafter is used by one
    thread at a time: `take` waits for the drafting before the decoder drafts again."""

    def __init__(self, drafter: TreeDrafter, on_miss: Callable[[dict[str, Usage]], None]):
        self.drafter, self.on_miss = drafter, on_miss  # on_miss: what a dropped tree's drafting cost
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="speculant-stage")
        self.pending: Future[tuple[list[int], Draft, float]] | None = None
        self.record = StageRecord()
        model = drafter.model  # on a GPU, a stream of its own where its forwards free nothing the target's might reuse
        fixed = model.device.type == "cuda" and model.capabilities.fixed_cache  # (a growing cache drafts in turn)
        self.stream = torch.cuda.Stream(model.device) if fixed else None

    def start(self, context: list[int], tree: TokenTree, depth: int, width: int,
              cost: Callable[[int], float] | None) -> None:
        """Draft, on the drafter's thread, the tree after `context` + the likeliest path of `tree` + the
        drafter's own next token."""
        assumed = context + tree.first_child_path()
        if self.stream is not None:  # after what this thread has queued (it last wrote the drafter's cache), not
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # after the verification to come
        self.pending = self.pool.submit(self._draft, assumed, depth, width, cost)

    def _draft(self, assumed: list[int], depth: int, width: int,
               cost: Callable[[int], float] | None) -> tuple[list[int], Draft, float]:
        began, before = time.perf_counter(), self.drafter.model.usage
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            try:
                logits = self.drafter.cache.run(assumed)[-1]  # (under structured output, a token the grammar allows)
                allowed = guided(self.drafter.guide, logits, assumed) if self.drafter.guide is not None else None
                guess = int((logits if allowed is None else allowed).argmax())
                context = assumed + [guess]
                tree = self.drafter.propose_tree(context, depth, width, cost)
            finally:
                if self.stream is not None:  # done before the decoder's thread uses the drafter's cache again
                    self.stream.synchronize()
        spent = {self.drafter.name: self.drafter.model.usage - before}  # (the catch-up on the path included)
        return context, replace(tree, usage=spent), time.perf_counter() - began

    def wait(self) -> None:
        """Until the tree drafted ahead is done: the drafter's cache is the caller's again."""
        if self.pending is not None and not self.pending.done():
            began = time.perf_counter()
            self.pending.exception()  # (its error, if any, is raised by `take`)
            self.record.waited_s += time.perf_counter() - began

    def take(self, context: list[int], room: int) -> Draft | None:
        """The tree drafted ahead if it was drafted after exactly `context` and is no deeper than `room`, else
        None (it is dropped, its cost told to `on_miss`)."""
        if self.pending is None:
            return None
        began = time.perf_counter()
        assumed, draft, seconds = self.pending.result()
        self.pending = None
        self.record.drafted += 1
        self.record.ahead_s += seconds
        self.record.waited_s += time.perf_counter() - began
        if assumed != context or max(draft.tree.depths) > room:
            self.on_miss(draft.usage)
            return None
        self.record.hits += 1
        return draft

    def close(self) -> None:
        """Wait for a tree still drafting (the drafter is not left running under the next user of its cache) and
        count it, unused."""
        try:
            if self.pending is not None:
                _, draft, _ = self.pending.result()
                self.record.drafted += 1  # (its drafting time is not counted as overlap: it overlapped nothing used)
                self.on_miss(draft.usage)
        except Exception:  # noqa: BLE001 - the generation's own error, if any, is the one to report
            pass
        finally:
            self.pending = None
            self.pool.shutdown()
