"""The offline simulators against exact cases, the theory and the DSI theorems; the simulate CLI."""

import json

import numpy as np
import pytest

from speculant import cli
from speculant import theory
from speculant.analysis.simulate import simulate_dsi, simulate_grid, simulate_non_si, simulate_si, summary

RNG = np.random.default_rng


def test_exact_extremes():
    n, c, k = 50, 0.2, 4
    # Nothing accepted: SI pays its drafts and one target forward per token, drafting no more than remains.
    expected = sum(min(k, left - 1) * c + 1 for left in range(1, n + 1))
    assert simulate_si(np.array([0.0]), c, k, n, RNG(0))[0] == pytest.approx(expected)
    # Everything accepted: SI commits k + 1 tokens per iteration.
    assert simulate_si(np.array([1.0]), c, k, n, RNG(0))[0] == pytest.approx(10 * (k * c + 1))
    # DSI never pays more than the target alone, and with all drafts accepted only drafts plus one check.
    assert simulate_dsi(np.array([0.0]), c, k, n, RNG(0))[0] == pytest.approx(n)
    assert simulate_dsi(np.array([1.0]), c, k, n, RNG(0))[0] == pytest.approx((n - 1) * c + 1)
    assert simulate_non_si(n, 1.0, 3.0) == n + 2


def test_si_simulation_matches_closed_form():
    a, c, k, n = 0.7, 0.1, 5, 400
    samples = simulate_si(np.full(4000, a), c, k, n, RNG(1))
    expected = n / theory.sd_expected_tokens(a, k) * (k * c + 1)
    assert samples.mean() == pytest.approx(expected, rel=0.02)


def test_dsi_with_lookahead_one_meets_proposition_1():
    for a in (0.3, 0.6, 0.9):
        samples = simulate_dsi(np.full(3000, a), 0.2, 1, 100, RNG(2))
        bound = theory.dsi_time_bound(0.2, 1.0, a, 100)
        assert samples.mean() <= bound + 3 * samples.std() / np.sqrt(len(samples))


def test_grid_obeys_the_theorems_and_reproduces_the_paper_summary():
    grid = simulate_grid(np.linspace(0.01, 1, 8), np.linspace(0, 1, 8), np.arange(1, 41), 60, 3)
    numbers = summary(grid)
    assert numbers["min_dsi_speedup_over_si"] >= 1.0 - 1e-9  # Theorem 2
    assert numbers["min_dsi_speedup_over_non_si"] >= 1.0 - 1e-9  # Theorem 1
    assert 0.2 < numbers["si_slower_than_non_si_share"] < 0.8  # SI is slower than non-SI in a large region
    assert numbers["max_dsi_speedup_over_best_baseline"] > 1.2
    assert not grid.feasible[0, 0, 0] and grid.feasible[-1, 0, 0]  # fast drafters need more servers


def test_appendix_f3_example_via_cli(capsys):
    code = cli.main(["simulate", "run", "--target-latency", "30", "--drafter-latency", "6", "--acceptance", "0.6",
                     "--lookahead", "5", "--servers", "1", "--tokens", "100", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["non_si_ms"] == 3000
    assert result["dsi_ms"] < result["si_ms"] < result["non_si_ms"]
    assert result["si_ms"] == pytest.approx(result["theory"]["si_expected_ms"], rel=0.03)


@pytest.mark.parametrize("argv", [
    ["--acceptance", "1.5"], ["--servers", "1", "--lookahead", "1"], ["--lookahead", "0"]])
def test_simulate_run_bad_input(argv, capsys):
    base = {"--target-latency": "30", "--drafter-latency": "2", "--acceptance": "0.8", "--lookahead": "5",
            "--servers": "7"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    code = cli.main(["simulate", "run", *[x for item in base.items() for x in item]])
    assert code == 2 and "speculant: error" in capsys.readouterr().err


def test_heatmap_command_writes_data_and_figures(tmp_path, capsys):
    code = cli.main(["simulate", "heatmap", "--out", str(tmp_path), "--ndim", "4", "--max-lookahead", "10",
                     "--tokens", "30", "--repeats", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "DSI speedup" in out
    rows = (tmp_path / "grid.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 * 4 * 10
    for name in ("figure2.png", "figure7.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "summary.json").read_text())["min_dsi_speedup_over_si"] >= 1.0 - 1e-9


def test_simulate_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys; from speculant import cli; "
            "rc = cli.main(['simulate', 'run', '--target-latency', '30', '--drafter-latency', '3', "
            "'--acceptance', '0.7', '--lookahead', '4', '--servers', '3', '--repeats', '50']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
