"""The offline simulators against exact cases, the theory and the DSI theorems; the simulate CLI."""

import json

import numpy as np
import pytest
from helpers import best_of

from speculant import cli
from speculant import theory
from speculant.analysis.online import simulate_online
from speculant.analysis.simulate import (draws, paper_axes, simulate_dsi, simulate_grid, simulate_non_si, simulate_si,
                                         summary)

RNG = np.random.default_rng


def one(a: float, repeats: int, n: int, seed: int = 0):
    """Draws for one acceptance rate and the per-repeat index arrays."""
    return draws(RNG(seed), np.array([a]), repeats, n), np.arange(repeats)


def test_exact_extremes():
    n, c, k = 50, 0.2, 4
    # Nothing accepted: SI pays its drafts and one target forward per token, drafting no more than remains.
    expected = sum(min(k, left - 1) * c + 1 for left in range(1, n + 1))
    wrong, r = one(0.0, 1, n)
    assert simulate_si(wrong, r, 0, c, k, n)[0] == pytest.approx(expected)
    # ... while DSI pays exactly the target alone, every draft's rejection costing one forward.
    assert simulate_dsi(wrong, r, 0, c, k, 7, n)[0] == pytest.approx(n)
    # Everything accepted: SI commits k + 1 tokens per iteration; DSI with servers to spare pays only drafts
    # plus one check; one server that cannot keep up (it needs ceil(1 / (k c)) = 2) makes DSI wait on it, though
    # it still beats SI, whose drafter and target take turns.
    wrong, r = one(1.0, 1, n)
    assert simulate_si(wrong, r, 0, c, k, n)[0] == pytest.approx(10 * (k * c + 1))
    assert simulate_dsi(wrong, r, 0, c, k, 7, n)[0] == pytest.approx((n - 1) * c + 1)
    assert simulate_si(wrong, r, 0, 0.5, 1, n)[0] > simulate_dsi(wrong, r, 0, 0.5, 1, 1, n)[0] > \
        simulate_dsi(wrong, r, 0, 0.5, 1, 2, n)[0] == pytest.approx((n - 1) * 0.5 + 1)
    assert simulate_non_si(n, 1.0, 3.0) == n + 2


def test_si_simulation_matches_closed_form():
    a, c, k, n = 0.7, 0.1, 5, 400
    wrong, r = one(a, 4000, n, seed=1)
    samples = simulate_si(wrong, r, 0, c, k, n)
    expected = n / theory.sd_expected_tokens(a, k) * (k * c + 1)
    assert samples.mean() == pytest.approx(expected, rel=0.02)


def test_dsi_with_lookahead_one_meets_proposition_1_up_to_the_prefill():
    """Proposition 1 (lookahead 1, enough servers): t1 per accepted and t2 per rejected token. The engine
    prefills the prompt on every server first, so the drafts made meanwhile wait one forward longer than the
    proposition assumes: at most one target forward more, and within that of the bound."""
    for a in (0.3, 0.6, 0.9):
        wrong, r = one(a, 3000, 100, seed=2)
        samples = simulate_dsi(wrong, r, 0, 0.25, 1, 7, 100)
        bound = theory.dsi_time_bound(0.25, 1.0, a, 100)
        assert bound - 0.3 <= samples.mean() <= bound + 1 + 3 * samples.std() / np.sqrt(len(samples))


def test_the_servers_appendix_d_asks_for_are_enough_at_any_acceptance():
    """With ceil(T / (k c)) servers the drafter never waits on verification, so Proposition 1's bound holds up to the
    prefill at acceptance 1 too: the drafter runs (k + 1)(N + 1) drafts ahead (`theory.drafts_ahead`), as each job
    commits k + 1 positions."""
    for a, c in ((1.0, 0.05), (0.9, 0.05), (1.0, 0.2)):
        wrong, r = one(a, 300, 100, seed=3)
        samples = simulate_dsi(wrong, r, 0, c, 1, theory.servers_needed(1.0, c, 1), 100)
        bound = theory.dsi_time_bound(c, 1.0, a, 100)
        assert samples.mean() == pytest.approx(bound) if a == 1 else samples.mean() <= bound + 1


def test_dsi_simulation_agrees_with_the_latency_twin():
    """The event simulation follows the engine: the twin's measured DSI wall time (pure mode, real threads)
    lies close to the simulated one for the same configuration and the same per-position draws, so only the
    engine's overheads part them (the best of three tries under load)."""
    def close(result):
        return result["dsi_ms"] == pytest.approx(result["offline_dsi_ms"], rel=0.3)  # the twin pays thread overheads

    assert close(best_of(3, lambda: simulate_online(20, 2, 0.8, servers=5, tokens=30, repeats=3), close))


def test_grid_measures_the_theorems_with_intervals_and_explains_losses():
    c, a = paper_axes(6)
    grid = simulate_grid(c, a, np.array([1, 2, 4, 8, 16]), 60, 6, servers=2)
    numbers = summary(grid)
    for key in ("dsi_vs_si", "dsi_vs_non_si"):
        low, high = numbers[key]["share_dsi_ge"]
        assert 0 <= low <= high <= 1 and numbers[key]["faster"] + numbers[key]["tied"] == pytest.approx(high)
    assert numbers["dsi_vs_non_si"]["share_dsi_ge"][1] > 0.9 and numbers["dsi_vs_si"]["share_dsi_ge"][1] > 0.8
    assert 0.2 < numbers["si_slower_than_non_si_share"] < 0.8  # SI is slower than non-SI in a large region
    assert numbers["max_dsi_speedup_over_best_baseline"] > 1.2
    # One server cannot keep up with a fast drafter: DSI is simulated slower than SI in some cells, each of
    # them one where its best lookahead needs more servers.
    lone = summary(simulate_grid(c, a, np.array([1, 2, 4, 8, 16]), 60, 6, servers=1))
    assert lone["cells_where_dsi_loses"] > 0 and lone["of_those_servers_short"] == lone["cells_where_dsi_loses"]


def test_appendix_f3_example_via_cli(capsys):
    code = cli.main(["simulate", "run", "--target-latency", "30", "--drafter-latency", "6", "--acceptance", "0.6",
                     "--lookahead", "5", "--servers", "1", "--tokens", "100", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["non_si_ms"] == 3000
    assert result["dsi_ms"] < result["si_ms"] < result["non_si_ms"]
    assert result["si_ms"] == pytest.approx(result["theory"]["si_expected_ms"], rel=0.03)
    cli.main(["simulate", "run", "--target-latency", "30", "--drafter-latency", "6", "--acceptance", "0.6",
              "--lookahead", "5", "--tokens", "100", "--ttft", "1000", "--json"])
    slow_start = json.loads(capsys.readouterr().out)  # the first forward's 970 ms more, in the theory too
    assert slow_start["si_ms"] == pytest.approx(slow_start["theory"]["si_expected_ms"], rel=0.03)


@pytest.mark.parametrize("argv, message", [(["--acceptance", "1.5"], "acceptance must lie in [0, 1]"),
                                           (["--repeats", "1"], "repeats must be >= 2, got 1"),
                                           (["--lookahead", "0"], "lookahead must be >= 1, got 0")])
def test_simulate_run_bad_input(argv, message, capsys):
    base = {"--target-latency": "30", "--drafter-latency": "2", "--acceptance": "0.8", "--lookahead": "5",
            "--servers": "7"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    code = cli.main(["simulate", "run", *[x for item in base.items() for x in item]])
    assert code == 2 and f"speculant: error: {message}" in capsys.readouterr().err


def test_servers_that_cannot_keep_up_are_simulated_and_said(capsys):
    code = cli.main(["simulate", "run", "--target-latency", "30", "--drafter-latency", "2", "--acceptance", "0.8",
                     "--lookahead", "1", "--servers", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "needs 15 target server(s)" in out and "Proposition 1 bound" in out
    cli.main(["simulate", "run", "--target-latency", "30", "--drafter-latency", "2", "--acceptance", "0.8",
              "--lookahead", "4", "--servers", "7"])
    assert "Proposition 1 bounds lookahead 1 only" in capsys.readouterr().out


def test_heatmap_command_writes_data_and_figures(tmp_path, capsys):
    code = cli.main(["simulate", "heatmap", "--out", str(tmp_path), "--ndim", "4", "--lookaheads", "1,2,5,10",
                     "--tokens", "30", "--repeats", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "DSI speedup" in out and "DSI >= SI in" in out
    rows = (tmp_path / "grid.csv").read_text().splitlines()
    assert len(rows) == 1 + 5 * 5 * 4  # the paper's axes at ndim 4: c in {0.01, .25, .5, .75, 1}, a up to 0.99
    for name in ("figure2.png", "figure7.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    shares = json.loads((tmp_path / "summary.json").read_text())["dsi_vs_si"]["share_dsi_ge"]
    assert 0 <= shares[0] <= shares[1] <= 1
    assert cli.main(["simulate", "heatmap", "--out", str(tmp_path), "--lookaheads", "1,x"]) == 2
    assert cli.main(["simulate", "heatmap", "--out", str(tmp_path), "--lookaheads", "1,2"]) == 2
    assert "the fixed lookahead 5 (Figure 7's) must be among the lookaheads 1,2" in capsys.readouterr().err
    assert cli.main(["simulate", "heatmap", "--out", str(tmp_path), "--ndim", "1"]) == 2
    assert "ndim must be >= 2, got 1" in capsys.readouterr().err


def test_simulate_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys; from speculant import cli; "
            "rc = cli.main(['simulate', 'run', '--target-latency', '30', '--drafter-latency', '3', "
            "'--acceptance', '0.7', '--lookahead', '4', '--servers', '3', '--repeats', '50']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
