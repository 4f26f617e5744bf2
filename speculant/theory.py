"""Closed-form results of the speculative inference papers, as pure functions.

Notation: `a` is the per-token acceptance rate (i.i.d. acceptance), `k` the lookahead (draft length),
`c` the drafter's cost as a fraction of the target's forward, latencies in any one unit.
"""

from __future__ import annotations

import math


def sd_expected_tokens(a: float, k: int) -> float:
    """Expected tokens per SD iteration, (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, Eq. 1)."""
    _check_rate(a)
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def sd_walltime_improvement(a: float, k: int, c: float) -> float:
    """Expected wall-time improvement of SD over autoregressive decoding,
    (1 - a^(k+1)) / ((1 - a)(c k + 1)) (Leviathan et al. 2023, Theorem 3.8)."""
    return sd_expected_tokens(a, k) / (c * k + 1)


def sd_operations_factor(a: float, k: int, c_ops: float) -> float:
    """Expected factor of arithmetic operations over autoregressive decoding,
    (1 - a)(k c_ops + k + 1) / (1 - a^(k+1)), with c_ops the drafter/target operations ratio
    (Leviathan et al. 2023, Theorem 3.11)."""
    return (k * c_ops + k + 1) / sd_expected_tokens(a, k)


def sd_tokens_limit(a: float) -> float:
    """The most tokens per iteration any lookahead can give, 1 / (1 - a) (the Amdahl-style bound the
    DSI paper uses: acceptance 0.8 caps speculation at 5x)."""
    _check_rate(a)
    return math.inf if a == 1 else 1 / (1 - a)


def si_expected_time(t_target: float, t_drafter: float, k: int, mean_accepted: float, n_tokens: int) -> float:
    """Expected latency of speculative inference (SI) for `n_tokens` when each iteration drafts k
    tokens and accepts `mean_accepted` of them on average, plus one target token (DSI paper,
    Appendix F.3: 30 ms target, 6 ms drafter, k = 5, 1.5 accepted -> 2400 ms for 100 tokens).

    This is the paper's SI, whose first target forward already verifies k drafts; speculant's engine
    (`decoding.speculative`, simulated by `analysis.simulate.simulate_si`) prefills the prompt first and
    drafts after its token."""
    iterations = n_tokens / (mean_accepted + 1)
    return iterations * (k * t_drafter + t_target)


def non_si_time(t_target: float, n_tokens: int) -> float:
    """Autoregressive decoding: one target forward per token."""
    return n_tokens * t_target


def dsi_time_bound(t_drafter: float, t_target: float, a: float, n_tokens: int, t_first: float | None = None) -> float:
    """DSI Proposition 1: expected latency at most t1 a (N - 1) + t2 ((1 - a)(N - 1) + 1), with t1 the
    drafter and t2 the target latency (Timor et al. 2025), versus t2 N without speculation. It assumes
    lookahead 1 and target servers enough that no job waits for one (`servers_needed`).

    With `t_first`, the first target forward is a prefill that takes t_first and checks no draft, as
    speculant's engine runs DSI (every server prefills the prompt before a draft can be checked): the first
    token costs t_first and the proposition bounds the other N - 1,
    t_first + t1 a (N - 2) + t2 ((1 - a)(N - 2) + 1)."""
    _check_rate(a)
    if t_first is not None:
        return t_first + (dsi_time_bound(t_drafter, t_target, a, n_tokens - 1) if n_tokens > 1 else 0.0)
    return t_drafter * a * (n_tokens - 1) + t_target * ((1 - a) * (n_tokens - 1) + 1)


def servers_needed(t_target: float, t_drafter: float, k: int) -> int:
    """Target servers for a job never to wait for a server: ceil(t_target / (k t_drafter)) (DSI, Appendix D:
    a job of k drafts is ready every k t_drafter and holds a server for t_target). With fewer, jobs queue and
    verification falls behind drafting."""
    return math.ceil(t_target / (k * t_drafter) - 1e-12)


def drafts_ahead(lookahead: int, servers: int) -> int:
    """How far DSI's drafter runs ahead of the committed tokens: (k + 1)(N + 1). N jobs in flight, each of k
    drafts that commit k + 1 positions where all agree (the target's own token after them), and the job being
    drafted; with less, at high acceptance the drafter waits on verification even with `servers_needed` servers
    (Proposition 1's bound is then not met), and drafts further ahead would wait for a server anyway."""
    return (lookahead + 1) * (servers + 1)


def min_lookahead(t_target: float, t_drafter: float, servers: int) -> int:
    """The smallest lookahead for which `servers` target servers suffice (DSI, Appendix D)."""
    if servers < 1:
        raise ValueError("at least one target server is needed")
    return max(1, math.ceil(t_target / (servers * t_drafter) - 1e-12))


def swi(new_tokens: int, target_forwards: int, drafter_forwards: dict[str, int], costs: dict[str, float]) -> float:
    """Standardized wall-time improvement, n / (count(target) + sum_i count(drafter_i) c_i) (CS Drafting,
    section 5): speedup over autoregressive decoding if every forward cost what the ratios c_i say
    (from parameter counts or measured latencies; a drafter missing from `costs`, like Max-Gram, is free)."""
    cost = target_forwards + sum(count * costs.get(name, 0.0) for name, count in drafter_forwards.items())
    return new_tokens / cost if cost > 0 else 0.0


def sd_pgf(x: float, a: float, k: int) -> float:
    """Probability generating function E[x^T] of the tokens T one SD step yields (drafts accepted
    plus the target's token): phi(x) = 1 + (x - 1)(1 - a^(k+1) x^(k+1)) / (1 - a x) (CS Drafting, section 4)."""
    _check_rate(a)
    if a * x == 1:
        return 1 + (x - 1) * (k + 1)
    return 1 + (x - 1) * (1 - (a * x) ** (k + 1)) / (1 - a * x)


def vertical_cascade_improvement(a: float, a_inner: float, k_inner: int, reviews: int, c: float,
                                 c_inner: float) -> float:
    """Expected wall-time improvement of a vertical cascade (CS Drafting, Theorem 4.3).

    The drafter (cost c) does not generate: it runs `reviews` review steps of k_inner tokens from a
    smaller drafter (cost c_inner, acceptance a_inner against it), each yielding T tokens with
    E[x^T] = phi(x); the target (acceptance a against the drafter) reviews the resulting draft of
    sum T tokens. All T tokens survive the target with probability E[a^T] = phi(a) per review step,
    so a target step yields (1 - a phi(a)^reviews) / (1 - a) tokens for 1 + reviews (c + k_inner c_inner)."""
    _check_rate(a)
    if a == 1:  # every drafted token is accepted: 1 + reviews E[T], E[T] = phi'(1)
        tokens = 1 + reviews * sd_expected_tokens(a_inner, k_inner)
    else:
        tokens = (1 - a * sd_pgf(a, a_inner, k_inner) ** reviews) / (1 - a)
    return tokens / (1 + reviews * (c + k_inner * c_inner))


def horizontal_cascade_improvement(rates: list[float], ks: list[int], costs: list[float]) -> float:
    """Expected wall-time improvement of a horizontal cascade (CS Drafting, Theorem 4.5): drafter i
    (acceptance rates[i] against the target, cost costs[i]) drafts the next ks[i] positions. Position j
    is accepted with the product of the rates up to it, so a target step yields
    1 + sum_i (prod_{h<i} a_h^{k_h}) a_i (1 - a_i^{k_i}) / (1 - a_i) tokens for 1 + sum_i k_i c_i."""
    tokens, reach = 1.0, 1.0  # reach: probability that every earlier position was accepted
    for a, k in zip(rates, ks, strict=True):
        _check_rate(a)
        tokens += reach * (a * k if a == 1 else a * (1 - a**k) / (1 - a))
        reach *= a**k
    return tokens / (1 + sum(k * c for k, c in zip(ks, costs, strict=True)))


def _check_rate(a: float) -> None:
    if not 0 <= a <= 1:
        raise ValueError(f"an acceptance rate lies in [0, 1], got {a}")
