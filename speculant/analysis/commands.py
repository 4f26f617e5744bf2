"""`speculant simulate run` and `speculant simulate heatmap`: torch-free planning tools."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from speculant import theory
from speculant.analysis.simulate import (MOST_LOOKAHEAD, SP_DEGREE, draws, dsi_bound, paired, paper_axes, simulate_dsi,
                                         simulate_grid, simulate_non_si, simulate_si, summary)
from speculant.errors import ConfigError


MOST_SERVERS, MOST_TOKENS, MOST_DRAWS = 1024, 100_000, 10_000_000  # a simulation's size: its memory and time
MOST_SERVER_DRAWS = 200_000_000  # repeats x tokens x servers: a run's time (each event visits every server)
MOST_CELLS, MOST_STEPS = 10_000_000, 1_000_000_000  # a heatmap's (c, a, k, repeat) cells and cells x tokens: five
# times the paper's grid at the default tokens (ndim 100, 18 lookaheads, 10 repeats), its memory and time; times
# SP_DEGREE for cells x servers and cells x tokens x servers, five times that grid on the paper's 7 servers


def refuse_over(what: str, sizes: list[tuple[str, int, int]]) -> None:
    """A ConfigError naming each (name, size, most) of `sizes` over its most, where any is."""
    if over := [f"{name} {size} > {most}" for name, size, most in sizes if size > most]:
        raise ConfigError(f"{what} this large would not run in seconds here: {', '.join(over)}")


def check_size(servers: int, lookahead: int, tokens: int, repeats: int, seed: int) -> None:
    """Refuse a simulation larger than this machine runs in seconds (its draws are repeats x tokens floats, its
    servers' state repeats x servers; each event visits every server), or a seed numpy cannot take."""
    refuse_over("a simulation", [
        ("servers", servers, MOST_SERVERS), ("lookahead", lookahead, MOST_LOOKAHEAD), ("tokens", tokens, MOST_TOKENS),
        ("repeats x tokens", repeats * tokens, MOST_DRAWS), ("repeats x servers", repeats * servers, MOST_DRAWS),
        ("repeats x tokens x servers", repeats * tokens * servers, MOST_SERVER_DRAWS)])
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")


def _mean_ci(samples: np.ndarray) -> tuple[float, float]:
    """Mean and the half-width of its 95% normal confidence interval."""
    return float(samples.mean()), float(1.96 * samples.std(ddof=1) / math.sqrt(len(samples))) if len(samples) > 1 else 0.0


def at_least(**bounds: tuple[float, float]) -> None:
    """Refuse, naming it, the first setting below its least value (`name=(value, least)`)."""
    for name, (value, least) in bounds.items():
        if value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")


def simulate_one(target_ms: float, drafter_ms: float, acceptance: float, lookahead: int, servers: int,
                 tokens: int, ttft_ms: float | None, repeats: int, seed: int) -> dict:
    """Expected latency of non-SI, SI and DSI for one configuration on common random numbers, the paired
    saving of DSI over SI with its interval, and the theory beside it."""
    if not (target_ms > 0 and drafter_ms > 0):
        raise ConfigError("latencies must be positive")
    if not 0 <= acceptance <= 1:
        raise ConfigError(f"acceptance must lie in [0, 1], got {acceptance}")
    at_least(lookahead=(lookahead, 1), servers=(servers, 1), tokens=(tokens, 1), repeats=(repeats, 2))
    if tokens == 1 and ttft_ms == 0:  # (every method's latency 0: no speedup to read)
        raise ConfigError("tokens must be >= 2 where the first forward takes 0 ms (one token then takes no time: no "
                          "latency to compare)")
    check_size(servers, lookahead, tokens, repeats, seed)
    wrong = draws(np.random.default_rng(seed), np.array([acceptance]), repeats, tokens)
    r, c, first = np.arange(repeats), drafter_ms / target_ms, None if ttft_ms is None else ttft_ms / target_ms
    si = simulate_si(wrong, r, 0, c, lookahead, tokens, 1.0, first) * target_ms
    dsi = simulate_dsi(wrong, r, 0, c, lookahead, servers, tokens, 1.0, first) * target_ms
    non_si = simulate_non_si(tokens, target_ms, ttft_ms)
    (si_mean, si_ci), (dsi_mean, dsi_ci) = _mean_ci(si), _mean_ci(dsi)
    low, high = paired(si, dsi)
    per_iteration = theory.sd_expected_tokens(acceptance, min(lookahead, max(tokens - 2, 0)))
    first_ms = target_ms if ttft_ms is None else ttft_ms
    # Proposition 1 bounds DSI at lookahead 1 on servers enough that no job waits (and two at least: with one,
    # no job on the bare prefix can run beside the drafts)
    bound_servers = max(2, theory.servers_needed(target_ms, drafter_ms, 1))
    bounded = lookahead == 1 and servers >= bound_servers
    return {
        "non_si_ms": non_si,
        "si_ms": si_mean,
        "si_ci95_ms": si_ci,
        "dsi_ms": dsi_mean,
        "dsi_ci95_ms": dsi_ci,
        "dsi_saving_over_si_ci95_ms": [float(low), float(high)],
        "servers_needed": theory.servers_needed(target_ms, drafter_ms, lookahead),
        "servers": servers,
        "theory": {
            "si_expected_ms": si_expected_ms(target_ms, drafter_ms, acceptance, lookahead, tokens, first_ms),
            # the bound on the very draws simulated (never below the simulated DSI), and in expectation
            "dsi_bound_ms": float(dsi_bound(wrong, r, 0, c, tokens, 1.0, first).mean()) * target_ms
            if bounded else None,
            "dsi_bound_expected_ms": theory.dsi_time_bound(drafter_ms, target_ms, acceptance, tokens, first_ms)
            if bounded else None,
            "dsi_bound_servers": bound_servers,
            "tokens_per_si_iteration": per_iteration,
        },
    }


def si_expected_ms(target_ms: float, drafter_ms: float, acceptance: float, lookahead: int, tokens: int,
                   first_ms: float) -> float:
    """SI's expected latency as the engine runs it (and `simulate_si` simulates it): the prefill gives the first
    token, then each iteration drafts no more than can still be emitted, min(k, tokens - 1 - position), and accepts
    j of them with probability a^j (1 - a), all with a^d. Exact: the expected time left, from the last position
    back."""
    left = np.zeros(tokens + 1)  # left[pos]: the expected time from `pos` tokens emitted to the end
    chance = acceptance ** np.arange(lookahead + 1)  # a^j
    for pos in range(tokens - 1, 0, -1):
        d = min(lookahead, tokens - 1 - pos)
        later = (1 - acceptance) * chance[:d] @ left[pos + 1:pos + d + 1] + chance[d] * left[pos + d + 1]
        left[pos] = d * drafter_ms + target_ms + later
    return float(first_ms + left[1])


def format_one(result: dict) -> str:
    t = result["theory"]
    bound = (f"Proposition 1 bound {t['dsi_bound_ms']:.1f} ms on these draws ({t['dsi_bound_expected_ms']:.1f} "
             "expected; the first forward a prefill)" if t["dsi_bound_ms"] is not None
             else f"(Proposition 1 bounds lookahead 1 on >= {t['dsi_bound_servers']} servers only)")
    low, high = result["dsi_saving_over_si_ci95_ms"]
    lines = [
        f"non-SI  {result['non_si_ms']:10.1f} ms",
        f"SI      {result['si_ms']:10.1f} ms  ± {result['si_ci95_ms']:.1f} (95% CI)   theory {t['si_expected_ms']:.1f} ms",
        f"DSI     {result['dsi_ms']:10.1f} ms  ± {result['dsi_ci95_ms']:.1f} (95% CI)   {bound}",
        f"speedup DSI/SI {result['si_ms'] / result['dsi_ms']:.2f}x (paired saving {low:.1f} .. {high:.1f} ms, 95% CI), "
        f"DSI/non-SI {result['non_si_ms'] / result['dsi_ms']:.2f}x, SI/non-SI {result['non_si_ms'] / result['si_ms']:.2f}x",
    ]
    if result["servers_needed"] > result["servers"]:
        lines.append(f"note: this lookahead needs {result['servers_needed']} target server(s) to keep up; with "
                     f"{result['servers']}, DSI's jobs wait for a server (simulated as they would)")
    return "\n".join(lines)


HEATMAP_FILES = ("grid.csv", "figure2.png", "figure7.png", "summary.json")  # what `simulate heatmap` writes in --out
LOOKAHEADS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 65, 80, 100)


def run_heatmap(out: Path, ndim: int, lookaheads: tuple[int, ...], tokens: int, repeats: int, servers: int,
                fixed_lookahead: int, seed: int) -> tuple[dict, list[Path]]:
    """The grid on the paper's axes (`paper_axes(ndim)`), its CSV, Figure 2 and Figure 7 PNGs and the summary."""
    from speculant.analysis.heatmap import plot_figure2, plot_figure7, write_csv

    at_least(ndim=(ndim, 2), lookaheads=(min(lookaheads), 1), tokens=(tokens, 1), repeats=(repeats, 2),
             servers=(servers, 1))
    if len(set(lookaheads)) < len(lookaheads):  # (one was dropped unsaid)
        raise ConfigError(f"lookaheads lists one twice: give each once, got {','.join(map(str, lookaheads))}")
    if fixed_lookahead not in lookaheads:
        raise ConfigError(f"the fixed lookahead {fixed_lookahead} (Figure 7's) must be among the lookaheads "
                          f"{','.join(map(str, lookaheads))}")
    check_size(servers, max(lookaheads), tokens, repeats, seed)
    cells = (ndim + 1) ** 2 * len(lookaheads) * repeats
    refuse_over("a heatmap", [
        ("cells ((ndim + 1)^2 x lookaheads x repeats)", cells, MOST_CELLS),
        ("cells x tokens", cells * tokens, MOST_STEPS),
        ("(ndim + 1) x repeats x tokens", (ndim + 1) * repeats * tokens, MOST_DRAWS),
        ("cells x servers", cells * servers, MOST_CELLS * SP_DEGREE),
        ("cells x tokens x servers", cells * tokens * servers, MOST_STEPS * SP_DEGREE)])
    from tqdm import tqdm

    start = time.perf_counter()
    c, a = paper_axes(ndim)
    with tqdm(total=len(c), desc="simulating the grid, a drafter cost at a time", unit="row", file=sys.stderr,
              leave=False) as bar:
        grid = simulate_grid(c, a, np.array(sorted(lookaheads)), tokens, repeats, servers, seed, done=bar.update)
    numbers = {**summary(grid), "seconds": time.perf_counter() - start, "configurations": int(grid.si.size)}
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in HEATMAP_FILES]
    write_csv(grid, paths[0])
    plot_figure2(grid, paths[1])
    plot_figure7(grid, paths[2], fixed_lookahead)
    paths[3].write_text(json.dumps(numbers, indent=1))
    return numbers, paths


def format_heatmap(numbers: dict) -> str:
    lines = [f"{numbers['configurations']} simulated configurations ({numbers['cells']} cells x "
             f"{len(numbers['lookaheads'])} lookaheads x {numbers['repeats']} repeats) in {numbers['seconds']:.1f} s",
             f"SI slower than non-SI in {numbers['si_slower_than_non_si_share']:.0%} of cells"]
    for key, name in (("dsi_vs_si", "SI"), ("dsi_vs_non_si", "non-SI")):
        v = numbers[key]
        lines.append(f"DSI >= {name} in {v['share_dsi_ge'][0]:.1%} .. {v['share_dsi_ge'][1]:.1%} of cells (faster "
                     f"{v['faster']:.1%}, within noise {v['tied']:.1%}, slower {v['slower']:.1%}; 95% paired intervals)")
    lines.append(f"DSI speedup: at least {numbers['min_dsi_speedup_over_si']:.3f}x over SI, at least "
                 f"{numbers['min_dsi_speedup_over_non_si']:.3f}x over non-SI, up to "
                 f"{numbers['max_dsi_speedup_over_best_baseline']:.2f}x over the better of the two (means)")
    if numbers["cells_where_dsi_loses"]:
        lines.append(f"DSI's mean is slower in {numbers['cells_where_dsi_loses']} cell(s); in "
                     f"{numbers['of_those_servers_short']} of them its best lookahead needs more target servers "
                     "than there are")
    return "\n".join(lines)
