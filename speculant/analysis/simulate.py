"""Offline simulation of non-SI, SI and DSI (Timor et al., "Distributed Speculative Inference",
Appendix F.3-F.4), vectorised over many configurations at once with numpy.

Acceptance is i.i.d. with common random numbers: repeat r draws u[r, j] ~ U(0, 1) per position j, and a
drafter's token at position j, drafted after a correct prefix, is right iff u[r, j] < a. SI and DSI at
every lookahead see the same draws, so their difference per repeat is paired. Latencies add up: the
target's first forward costs `target_first` (TTFT), later ones `target` (TPOT); a drafter forward `c`.

- non-SI: one target forward per token.
- SI, as the engine runs it (`decoding.speculative`): the first target forward prefills the prompt and gives
  the first token, checking no draft; then each iteration drafts k tokens (no more than can still be emitted)
  and one target forward verifies them. (The DSI paper's SI lets its first forward verify k drafts already.)
- DSI: an event simulation of the engine's own policy (`decoding.dsi.engine`) on N target servers, not a
  formula: the drafter drafts one token per `c` up to (lookahead + 1)(N + 1) tokens ahead
  (`theory.drafts_ahead`); a job goes to an idle server with the pending drafts when nothing in flight predicts
  the next position and another server is free, when k new drafts wait (drafts no job carries yet), or when
  the drafter waits; a job returns after one target forward; a rejection commits the target's token, preempts
  the jobs built on the rejected draft (their servers free at once) and restarts the drafter after it; a bonus
  token past the drafts restarts it too. Servers that cannot keep up make jobs wait, and DSI is then slower:
  nothing is clamped, the simulation says what happens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from speculant.theory import drafts_ahead

SP_DEGREE = 7  # an 8-GPU node: 7 target servers and 1 drafter, as in the paper's heatmaps
MOST_LOOKAHEAD = 1024  # a simulated job's draft tokens (its state is as wide)


def draws(rng: np.random.Generator, a: np.ndarray, repeats: int, n_tokens: int) -> np.ndarray:
    """Common random numbers as `wrong[r, i, j]`: the first position >= j whose draft is wrong in repeat r at
    acceptance a[i] (n_tokens + 1 when none), shape [repeats, len(a), n_tokens + 2]."""
    return first_wrong(rng.random((repeats, 1, n_tokens + 1)) >= np.asarray(a, float)[None, :, None])


def first_wrong(is_wrong: np.ndarray) -> np.ndarray:
    """`draws`' layout from whether each position's draft is wrong, `is_wrong[r, i, j]` for j <= n_tokens."""
    n = is_wrong.shape[-1]
    first = np.minimum.accumulate(np.where(is_wrong, np.arange(n), n)[..., ::-1], axis=-1)[..., ::-1]
    return np.concatenate([first, np.full((*is_wrong.shape[:-1], 1), n)], axis=-1)


def simulate_non_si(n_tokens: int, target: float = 1.0, target_first: float | None = None) -> float:
    return (target if target_first is None else target_first) + (n_tokens - 1) * target


def simulate_si(wrong: np.ndarray, r: np.ndarray, i: np.ndarray, c: np.ndarray, k: np.ndarray, n_tokens: int,
                target: float = 1.0, target_first: float | None = None) -> np.ndarray:
    """SI's latency per configuration (repeat r, acceptance index i, drafter latency c, lookahead k; arrays of
    one shape) on the draws `wrong` (see `draws`), as `decoding.speculative` runs it: the prefill (costing
    `target_first`) gives token 0 and checks no draft, as DSI's servers' prefills do, so both start alike."""
    r, i, c, k = np.broadcast_arrays(r, i, np.asarray(c, float), k)
    pos = np.ones(r.shape, dtype=np.int64)  # the prefill's token is committed
    cost = np.full(r.shape, target if target_first is None else target_first)
    while (active := pos < n_tokens).any():
        drafts = np.where(active, np.minimum(k, n_tokens - 1 - pos), 0)
        accepted = np.minimum(wrong[r, i, np.minimum(pos, n_tokens + 1)] - pos, drafts)
        cost += np.where(active, drafts * c + target, 0)
        pos += np.where(active, accepted + 1, 0)
    return cost


def simulate_dsi(wrong: np.ndarray, r: np.ndarray, i: np.ndarray, c: np.ndarray, k: np.ndarray, servers: int,
                 n_tokens: int, target: float = 1.0, target_first: float | None = None) -> np.ndarray:
    """DSI's latency per configuration on `servers` target servers (see the module docstring), same inputs as
    `simulate_si`. Every server prefills the prompt at the start, as the engine's do."""
    r, i, c, k = np.broadcast_arrays(r, i, np.asarray(c, float), k)
    shape = r.shape
    r, i, c, k = (np.ravel(x) for x in (r, i, c, k))
    if (c <= 0).any():
        raise ValueError("drafter latency must be > 0")
    M, N, inf = r.size, servers, np.inf
    cap = n_tokens - 1  # drafts beyond this position are never needed
    ahead = drafts_ahead(k, N)
    m = np.zeros(M, np.int64)  # committed tokens
    L = np.zeros(M, np.int64)  # committed tokens + drafts
    f = np.ones(M, np.int64)  # the first position no job in flight predicts
    t = np.zeros(M)
    td = np.where(cap > 0, c, inf)  # when the drafter's next draft is done (inf: waiting)
    busy = np.full((M, N), target if target_first is None else target_first)  # when each server is done
    last = np.zeros((M, N), np.int64)  # the last position its job predicts (its sequence length)
    finish = np.zeros(M)
    active = np.ones(M, bool)
    rows = np.arange(M)
    while active.any():
        ts, server = busy.min(1), busy.argmin(1)
        idle = np.isinf(busy).any(1)
        limit = np.minimum(cap, m + ahead)
        # The next draft that matters: the one that lets a job go to an idle server, or the drafter's last.
        need = np.maximum(f - 1, m) + k  # k new drafts (see the dispatch below)
        target_len = np.where(idle & (need > L), np.minimum(need, limit), limit)
        steps = np.maximum(target_len - L, 1)
        t_jump = td + (steps - 1) * c
        on_draft = active & (t_jump < ts)
        on_server = active & ~on_draft
        if np.isinf(np.where(active, np.minimum(t_jump, ts), 0)).any():
            raise RuntimeError("DSI simulation stalled: a bug")
        # Drafts completed before a server event move the drafter on, short of the draft that matters.
        with np.errstate(invalid="ignore"):  # inf - inf where nothing is pending: masked out
            due = np.floor((ts - td) / c) + 1
        done_before = np.where(on_server & (td < ts), np.minimum(due, steps - 1), 0).astype(np.int64)
        L += np.where(on_draft, steps, done_before)
        td = np.where(on_draft, t_jump + c, td + done_before * c)
        t = np.where(on_draft, t_jump, np.where(on_server, ts, t))
        td = np.where(L >= limit, inf, td)
        # A server answers: commit its rows from m while its drafts agree, then handle a rejection.
        s = rows[on_server]
        e, mm, Ls = last[s, server[s]], m[s], L[s]
        busy[s, server[s]] = inf
        w = wrong[r[s], i[s], np.minimum(mm, n_tokens + 1)]
        useful = e >= mm  # else every row was committed already (the other servers' prefills)
        rejected = useful & ((w < e) | ((w == e) & (Ls > e)))
        clean = useful & ~rejected
        new_m = np.where(rejected, w + 1, np.where(clean, e + 1, mm))
        restart = rejected | (clean & (Ls <= e))
        new_L = np.where(rejected, w + 1, np.where(clean, np.maximum(Ls, e + 1), Ls))
        preempt = rejected[:, None] & (last[s] > w[:, None]) & np.isfinite(busy[s])
        busy[s] = np.where(preempt, inf, busy[s])
        f[s] = np.where(rejected, w + 1, f[s])
        m[s], L[s] = new_m, new_L
        lim = np.minimum(cap, new_m + ahead[s])
        tds = np.where(restart | np.isinf(td[s]), t[s] + c[s], td[s])
        td[s] = np.where(new_L >= lim, inf, tds)
        finished = new_m >= n_tokens
        finish[s[finished]] = t[s[finished]]
        active[s[finished]] = False
        # Dispatch: one job per event at most (it takes every pending draft).
        free = np.isinf(busy)
        limit = np.minimum(cap, m + ahead)
        wanted = L + 1 - f  # positions f .. L for a job to predict
        new = L - np.maximum(f - 1, m)  # drafts no job carries yet (the one at f - 1 a job predicts, not carries)
        bare = (f <= m) & (free.sum(1) >= 2)
        ready = active & free.any(1) & (wanted >= 1) & (bare | (new >= k) | (L >= limit))
        d = rows[ready]
        slot = free[d].argmax(1)
        busy[d, slot] = t[d] + target
        last[d, slot] = L[d]
        f[d] = L[d] + 1
    return finish.reshape(shape)


def dsi_bound(wrong: np.ndarray, r: np.ndarray, i: np.ndarray, c: np.ndarray, n_tokens: int, target: float = 1.0,
              target_first: float | None = None) -> np.ndarray:
    """Proposition 1's bound (`theory.dsi_time_bound` with a prefill first) on the draws themselves, per
    configuration: the prefill gives token 0, then t1 per right draft and t2 per wrong one among positions
    1 .. n_tokens - 2, and t2 for the last token. It holds for DSI at lookahead 1 on enough servers (at least
    two, and `theory.servers_needed`) on every draw, not only in expectation, so a simulated mean never exceeds it."""
    r, i, c = np.broadcast_arrays(r, i, np.asarray(c, float))
    j = np.arange(1, max(n_tokens - 1, 1))
    right = (wrong[r[..., None], i[..., None], j] != j).sum(-1)  # wrong[.., j] == j: position j's draft is wrong
    rest = c * right + target * (j.size - right + 1)
    return (target if target_first is None else target_first) + np.where(n_tokens > 1, rest, 0.0)


@dataclass
class Grid:
    """Latencies (in target forwards) per repeat over drafter latency c x acceptance a x lookahead k."""

    c: np.ndarray  # [C]
    a: np.ndarray  # [A]
    k: np.ndarray  # [K]
    servers: int
    non_si: float
    si: np.ndarray  # [C, A, K, R]
    dsi: np.ndarray  # [C, A, K, R]

    def best(self, values: np.ndarray) -> np.ndarray:
        """Per repeat, the values at each cell's lookahead of least mean latency [C, A, R]."""
        index = values.mean(-1).argmin(-1)
        return np.take_along_axis(values, index[..., None, None], axis=2)[:, :, 0]

    def best_si(self) -> np.ndarray:
        return self.best(self.si).mean(-1)

    def best_dsi(self) -> np.ndarray:
        return self.best(self.dsi).mean(-1)

    def best_dsi_lookahead(self) -> np.ndarray:
        return self.k[self.dsi.mean(-1).argmin(-1)]

    def at_lookahead(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        index = int(np.flatnonzero(self.k == k)[0])
        return self.si[..., index, :].mean(-1), self.dsi[..., index, :].mean(-1)

    def servers_short(self) -> np.ndarray:
        """Cells whose best DSI lookahead needs more servers than there are (Appendix D), [C, A] bool."""
        return np.ceil(1 / (self.best_dsi_lookahead() * self.c[:, None]) - 1e-9) > self.servers


def simulate_grid(c: np.ndarray, a: np.ndarray, k: np.ndarray, n_tokens: int = 100, repeats: int = 10,
                  servers: int = SP_DEGREE, seed: int = 0, done: Callable[[], None] | None = None) -> Grid:
    """The paper's offline grid (Figure 2): every (c, a, k), `repeats` times on common random numbers, SI
    and DSI both simulated at every lookahead (one drafter row of the grid at a time, to bound memory; `done()`
    after each, a progress bar's step)."""
    c, a, k = np.asarray(c, float), np.asarray(a, float), np.asarray(k, np.int64)
    wrong = draws(np.random.default_rng(seed), a, repeats, n_tokens)
    ii, kk, rr = np.meshgrid(np.arange(len(a)), k, np.arange(repeats), indexing="ij")
    si = np.empty((len(c), len(a), len(k), repeats))
    dsi = np.empty_like(si)
    for row, cost in enumerate(c):
        si[row] = simulate_si(wrong, rr, ii, cost, kk, n_tokens)
        dsi[row] = simulate_dsi(wrong, rr, ii, cost, kk, servers, n_tokens)
        if done is not None:
            done()
    return Grid(c, a, k, servers, simulate_non_si(n_tokens), si, dsi)


def paired(baseline: np.ndarray, dsi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per cell, the 95% normal confidence interval of the mean paired saving baseline - DSI over repeats. Latencies
    equal but for the order their sums ran in (DSI on one server at lookahead 1 where every draft is wrong runs as
    SI does) differ by 0, not by a rounding error the interval would find significant."""
    diff = baseline - dsi
    diff = np.where(np.abs(diff) <= 1e-9 * np.abs(baseline), 0.0, diff)
    half = 1.96 * diff.std(-1, ddof=1) / np.sqrt(diff.shape[-1]) if diff.shape[-1] > 1 else np.zeros(diff.shape[:-1])
    return diff.mean(-1) - half, diff.mean(-1) + half


def verdicts(grid: Grid) -> dict[str, dict[str, float]]:
    """Per baseline (SI at its best lookahead, non-SI), the share of cells where DSI at its best lookahead is
    faster (the interval of the paired saving lies above 0), tied (it holds 0) and slower (below 0); the
    share where DSI >= the baseline as an interval [faster, faster + tied]."""
    dsi = grid.best(grid.dsi)
    out = {}
    for name, base in (("si", grid.best(grid.si)), ("non_si", np.full(dsi.shape, grid.non_si))):
        low, high = paired(base, dsi)
        faster, slower = float((low > 0).mean()), float((high < 0).mean())
        tied = 1 - faster - slower
        out[name] = {"faster": faster, "tied": tied, "slower": slower, "share_dsi_ge": [faster, faster + tied]}
    return out


def summary(grid: Grid) -> dict:
    """The numbers the paper quotes about Figure 2, measured: shares of cells with intervals, extreme
    ratios, and where DSI loses, whether its servers could keep up."""
    si, dsi = grid.best_si(), grid.best_dsi()
    baseline = np.minimum(si, grid.non_si)
    found = verdicts(grid)
    loses = (si / dsi < 1 - 1e-9) | (grid.non_si / dsi < 1 - 1e-9)  # (equal but for rounding: see `paired`)
    short = grid.servers_short()
    return {
        "si_slower_than_non_si_share": float((si > grid.non_si).mean()),
        "dsi_vs_si": found["si"],
        "dsi_vs_non_si": found["non_si"],
        "min_dsi_speedup_over_si": float((si / dsi).min()),
        "min_dsi_speedup_over_non_si": float((grid.non_si / dsi).min()),
        "max_dsi_speedup_over_best_baseline": float((baseline / dsi).max()),
        "cells_where_dsi_loses": int(loses.sum()),
        "of_those_servers_short": int((loses & short).sum()),
        "cells": int(si.size),
        "repeats": int(grid.si.shape[-1]),
        "lookaheads": [int(x) for x in grid.k],
    }


def paper_axes(ndim: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """The DSI authors' heatmap axes: ndim + 1 points on [0, 1] each, drafter latency at least 0.01 and
    acceptance within [0.01, 0.99], duplicates dropped (ndim 100: 100 x 99 cells)."""
    points = np.linspace(0, 1, ndim + 1)
    return np.unique(np.maximum(points, 0.01)), np.unique(np.clip(points, 0.01, 0.99))
