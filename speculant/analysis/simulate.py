"""Offline simulation of non-SI, SI and DSI (Timor et al., "Distributed Speculative Inference",
Appendix F.3-F.4), vectorised over many configurations at once with numpy.

Acceptance is i.i.d.: the number of accepted drafts in an iteration is Geometric(1 - a) - 1, capped at
the lookahead. Latencies add up: the target's first forward costs `target_first` (TTFT), later ones
`target` (TPOT); a drafter forward costs `c`. Arrays of configurations (a, c, k) run together.

- non-SI: one target forward per token.
- SI: each iteration drafts k tokens, then one target forward verifies them.
- DSI: verification runs on other servers and never blocks drafting, so a stretch of accepted drafts
  costs only drafting. A rejection costs one target forward, counted from the launch of the job that
  detects it: the job holding the rejected draft, or, for a job's first draft, the previous job (whose
  forward also scores the next position; after a correction a job on the bare prefix starts at once).
  With lookahead 1 this is Proposition 1's accounting: t1 per accepted, t2 per rejected token. A
  stretch is never slower than the target alone on it (Theorem 1). This needs enough target servers:
  see `theory.servers_needed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _accepted(rng: np.random.Generator, a: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Accepted drafts per iteration: Geometric(1 - a) - 1 capped at `cap` (a = 1 accepts all)."""
    failure = np.clip(1 - a, 1e-12, 1)
    draws = rng.geometric(failure) - 1
    return np.minimum(np.where(a >= 1, cap, draws), cap)


def simulate_non_si(n_tokens: int, target: float = 1.0, target_first: float | None = None) -> float:
    return (target if target_first is None else target_first) + (n_tokens - 1) * target


def simulate_si(a: np.ndarray, c: np.ndarray, k: np.ndarray, n_tokens: int, rng: np.random.Generator,
                target: float = 1.0, target_first: float | None = None) -> np.ndarray:
    """Latency of SI for each configuration (a, drafter latency c, lookahead k), all arrays of one shape."""
    a, c, k = np.broadcast_arrays(np.asarray(a, float), np.asarray(c, float), np.asarray(k, int))
    left = np.full(a.shape, n_tokens)
    cost = np.zeros(a.shape)
    first = True
    while (active := left > 0).any():
        curr_k = np.where(active, np.minimum(k, left - 1), 0)
        drafting = curr_k * c
        verify = target_first if first and target_first is not None else target
        cost += np.where(active, drafting + verify, 0)
        left -= np.where(active, _accepted(rng, a, curr_k) + 1, 0)
        first = False
    return cost


def simulate_dsi(a: np.ndarray, c: np.ndarray, k: np.ndarray, n_tokens: int, rng: np.random.Generator,
                 target: float = 1.0, target_first: float | None = None) -> np.ndarray:
    """Latency of DSI for each configuration, assuming enough target servers (the caller checks)."""
    a, c, k = np.broadcast_arrays(np.asarray(a, float), np.asarray(c, float), np.asarray(k, int))
    done = np.zeros(a.shape, dtype=int)  # committed tokens
    stretch_tokens = np.zeros(a.shape, dtype=int)  # tokens of the current stretch between rejections
    stretch_cost = np.zeros(a.shape)
    cost = np.zeros(a.shape)
    first_stretch = np.ones(a.shape, dtype=bool)
    while (active := done < n_tokens).any():
        curr_k = np.where(active, np.minimum(k, n_tokens - 1 - done - stretch_tokens), 0)
        accepted = _accepted(rng, a, curr_k)
        stretch_tokens += np.where(active, accepted, 0)
        ends = active & ((curr_k == 0) | (accepted < curr_k))  # a rejection (or the last token)
        # A rejection at a job's first token is caught by the previous job, whose forward also scores
        # the next position, so this job's drafting is not waited for; later rejections wait for it.
        stretch_cost += np.where(active & ~(ends & (accepted == 0)), curr_k * c, 0)
        verify = np.where(first_stretch, target if target_first is None else target_first, target)
        stretch_tokens += ends
        stretch_cost += np.where(ends, verify, 0)
        alone = np.where(first_stretch, verify + (stretch_tokens - 1) * target, stretch_tokens * target)
        cost += np.where(ends, np.minimum(stretch_cost, alone), 0)
        done += np.where(ends, stretch_tokens, 0)
        stretch_tokens[ends] = 0
        stretch_cost[ends] = 0
        first_stretch &= ~ends
    return cost


SP_DEGREE = 7  # an 8-GPU node: 7 target servers and 1 drafter, as in the paper's heatmaps


@dataclass
class Grid:
    """Mean latencies (in target forwards) over drafter latency c x acceptance a x lookahead k."""

    c: np.ndarray  # [C]
    a: np.ndarray  # [A]
    k: np.ndarray  # [K]
    non_si: float
    si: np.ndarray  # [C, A, K]
    dsi: np.ndarray  # [C, A, K]; SI's latency where the servers cannot keep up with lookahead k
    feasible: np.ndarray  # [C, A, K] bool: enough target servers for DSI at this lookahead

    def best_si(self) -> np.ndarray:
        """SI at its best lookahead per (c, a) [C, A]."""
        return self.si.min(-1)

    def best_dsi(self) -> np.ndarray:
        return self.dsi.min(-1)

    def at_lookahead(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        index = int(np.flatnonzero(self.k == k)[0])
        return self.si[..., index], self.dsi[..., index]


def simulate_grid(c: np.ndarray, a: np.ndarray, k: np.ndarray, n_tokens: int = 100, repeats: int = 5,
                  servers: int = SP_DEGREE, seed: int = 0) -> Grid:
    """The paper's offline grid (Figure 2): every (c, a, k), `repeats` times, all in one numpy run.

    SI and DSI see the same configurations; DSI is restricted to the lookaheads that `servers` target
    servers can keep busy and runs as SI elsewhere."""
    rng = np.random.default_rng(seed)
    cc, aa, kk = np.meshgrid(c, a, k, indexing="ij")
    shape = (repeats, *cc.shape)
    si = simulate_si(np.broadcast_to(aa, shape), np.broadcast_to(cc, shape), np.broadcast_to(kk, shape),
                     n_tokens, rng).mean(0)
    dsi = simulate_dsi(np.broadcast_to(aa, shape), np.broadcast_to(cc, shape), np.broadcast_to(kk, shape),
                       n_tokens, rng).mean(0)
    feasible = np.ceil(1 / (kk * cc) - 1e-12) <= servers  # theory.servers_needed with target latency 1
    # Where the servers cannot keep up, DSI can always run as SI (one verification in flight at a time).
    return Grid(np.asarray(c), np.asarray(a), np.asarray(k), simulate_non_si(n_tokens), si,
                np.where(feasible, dsi, si), feasible)


def summary(grid: Grid) -> dict[str, float]:
    """The numbers the paper quotes about Figure 2."""
    si, dsi = grid.best_si(), grid.best_dsi()
    baseline = np.minimum(si, grid.non_si)
    return {
        "si_slower_than_non_si_share": float((si > grid.non_si).mean()),
        "min_dsi_speedup_over_si": float((si / dsi).min()),
        "min_dsi_speedup_over_non_si": float((grid.non_si / dsi).min()),
        "max_dsi_speedup_over_best_baseline": float((baseline / dsi).max()),
    }
