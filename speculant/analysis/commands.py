"""`speculant simulate run` and `speculant simulate heatmap`: torch-free planning tools."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from speculant import theory
from speculant.analysis.simulate import simulate_dsi, simulate_grid, simulate_non_si, simulate_si, summary
from speculant.errors import ConfigError


def _mean_ci(samples: np.ndarray) -> tuple[float, float]:
    """Mean and the half-width of its 95% normal confidence interval."""
    return float(samples.mean()), float(1.96 * samples.std(ddof=1) / math.sqrt(len(samples))) if len(samples) > 1 else 0.0


def simulate_one(target_ms: float, drafter_ms: float, acceptance: float, lookahead: int, servers: int,
                 tokens: int, ttft_ms: float | None, repeats: int, seed: int) -> dict:
    """Expected latency of non-SI, SI and DSI for one configuration, with the theory beside it."""
    if not (target_ms > 0 and drafter_ms > 0):
        raise ConfigError("latencies must be positive")
    if not 0 <= acceptance <= 1:
        raise ConfigError(f"acceptance must lie in [0, 1], got {acceptance}")
    if lookahead < 1 or servers < 1 or tokens < 1 or repeats < 2:
        raise ConfigError("lookahead, servers and tokens must be >= 1, repeats >= 2")
    needed = theory.servers_needed(target_ms, drafter_ms, lookahead)
    if servers < needed:
        raise ConfigError(
            f"{servers} target server(s) cannot keep up with lookahead {lookahead}: it needs {needed}; "
            f"use lookahead >= {theory.min_lookahead(target_ms, drafter_ms, servers)} or more servers")
    rng = np.random.default_rng(seed)
    shape = np.zeros(repeats)
    c = drafter_ms / target_ms
    first = None if ttft_ms is None else ttft_ms / target_ms
    si = simulate_si(shape + acceptance, shape + c, shape.astype(int) + lookahead, tokens, rng, 1.0, first) * target_ms
    dsi = simulate_dsi(shape + acceptance, shape + c, shape.astype(int) + lookahead, tokens, rng, 1.0, first) * target_ms
    non_si = simulate_non_si(tokens, target_ms, ttft_ms)
    (si_mean, si_ci), (dsi_mean, dsi_ci) = _mean_ci(si), _mean_ci(dsi)
    per_iteration = min(theory.sd_expected_tokens(acceptance, lookahead), tokens)
    return {
        "non_si_ms": non_si,
        "si_ms": si_mean,
        "si_ci95_ms": si_ci,
        "dsi_ms": dsi_mean,
        "dsi_ci95_ms": dsi_ci,
        "servers_needed": needed,
        "theory": {
            "si_expected_ms": tokens / per_iteration * (lookahead * drafter_ms + target_ms),
            "dsi_bound_ms": theory.dsi_time_bound(drafter_ms, target_ms, acceptance, tokens)
            + ((ttft_ms or target_ms) - target_ms),
            "tokens_per_si_iteration": per_iteration,
        },
    }


def format_one(result: dict) -> str:
    t = result["theory"]
    return "\n".join([
        f"non-SI  {result['non_si_ms']:10.1f} ms",
        f"SI      {result['si_ms']:10.1f} ms  ± {result['si_ci95_ms']:.1f} (95% CI)   theory {t['si_expected_ms']:.1f} ms",
        f"DSI     {result['dsi_ms']:10.1f} ms  ± {result['dsi_ci95_ms']:.1f} (95% CI)   Proposition 1 bound "
        f"{t['dsi_bound_ms']:.1f} ms",
        f"speedup DSI/SI {result['si_ms'] / result['dsi_ms']:.2f}x, DSI/non-SI {result['non_si_ms'] / result['dsi_ms']:.2f}x, "
        f"SI/non-SI {result['non_si_ms'] / result['si_ms']:.2f}x ({result['servers_needed']} target server(s) needed)",
    ])


def run_heatmap(out: Path, ndim: int, max_lookahead: int, tokens: int, repeats: int, servers: int,
                fixed_lookahead: int, seed: int) -> tuple[dict, list[Path]]:
    """The full grid, its CSV, Figure 2 and Figure 7 PNGs and the summary numbers."""
    from speculant.analysis.heatmap import plot_figure2, plot_figure7, write_csv

    if ndim < 2 or max_lookahead < fixed_lookahead or tokens < 1 or repeats < 1 or servers < 1:
        raise ConfigError("need ndim >= 2, max-lookahead >= the fixed lookahead, and positive tokens, repeats, servers")
    start = time.perf_counter()
    grid = simulate_grid(np.linspace(0.01, 1, ndim), np.linspace(0, 1, ndim), np.arange(1, max_lookahead + 1),
                         tokens, repeats, servers, seed)
    numbers = {**summary(grid), "seconds": time.perf_counter() - start, "configurations": int(grid.si.size * repeats)}
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "grid.csv", out / "figure2.png", out / "figure7.png", out / "summary.json"]
    write_csv(grid, paths[0])
    plot_figure2(grid, paths[1], servers)
    plot_figure7(grid, paths[2], fixed_lookahead)
    paths[3].write_text(json.dumps(numbers, indent=1))
    return numbers, paths
