"""The offline simulators against exact cases, the theory and the DSI theorems; the simulate CLI."""

import json

import numpy as np
import pytest
from helpers import best_of

from speculant import cli
from speculant import theory
from speculant.analysis.online import simulate_online
from speculant.analysis.simulate import (draws, dsi_bound, first_wrong, paired, paper_axes, simulate_dsi,
                                         simulate_grid, simulate_non_si, simulate_si, summary)

RNG = np.random.default_rng


def one(a: float, repeats: int, n: int, seed: int = 0):
    """Draws for one acceptance rate and the per-repeat index arrays."""
    return draws(RNG(seed), np.array([a]), repeats, n), np.arange(repeats)


def test_exact_extremes():
    n, c, k = 50, 0.2, 4
    # Nothing accepted: SI's prefill gives the first token, then SI pays its drafts and one target forward per
    # token, drafting no more than remains.
    expected = 1 + sum(min(k, left - 1) * c + 1 for left in range(1, n))
    wrong, r = one(0.0, 1, n)
    assert simulate_si(wrong, r, 0, c, k, n)[0] == pytest.approx(expected)
    # ... while DSI pays exactly the target alone, every draft's rejection costing one forward.
    assert simulate_dsi(wrong, r, 0, c, k, 7, n)[0] == pytest.approx(n)
    # Everything accepted: after the prefill SI commits k + 1 tokens per iteration (the last 3 + 1), 39 drafts
    # and 11 target forwards; DSI with servers to spare pays only drafts plus one check; one server that cannot
    # keep up (it needs ceil(1 / (k c)) = 2) makes DSI wait on it, though it still beats SI, whose drafter and
    # target take turns.
    wrong, r = one(1.0, 1, n)
    assert simulate_si(wrong, r, 0, c, k, n)[0] == pytest.approx(11 + 39 * c)
    assert simulate_dsi(wrong, r, 0, c, k, 7, n)[0] == pytest.approx((n - 1) * c + 1)
    assert simulate_si(wrong, r, 0, 0.5, 1, n)[0] > simulate_dsi(wrong, r, 0, 0.5, 1, 1, n)[0] > \
        simulate_dsi(wrong, r, 0, 0.5, 1, 2, n)[0] == pytest.approx((n - 1) * 0.5 + 1)
    assert simulate_non_si(n, 1.0, 3.0) == n + 2


def test_si_simulation_matches_closed_form():
    """The prefill's token, then n - 1 tokens at E[tokens] per iteration of k drafts and one forward."""
    a, c, k, n = 0.7, 0.1, 5, 400
    wrong, r = one(a, 4000, n, seed=1)
    samples = simulate_si(wrong, r, 0, c, k, n, 1.0, 3.0)
    expected = 3 + (n - 1) / theory.sd_expected_tokens(a, k) * (k * c + 1)
    assert samples.mean() == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_si_simulation_costs_what_the_engine_runs(acceptance):
    """SI as `decoding.speculative` runs it: on the very draws its drafter made, the simulated latency is the
    engine's target forwards (its prefill checking no draft) plus c per drafted token, to the draft."""
    from speculant.config import SamplingConfig
    from speculant.decoding.dsi.twin import OracleLM, SyntheticDrafter
    from speculant.decoding.speculative import speculative
    from speculant.analysis.online import run

    n, k, c, prompt = 40, 4, 0.125, [5, 6, 7]
    for seed in range(3):
        drafter = SyntheticDrafter(OracleLM(100, 1), acceptance, 0.0, seed=seed)
        _, stats = run(speculative(OracleLM(100, 1), drafter, prompt, k, n, SamplingConfig(), None))
        wrong = first_wrong(np.array(drafter.wrong(len(prompt), n + 1))[None, None])
        engine = stats.target_forwards + c * sum(stats.draft_lengths)
        assert simulate_si(wrong, np.array([0]), 0, c, k, n)[0] == pytest.approx(engine)


def test_dsi_with_lookahead_one_meets_proposition_1_after_the_prefill():
    """Proposition 1 (lookahead 1, enough servers): t1 per accepted and t2 per rejected token. The engine
    prefills the prompt on every server first, checking no draft, so the proposition bounds the tokens after
    the prefill's: on every draw (`dsi_bound`), and in expectation (`theory.dsi_time_bound` with t_first). The
    drafts made during the prefill save no more than its time."""
    for a in (0.3, 0.6, 0.9):
        for first in (1.0, 0.0, 4.0):
            wrong, r = one(a, 3000, 100, seed=2)
            samples = simulate_dsi(wrong, r, 0, 0.25, 1, 7, 100, 1.0, first)
            assert (samples <= dsi_bound(wrong, r, 0, 0.25, 100, 1.0, first) + 1e-9).all()
            bound, noise = theory.dsi_time_bound(0.25, 1.0, a, 100, first), 3 * samples.std() / np.sqrt(len(samples))
            assert bound - first - noise <= samples.mean() <= bound + noise


def test_the_servers_appendix_d_asks_for_are_enough_at_any_acceptance():
    """With ceil(T / (k c)) servers no job waits for a server, so Proposition 1's bound holds after the prefill at
    acceptance 1 too: the drafter runs (k + 1)(N + 1) drafts ahead (`theory.drafts_ahead`), as each job commits
    k + 1 positions. At acceptance 1 the drafts made during the prefill make DSI as fast as the paper's bound."""
    for a, c in ((1.0, 0.05), (0.9, 0.05), (1.0, 0.2)):
        wrong, r = one(a, 300, 100, seed=3)
        samples = simulate_dsi(wrong, r, 0, c, 1, theory.servers_needed(1.0, c, 1), 100)
        assert (samples <= dsi_bound(wrong, r, 0, c, 100) + 1e-9).all()
        if a == 1:
            assert samples.mean() == pytest.approx(theory.dsi_time_bound(c, 1.0, a, 100))


def test_a_job_waits_for_k_new_drafts():
    """A job goes when k drafts wait that no job carries yet (or the drafter waits), as the engine's `dispatch`
    counts them. One server, k = 1, acceptance 1, c = 0.03, 8 tokens: the prefill commits token 0 at 1, drafts 0 .. 3
    made meanwhile (4 ahead) go at once and commit 1 .. 4 at 2 (4 drafted at 1.03). Nothing new is drafted then,
    so no job goes on the bare prefix (with one server, pipelined SI): the draft at 5 comes at 2.03 and its job
    commits 5 and 6 at 3.03, the last token's (the drafter done) 7 at 4.03. Counting the position the target
    predicts as a draft sent that bare-prefix job at 2."""
    wrong, r = one(1.0, 1, 8)
    assert simulate_dsi(wrong, r, 0, 0.03, 1, 1, 8)[0] == pytest.approx(4.03)


def test_dsi_simulation_agrees_with_the_latency_twin():
    """The event simulation follows the engine: the twin's measured DSI wall time (pure mode, real threads)
    lies close to the simulated one for the same configuration and the same per-position draws, so only the
    engine's overheads part them (the best of three tries under load)."""
    def close(result):
        return result["dsi_ms"] == pytest.approx(result["offline_dsi_ms"], rel=0.3)  # the twin pays thread overheads

    assert close(best_of(3, lambda: simulate_online(20, 2, 0.8, servers=5, tokens=30, repeats=3), close))


def test_latencies_equal_but_for_rounding_are_a_tie():
    """DSI on one server at lookahead 1 runs as SI does where every draft is wrong: the same latency, summed in
    another order, is a tie for the paired interval, not DSI slower or faster."""
    wrong, r = one(0.02, 10, 100)
    si, dsi = simulate_si(wrong, r, 0, 0.3, 1, 100), simulate_dsi(wrong, r, 0, 0.3, 1, 1, 100)
    assert np.allclose(si, dsi, rtol=1e-12)
    low, high = paired(si[None], dsi[None])
    assert low[0] == high[0] == 0
    in_one_order, in_another = np.full((1, 10), 0.1 + 0.2 + 0.3), np.full((1, 10), 0.3 + 0.2 + 0.1)  # 1 ulp apart
    low, high = paired(in_one_order, in_another)
    assert low[0] == high[0] == 0


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
    # One server cannot keep up with a fast drafter and runs no job on the bare prefix (it would make the drafts
    # wait): where the drafter is often wrong DSI is slower than non-SI, in cells whose best lookahead needs more
    # servers, or where the drafter costs a target forward (Appendix D asks for one server there; Theorem 1's job
    # on the bare prefix needs a second).
    grid = simulate_grid(c, a, np.array([1, 2, 4, 8, 16]), 60, 6, servers=1)
    lone, dsi, short = summary(grid), grid.best_dsi(), grid.servers_short()
    loses = (grid.best_si() < dsi) | (grid.non_si < dsi)
    assert lone["cells_where_dsi_loses"] == loses.sum() > 0 and lone["of_those_servers_short"] == (loses & short).sum()
    assert not (loses & ~short)[grid.c < 1].any() and (loses & ~short)[grid.c == 1].any()


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


@pytest.mark.parametrize("argv, message", [(["--acceptance", "1.5"], "--acceptance must lie in [0, 1]"),
                                           (["--repeats", "1"], "--repeats must be >= 2, got 1"),
                                           (["--lookahead", "0"], "--lookahead must be >= 1, got 0")])
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
    assert code == 0 and "needs 15 target server(s)" in out
    assert "Proposition 1 bounds lookahead 1 on >= 15 servers only" in out  # it does not hold on 1
    cli.main(["simulate", "run", "--target-latency", "30", "--drafter-latency", "2", "--acceptance", "0.8",
              "--lookahead", "4", "--servers", "7"])
    assert "Proposition 1 bounds lookahead 1 on >= 15 servers only" in capsys.readouterr().out


@pytest.mark.parametrize("ttft", [None, "0", "300"])
@pytest.mark.parametrize("acceptance", ["0.3", "0.9", "1"])
def test_the_printed_proposition_1_bound_holds_for_what_is_simulated(acceptance, ttft, capsys):
    """`simulate run`'s Proposition 1 bound counts the prefill every server runs before a draft can be checked:
    the simulated DSI never exceeds it on its draws, and its mean lies within noise of the expected bound."""
    argv = ["simulate", "run", "--target-latency", "30", "--drafter-latency", "2", "--acceptance", acceptance,
            "--lookahead", "1", "--servers", "15", "--json", *(["--ttft", ttft] if ttft else [])]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    bound = result["theory"]
    assert result["dsi_ms"] <= bound["dsi_bound_ms"] + 1e-6
    assert result["dsi_ms"] <= bound["dsi_bound_expected_ms"] + 2 * result["dsi_ci95_ms"] + 1e-6
    cli.main(argv[:-1] if not ttft else argv[:-3])
    assert "Proposition 1 bound" in capsys.readouterr().out


def test_si_theory_drafts_no_more_than_fit_and_takes_a_zero_ttft(capsys):
    """The SI theory beside the simulation: the prefill's token, then iterations of no more drafts than can still
    be emitted (tokens - 2 after the prefill), and a TTFT of 0 is 0, not 'not given'."""
    base = ["simulate", "run", "--target-latency", "30", "--drafter-latency", "6", "--acceptance", "1", "--json"]
    cli.main([*base, "--lookahead", "1024", "--tokens", "50"])
    result = json.loads(capsys.readouterr().out)
    assert result["si_ms"] == pytest.approx(30 + 48 * 6 + 30) == pytest.approx(result["theory"]["si_expected_ms"])
    cli.main([*base, "--lookahead", "4", "--tokens", "51", "--ttft", "0"])
    result = json.loads(capsys.readouterr().out)
    assert result["si_ms"] == pytest.approx(10 * (4 * 6 + 30)) == pytest.approx(result["theory"]["si_expected_ms"])


def test_si_theory_is_exact_where_the_last_iterations_draft_fewer(capsys):
    """Near the end an iteration drafts only what can still be emitted: the theory counts each such iteration, so
    the simulated mean lies within its noise of it (k drafts every iteration would say 520 ms here)."""
    base = ["simulate", "run", "--target-latency", "30", "--drafter-latency", "6", "--json"]
    cli.main([*base, "--acceptance", "0.8", "--lookahead", "16", "--tokens", "20", "--repeats", "4000"])
    result = json.loads(capsys.readouterr().out)
    assert abs(result["si_ms"] - result["theory"]["si_expected_ms"]) < 3 * result["si_ci95_ms"]
    cli.main([*base, "--acceptance", "0.5", "--lookahead", "5", "--tokens", "3"])  # one draft, then one more token
    assert json.loads(capsys.readouterr().out)["theory"]["si_expected_ms"] == pytest.approx(30 + 36 + 0.5 * 30)


def test_a_zero_ttft_is_kept_beside_a_target_profile(tmp_path, capsys):
    from speculant.latency import LatencyProfile

    profile = tmp_path / "target.json"
    LatencyProfile("t", "", "cpu", 256, 0.5, 0.03, {1: 0.03}).save(profile)
    base = ["simulate", "run", "--target-profile", str(profile), "--drafter-latency", "6", "--acceptance", "0.8",
            "--lookahead", "2", "--tokens", "11", "--repeats", "2", "--json"]
    assert cli.main(base) == 0 and json.loads(capsys.readouterr().out)["non_si_ms"] == pytest.approx(500 + 10 * 30)
    assert cli.main([*base, "--ttft", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["non_si_ms"] == pytest.approx(300)


@pytest.mark.parametrize("argv, message", [
    (["run", "--target-latency", "30", "--drafter-latency", "2", "--acceptance", "0.8", "--lookahead", "1",
      "--servers", "1024", "--repeats", "1000000", "--tokens", "10"], "repeats x tokens x servers"),
    (["heatmap", "--ndim", "100", "--servers", "1024"], "cells x tokens x servers"),
])
def test_a_simulation_too_large_for_its_servers_is_refused_up_front(argv, message, tmp_path, capsys, monkeypatch):
    """Its servers' state and events grow with the servers: the size checks count them, before any work."""
    from speculant.analysis import commands

    def work(*args, **kwargs):
        raise AssertionError("a simulation this large began")

    monkeypatch.setattr(commands, "draws", work)
    monkeypatch.setattr(commands, "simulate_grid", work)
    out = tmp_path / "heatmap"
    code = cli.main(["simulate", *argv, *(["--out", str(out)] if argv[0] == "heatmap" else [])])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("speculant: error: a ") and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_online_refuses_a_drafter_of_no_latency_before_running(capsys):
    code = cli.main(["simulate", "online", "--target-latency", "30", "--drafter-latency", "0", "--acceptance", "0.8",
                     "--servers", "2", "--tokens", "5", "--repeats", "1"])
    assert code == 2 and capsys.readouterr().err == "speculant: error: drafter latencies must be > 0 ms, got 0\n"


def test_online_methods_see_the_same_draws(monkeypatch):
    """Every method's drafter in a repeat draws the same acceptances per position, so SI, SI at its best k and DSI
    are compared on the same draws (paired); repeats draw anew."""
    from speculant.analysis import online

    made = []

    class Recorded(online.SyntheticDrafter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.latency_s > 0:  # (not the servers' warm-up run)
                made.append(self)

    monkeypatch.setattr(online, "SyntheticDrafter", Recorded)
    simulate_online(4, 1, 0.5, servers=2, tokens=8, repeats=2)
    assert len(made) == 6  # SI, SI at its best k and DSI, per repeat
    drawn = [tuple(d.wrong(0, 64)) for d in made]
    assert len(set(drawn[:3])) == len(set(drawn[3:])) == 1 and drawn[0] != drawn[3]


def test_heatmap_cells_sit_on_the_uneven_grid_points():
    """Each cell's colour is its grid point's, and spans what lies nearer that point than any other (the paper's
    axes are uneven: 0.01, 0.25, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import QuadMesh

    from speculant.analysis.heatmap import _panel

    c, a = paper_axes(4)
    grid = simulate_grid(c, a, np.array([1, 2]), 10, 2, servers=2)
    values = 2.0 ** np.linspace(-1, 1, c.size * a.size).reshape(c.size, a.size)
    fig, ax = plt.subplots()
    _panel(ax, values, grid, "", fig)
    (mesh,) = [m for m in ax.collections if isinstance(m, QuadMesh)]
    edges = mesh.get_coordinates()  # [C + 1, A + 1, 2] corners (a, c)
    np.testing.assert_allclose(edges[0, 1:-1, 0], (a[:-1] + a[1:]) / 2)
    np.testing.assert_allclose(edges[1:-1, 0, 1], (c[:-1] + c[1:]) / 2)
    np.testing.assert_allclose(np.asarray(mesh.get_array()).reshape(values.shape), np.log2(values))
    plt.close(fig)


def test_heatmap_command_writes_data_and_figures(tmp_path, capsys):
    code = cli.main(["simulate", "heatmap", "--out", str(tmp_path), "--ndim", "4", "--lookaheads", "1,2,5,10",
                     "--tokens", "30", "--repeats", "3"])
    printed = capsys.readouterr()
    assert code == 0 and "DSI speedup" in printed.out and "DSI >= SI in" in printed.out
    assert "simulating the grid" in printed.err and "/5 [" in printed.err  # (a bar of 5 rows: the grid ran silent)
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
    assert "--ndim must be >= 2, got 1" in capsys.readouterr().err


def test_simulate_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys; from speculant import cli; "
            "rc = cli.main(['simulate', 'run', '--target-latency', '30', '--drafter-latency', '3', "
            "'--acceptance', '0.7', '--lookahead', '4', '--servers', '3', '--repeats', '50']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
