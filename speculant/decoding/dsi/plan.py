"""Planning a DSI run: the lookahead that N target servers can keep up with (DSI, Appendix D)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from speculant.theory import min_lookahead, servers_needed
from speculant.errors import ConfigError
from speculant.models.base import CausalLM

MAX_LOOKAHEAD = 64  # a nearly free drafter (Max-Gram) would otherwise ask for unbounded lookaheads


@dataclass(frozen=True)
class Plan:
    lookahead: int
    servers: int
    target_s: float | None  # the latencies planned with (None: not known, lookahead given)
    drafter_s: float | None

    def describe(self) -> str:
        if self.target_s is None or self.drafter_s is None:
            return f"lookahead {self.lookahead} (given) on {self.servers} target server(s)"
        needed = servers_needed(self.target_s, max(self.drafter_s, 1e-9), self.lookahead)
        return (f"lookahead {self.lookahead} on {self.servers} target server(s) (target {self.target_s * 1000:.1f} ms, "
                f"drafter {self.drafter_s * 1000:.1f} ms per forward: {needed} server(s) needed)")


def plan(servers: int, lookahead: int | None, target_s: float | None, drafter_s: float | None) -> Plan:
    """The smallest lookahead that `servers` servers keep busy without waiting on drafting,
    ceil(t_target / (N t_drafter)); `lookahead` overrides it but must be feasible when latencies are known.
    Refuses plans that cannot work, with the reason."""
    if servers < 1:
        raise ConfigError(f"DSI needs at least one target server, got {servers}")
    if lookahead is not None and lookahead < 1:
        raise ConfigError(f"lookahead must be >= 1, got {lookahead}")
    known = target_s is not None and drafter_s is not None
    if not known:
        if lookahead is None:
            raise ConfigError("planning the lookahead needs the target and drafter latencies (or give a lookahead)")
        return Plan(lookahead, servers, None, None)
    if target_s <= 0 or drafter_s < 0:
        raise ConfigError("latencies must be positive")
    if lookahead is None:
        if drafter_s >= target_s:
            raise ConfigError(f"a drafter as slow as the target ({drafter_s * 1000:.1f} ms vs {target_s * 1000:.1f} ms "
                              "per forward) cannot make DSI faster; give a lookahead to run it anyway")
        lookahead = min(MAX_LOOKAHEAD, min_lookahead(target_s, max(drafter_s, 1e-9), servers))
    elif drafter_s > 0 and (needed := servers_needed(target_s, drafter_s, lookahead)) > servers:
        raise ConfigError(f"{servers} target server(s) cannot keep up with lookahead {lookahead}: it needs {needed}; "
                          f"use lookahead >= {min_lookahead(target_s, drafter_s, servers)} or more servers")
    return Plan(lookahead, servers, target_s, drafter_s)


def measure_step(model: CausalLM, prompt: list[int], repeats: int = 3) -> float:
    """Median seconds of one single-token forward after prefilling `prompt` (the planner's TPOT): its last tokens
    where the model holds fewer positions (a small drafter's cache, a prompt longer than it)."""
    room = getattr(model, "max_positions", None)
    if room is not None:
        prompt = prompt[-(room - 1):]
    model.prefill(prompt)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.forward(prompt[-1:])
        samples.append(time.perf_counter() - start)
        model.rollback(len(prompt))
    return statistics.median(samples)
