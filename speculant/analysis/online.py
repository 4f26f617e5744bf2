"""`speculant simulate online`: the latency twin in pure mode, the DSI paper's online experiment run
through the real decoders. Non-SI (autoregressive), SI (speculative decoding) and DSI (the engine,
over real thread/process/Ray servers) generate the same tokens from an `OracleLM` target with a
`SyntheticDrafter` of i.i.d. acceptance, every forward padded to the given latencies; wall times are
measured, all in one run, and every output is checked against non-SI's."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from speculant.analysis.simulate import MOST_LOOKAHEAD, first_wrong, simulate_dsi
from speculant.theory import sd_walltime_improvement
from speculant.config import MOST_SERVERS, SamplingConfig, check_ray_address
from speculant.decoding.autoregressive import autoregressive
from speculant.decoding.dsi.engine import dsi
from speculant.decoding.dsi.executors import ServerSpec, make_executor
from speculant.decoding.dsi.plan import plan
from speculant.decoding.dsi.timeline import plot_timeline
from speculant.decoding.dsi.twin import Latency, OracleLM, PaddedModel, SyntheticDrafter
from speculant.decoding.run import Decoder, timed
from speculant.decoding.speculative import speculative
from speculant.decoding.stats import GenerationStats
from speculant.errors import ConfigError, SpeculantError

VOCAB = 1000


def oracle(device: str, seed: int = 0) -> OracleLM:
    """A picklable server factory for pure mode."""
    return OracleLM(VOCAB, seed)


def run(decoder: Decoder) -> tuple[list[int], GenerationStats]:
    tokens: list[int] = []
    stream = timed(decoder, tokens)
    while True:
        try:
            next(stream)
        except StopIteration as stop:
            return tokens, stop.value


def best_si_lookahead(acceptance: float, c: float, limit: int = 32) -> int:
    """The k that maximises SD's expected wall-time improvement (Leviathan et al., Theorem 3.8)."""
    return max(range(1, limit + 1), key=lambda k: sd_walltime_improvement(acceptance, k, c))


MOST_ONLINE_TOKENS = 100_000  # what the twin generates in all (its servers are real threads or processes)


def simulate_online(target_ms: float, drafter_ms: float, acceptance: float, servers: int, tokens: int = 50,
                    lookahead: int | None = None, ttft_ms: float | None = None, repeats: int = 5,
                    executor: str = "thread", seed: int = 0, timeline: Path | None = None,
                    ray_address: str | None = None, more_drafters: tuple[tuple[float, float], ...] = ()
                    ) -> dict[str, Any]:
    """Mean wall times (ms) of non-SI, SI (at DSI's lookahead and at its own best k) and DSI over
    `repeats` prompts, measured in this run, every method's drafter drawing the same acceptances per position
    in a repeat (a paired comparison); beside them the offline simulator's DSI time on the very draws
    the twin's DSI runs were decided by (the drafter draws per position, as the simulator does), so the two
    differ by the engine's own overheads only.

    `more_drafters` ((ms, acceptance), costlier ones) adds DSI with each of them alone (at its own planned
    lookahead, or at `lookahead` where one is given) and DSI with all drafters together (Algorithm 1 with m > 2
    models, at the first one's lookahead), and the latter's gain over the best single drafter."""
    lineup = ((drafter_ms, acceptance), *more_drafters)
    for _, a in lineup:
        if not 0 <= a <= 1:
            raise ConfigError(f"acceptance must lie in [0, 1], got {a}")
    if any(ms <= 0 for ms, _ in lineup):  # the offline simulation beside the twin's DSI needs a drafter's cost
        raise ConfigError(f"drafter latencies must be > 0 ms, got {', '.join(f'{ms:g}' for ms, _ in lineup)}")
    costs = [ms for ms, _ in lineup]
    for before, ms in zip(costs, costs[1:]):  # (Algorithm 1's drafters come in increasing cost: a cheaper one leads)
        if ms < before:
            raise ConfigError(f"more_drafter {ms:g} ms: each is costlier than the drafter before it ({before:g} ms)")
    if tokens < 2:
        raise ConfigError(f"tokens must be >= 2, got {tokens}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    check_ray_address(ray_address, "ray_address")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    if servers > MOST_SERVERS or tokens * repeats > MOST_ONLINE_TOKENS:
        raise ConfigError(f"the twin runs at most {MOST_SERVERS} servers (each a thread or process) and "
                          f"{MOST_ONLINE_TOKENS} tokens in all (repeats x tokens)")
    if lookahead is not None and lookahead > MOST_LOOKAHEAD:  # (the offline simulation beside it is that wide)
        raise ConfigError(f"lookahead must be at most {MOST_LOOKAHEAD}, got {lookahead}")
    chosen = plan(servers, lookahead, target_ms / 1000, drafter_ms / 1000)
    target_latency = Latency.from_ms(target_ms, ttft_ms)
    greedy = SamplingConfig()
    si_best = best_si_lookahead(acceptance, drafter_ms / target_ms)
    spec = ServerSpec(partial(oracle, seed=seed), ["cpu"] * servers, greedy, target_latency)
    alone = [plan(servers, lookahead, target_ms / 1000, ms / 1000).lookahead for ms, _ in more_drafters]
    pool = make_executor(executor, spec, ray_address)
    pool.start()
    names = ["dsi", *(f"dsi_drafter_{d + 1}" for d in range(len(more_drafters)))] + (["dsi_all"] if more_drafters else [])
    times: dict[str, list[float]] = {"non_si": [], "si": [], "si_best": [], **{name: [] for name in names}}
    identical = True
    stats = None
    wrong: list[list[bool]] = []  # per repeat, per position: whether the DSI drafter's draft was wrong
    try:
        rng = random.Random(seed)
        warm = [rng.randrange(VOCAB) for _ in range(8)]  # servers start (processes, Ray) before timing
        run(dsi(pool, SyntheticDrafter(OracleLM(VOCAB, seed), acceptance, 0.0), warm, 4, chosen.lookahead, greedy,
                None, frozenset(), close_executor=False))
        for r in range(repeats):
            prompt = [rng.randrange(VOCAB) for _ in range(8)]

            def target() -> PaddedModel:
                return PaddedModel(OracleLM(VOCAB, seed), target_latency)

            def drafter(which: int = 0) -> SyntheticDrafter:
                """Drafter `which` of this repeat, afresh: one seed per repeat and drafter whatever the method, so
                every method is decided by the same per-position draws (a paired comparison)."""
                ms, a = lineup[which]
                return SyntheticDrafter(OracleLM(VOCAB, seed), a, ms / 1000,
                                        (seed * MOST_ONLINE_TOKENS + r) * len(lineup) + which)

            reference, s = run(autoregressive(target(), prompt, tokens, greedy, None))
            times["non_si"].append(s.wall_s)
            for name, k in (("si", chosen.lookahead), ("si_best", si_best)):
                out, s = run(speculative(target(), drafter(), prompt, k, tokens, greedy, None))
                times[name].append(s.wall_s)
                identical &= out == reference
            first = drafter()
            runs = [("dsi", [first], chosen.lookahead),
                    *((f"dsi_drafter_{d}", [drafter(d)], alone[d - 1]) for d in range(1, len(lineup)))]
            if more_drafters:
                runs.append(("dsi_all", [drafter(d) for d in range(len(lineup))], chosen.lookahead))
            for name, drafters, k in runs:
                out, stats = run(dsi(pool, drafters, prompt, tokens, k, greedy, None, frozenset(), close_executor=False))
                times[name].append(stats.wall_s)
                identical &= out == reference
            wrong.append(first.wrong(len(prompt), tokens + 1))
    finally:
        pool.close()
    if not identical:
        raise SpeculantError("an output differed from non-SI's: this is a bug, please report it")
    mean = {name: 1000 * sum(values) / len(values) for name, values in times.items()}
    offline = simulate_dsi(first_wrong(np.array(wrong)[:, None]), np.arange(repeats), 0, drafter_ms / target_ms,
                           chosen.lookahead, servers, tokens, 1.0, None if ttft_ms is None else ttft_ms / target_ms)
    result = {
        "target_ms": target_ms, "drafter_ms": drafter_ms, "acceptance": acceptance, "servers": servers,
        "lookahead": chosen.lookahead, "si_best_lookahead": si_best, "tokens": tokens, "repeats": repeats,
        "executor": executor, "identical_outputs": identical,
        **{f"{name}_ms": value for name, value in mean.items()},
        "dsi_speedup_over_si": mean["si"] / mean["dsi"],
        "dsi_speedup_over_best_si": mean["si_best"] / mean["dsi"],
        "dsi_speedup_over_non_si": mean["non_si"] / mean["dsi"],
        "offline_dsi_ms": float(offline.mean()) * target_ms,
    }
    if more_drafters:
        singles = [mean[name] for name in names[:-1]]
        result.update({"more_drafters": [list(d) for d in more_drafters], "lookaheads_alone": alone,
                       "dsi_all_gain_over_best_single": min(singles) / mean["dsi_all"]})
    if timeline is not None and stats is not None and stats.dsi is not None:
        result["timeline"] = str(plot_timeline(stats.dsi, timeline))
    return result


def format_online(r: dict[str, Any]) -> str:
    return (f"target {r['target_ms']:g} ms, drafter {r['drafter_ms']:g} ms, acceptance {r['acceptance']:g}, "
            f"{r['servers']} target server(s) ({r['executor']}), lookahead {r['lookahead']}, {r['tokens']} tokens, "
            f"mean of {r['repeats']} (outputs identical: {r['identical_outputs']})\n"
            f"  non-SI {r['non_si_ms']:.0f} ms | SI k={r['lookahead']} {r['si_ms']:.0f} ms | "
            f"SI k={r['si_best_lookahead']} (its best) {r['si_best_ms']:.0f} ms | DSI {r['dsi_ms']:.0f} ms "
            f"(offline simulator on the same draws: {r['offline_dsi_ms']:.0f} ms)\n"
            f"  DSI speedup: {r['dsi_speedup_over_si']:.2f}x over SI at the same lookahead, "
            f"{r['dsi_speedup_over_best_si']:.2f}x over SI at its best, {r['dsi_speedup_over_non_si']:.2f}x over non-SI"
            + "".join(f"\n  DSI with drafter {d + 1} alone ({ms:g} ms, acceptance {a:g}, lookahead {k}): "
                      f"{r[f'dsi_drafter_{d + 1}_ms']:.0f} ms" for d, ((ms, a), k) in
                      enumerate(zip(r.get("more_drafters", []), r.get("lookaheads_alone", []))))
            + (f"\n  DSI with all drafters: {r['dsi_all_ms']:.0f} ms, {r['dsi_all_gain_over_best_single']:.2f}x over "
               "the best single drafter" if "dsi_all_ms" in r else ""))
