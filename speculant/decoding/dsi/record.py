"""What a DSI run leaves behind besides its tokens: per-server counts and the timeline of forwards."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerRecord:
    """One target server: jobs answered, how many were used, preempted (cancelled or stale on arrival; of
    those, cut short inside their forward) or redundant (every row already committed), the forwards they
    cost, the busy time, and what the jobs carried: tokens sent (vs the whole sequences), pickled bytes,
    tokens run through the model."""

    index: int
    jobs: int = 0
    used: int = 0
    preempted: int = 0
    cut_short: int = 0
    redundant: int = 0
    forwards: int = 0
    wasted_forwards: int = 0
    busy_s: float = 0.0
    sent_tokens: int = 0
    sequence_tokens: int = 0
    sent_bytes: int = 0
    forwarded: int = 0
    lost: str | None = None  # why the server was lost, if it was


@dataclass
class Bar:
    """One forward on the timeline: `row` -1 - d is drafter d, i >= 0 target server i; seconds from start."""

    row: int
    start: float
    end: float
    outcome: str  # drafter: "kept" / "discarded"; servers: "used" / "preempted" / "redundant"
    job: int = -1
    cut_short: bool = False  # a server's forward stopped early by its cancellation


@dataclass
class DSIRecord:
    executor: str
    servers: list[ServerRecord]
    lookahead: int
    bars: list[Bar] = field(default_factory=list)
    rejections: list[tuple[float, int]] = field(default_factory=list)  # (seconds from start, position)
    fallback: bool = False  # every server was lost; the run finished as speculative decoding in process
    drafters: list[str] = field(default_factory=lambda: ["drafter"])

    def summary(self) -> str:
        parts = [f"{s.jobs} jobs ({s.used} used, {s.preempted} preempted, {s.cut_short} cut short)"
                 + (" LOST" if s.lost else "") for s in self.servers]
        return (f"DSI ({self.executor}, lookahead {self.lookahead}): " + "; ".join(
            f"server {i}: {p}" for i, p in enumerate(parts)) + (", finished in process" if self.fallback else ""))
