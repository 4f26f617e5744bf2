"""Closed forms against the papers' worked examples and a Monte-Carlo run of the same process."""

import numpy as np
import pytest

from speculant.analysis import theory


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
    assert theory.max_useful_sp_degree(1.0, 0.05) == 20


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
