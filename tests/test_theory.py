"""Closed forms against the papers' worked examples and a Monte-Carlo run of the same process."""

import numpy as np
import pytest

from speculant import theory


def test_dsi_appendix_f3_worked_example():
    si = theory.si_expected_time(t_target=30, t_drafter=6, k=5, mean_accepted=1.5, n_tokens=100)
    non_si = theory.non_si_time(30, 100)
    assert si == pytest.approx(2400) and non_si == 3000 and non_si / si == pytest.approx(1.25)


def test_acceptance_08_caps_at_five_tokens():
    assert theory.sd_tokens_limit(0.8) == pytest.approx(5)
    values = [theory.sd_expected_tokens(0.8, k) for k in (1, 5, 20, 200)]
    assert values == sorted(values) and values[0] < values[1] < 5 and values[-1] == pytest.approx(5, abs=1e-9)


def test_lookahead_for_four_servers_at_five_percent_drafter_latency():
    assert theory.min_lookahead(t_target=1.0, t_drafter=0.05, servers=4) == 5
    assert theory.servers_needed(1.0, 0.05, 5) == 4 and theory.servers_needed(1.0, 0.05, 4) == 5
    assert theory.servers_needed(1.0, 0.05, 1) == 20  # (more servers than t_target / t_drafter idle)


def test_sd_expected_tokens_matches_monte_carlo():
    rng = np.random.default_rng(0)
    for a, k in [(0.6, 4), (0.9, 7), (0.3, 2)]:
        accepts = rng.random((200_000, k)) < a
        accepted = np.where(accepts.all(1), k, accepts.argmin(1))  # prefix of acceptances
        assert (accepted + 1).mean() == pytest.approx(theory.sd_expected_tokens(a, k), rel=0.01)


def test_walltime_and_operations_factors():
    assert theory.sd_walltime_improvement(0.8, 4, 0.0) == pytest.approx(theory.sd_expected_tokens(0.8, 4))
    assert theory.sd_walltime_improvement(0.0, 4, 0.5) == pytest.approx(1 / 3)  # all rejected: pure overhead
    assert theory.sd_operations_factor(1.0, 3, 0.0) == pytest.approx(1.0)


def test_dsi_bound_never_exceeds_non_si_for_faster_drafters():
    for a in np.linspace(0, 1, 11):
        assert theory.dsi_time_bound(5, 30, a, 100) <= theory.non_si_time(30, 100) + 1e-9
    assert theory.dsi_time_bound(5, 30, 0.0, 100) == pytest.approx(3000)


def sd_step_tokens(rng, a: float, k: int, size: int) -> np.ndarray:
    """Tokens one SD step yields, simulated: accepted drafts (i.i.d. rate a, at most k) plus one."""
    accepts = rng.random((size, k)) < a
    return np.cumprod(accepts, axis=1).sum(axis=1) + 1


def target_review(rng, a: float, draft_lengths: np.ndarray) -> np.ndarray:
    """Tokens a target step yields on drafts of the given lengths at acceptance a."""
    longest = int(draft_lengths.max())
    accepts = np.cumprod(rng.random((len(draft_lengths), longest)) < a, axis=1)
    accepts[np.arange(longest)[None, :] >= draft_lengths[:, None]] = 0
    return accepts.sum(axis=1) + 1


@pytest.mark.parametrize(("x", "a", "k"), [(0.5, 0.7, 3), (0.9, 0.4, 5), (1.0, 0.8, 2)])
def test_sd_pgf_matches_monte_carlo(x, a, k):
    tokens = sd_step_tokens(np.random.default_rng(1), a, k, 400_000)
    assert theory.sd_pgf(x, a, k) == pytest.approx(np.mean(x**tokens), rel=5e-3)
    assert theory.sd_pgf(1.0, a, k) == 1.0


@pytest.mark.parametrize(("a", "a_inner", "k_inner", "reviews"), [(0.7, 0.8, 3, 1), (0.5, 0.6, 4, 2), (0.9, 0.3, 2, 3)])
def test_vertical_cascade_matches_monte_carlo(a, a_inner, k_inner, reviews):
    rng = np.random.default_rng(2)
    c, c_inner, size = 0.1, 0.01, 200_000
    draft = sum(sd_step_tokens(rng, a_inner, k_inner, size) for _ in range(reviews))
    simulated = target_review(rng, a, draft).mean() / (1 + reviews * (c + k_inner * c_inner))
    closed = theory.vertical_cascade_improvement(a, a_inner, k_inner, reviews, c, c_inner)
    assert closed == pytest.approx(simulated, rel=5e-3)


@pytest.mark.parametrize(("rates", "ks", "costs"), [([0.8, 0.5], [2, 3], [0.1, 0.0]), ([0.9, 0.7, 0.4], [1, 2, 4], [0.2, 0.05, 0.0])])
def test_horizontal_cascade_matches_monte_carlo(rates, ks, costs):
    rng = np.random.default_rng(3)
    per_position = np.repeat(rates, ks)
    accepts = np.cumprod(rng.random((300_000, len(per_position))) < per_position, axis=1)
    simulated = (accepts.sum(axis=1) + 1).mean() / (1 + sum(k * c for k, c in zip(ks, costs)))
    assert theory.horizontal_cascade_improvement(rates, ks, costs) == pytest.approx(simulated, rel=5e-3)
    # One drafter is plain SD (Leviathan et al. Theorem 3.8).
    assert theory.horizontal_cascade_improvement([0.7], [4], [0.1]) == pytest.approx(theory.sd_walltime_improvement(0.7, 4, 0.1))


def test_swi_weighs_drafter_forwards_by_cost():
    assert theory.swi(100, 40, {"small": 120, "maxgram": 0}, {"small": 0.25}) == pytest.approx(100 / (40 + 30))
    assert theory.swi(100, 100, {}, {}) == 1.0


def test_geometric_fit_counts_a_run_the_text_cuts_off_as_censored():
    """Nine texts the drafter matches throughout and one whose only mismatch opens it: 639 matches and one
    rejection give a = 639 / 640, not 0 (the runs a text's end cuts off are censored, not dropped)."""
    from speculant.analysis.acceptance import geometric_fit

    flags = [np.array([False] + [True] * 63)] + [np.ones(64, bool)] * 9
    mean_run, a = geometric_fit(flags)
    assert mean_run == 639 and a == pytest.approx(639 / 640)
    # With i.i.d. matches the fit recovers the rate from short texts (dropping their unfinished runs biased it down).
    rng = np.random.default_rng(0)
    for rate in (0.7, 0.9, 0.97):
        assert geometric_fit([rng.random(32) < rate for _ in range(2000)])[1] == pytest.approx(rate, abs=0.01)
    assert geometric_fit([np.ones(5, bool)]) == (5.0, pytest.approx(5 / 6))  # no mismatch: at least the positions seen
