"""The DSI paper's Figure 2 and Figure 7 from an offline simulation grid: CSV data and PNG heatmaps."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from speculant.analysis.simulate import Grid


def write_csv(grid: Grid, path: Path) -> None:
    """One row per (c, a, k): mean latencies in target forwards over the repeats, and the target servers DSI
    needs to keep up with that lookahead (Appendix D)."""
    si, dsi = grid.si.mean(-1), grid.dsi.mean(-1)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["drafter_latency", "acceptance", "lookahead", "non_si", "si", "dsi", "servers_needed"])
        for i, c in enumerate(grid.c):
            for j, a in enumerate(grid.a):
                for m, k in enumerate(grid.k):
                    writer.writerow([f"{c:.4f}", f"{a:.4f}", int(k), f"{grid.non_si:.4f}", f"{si[i, j, m]:.4f}",
                                     f"{dsi[i, j, m]:.4f}", int(np.ceil(1 / (k * c) - 1e-9))])


def _panel(ax, values: np.ndarray, grid: Grid, title: str, fig) -> None:
    """Speedups on a log2 colour scale centred at 1x: red where slower, green where faster."""
    from matplotlib.colors import Normalize, TwoSlopeNorm
    from matplotlib.ticker import FuncFormatter

    log_speedup = np.log2(values)
    log_speedup[np.abs(log_speedup) < 1e-9] = 0.0  # equal but for rounding (see `simulate.paired`): no line there
    if log_speedup.min() < -1e-9:
        cmap, norm = "RdYlGn", TwoSlopeNorm(vmin=log_speedup.min(), vcenter=0.0, vmax=max(log_speedup.max(), 1e-3))
    else:  # never slower: a one-sided scale starting at 1x
        cmap, norm = "YlGn", Normalize(vmin=0.0, vmax=max(log_speedup.max(), 1e-3))
    # a cell centred on each (a, c) of the grid, whose spacing is uneven (`paper_axes`)
    image = ax.pcolormesh(grid.a, grid.c, log_speedup, shading="nearest", cmap=cmap, norm=norm)
    if log_speedup.min() < 0 < log_speedup.max():
        ax.contour(grid.a, grid.c, log_speedup, levels=[0.0], colors="black", linewidths=0.8)
    ax.set_xlabel("acceptance rate")
    ax.set_ylabel("drafter latency (fraction of target)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="speedup", format=FuncFormatter(lambda x, _: f"{2 ** x:.3g}x"))


def plot_figure2(grid: Grid, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    si, dsi = grid.best_si(), grid.best_dsi()
    panels = [
        (grid.non_si / si, "SI vs non-SI (SI at its best lookahead)"),
        (si / dsi, f"DSI vs SI (DSI with {grid.servers} target server{'s' if grid.servers > 1 else ''})"),
        (grid.non_si / dsi, "DSI vs non-SI"),
        (np.minimum(si, grid.non_si) / dsi, "DSI vs the better of SI and non-SI"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    for ax, (values, title) in zip(axes.flat, panels):
        _panel(ax, values, grid, title, fig)
    fig.suptitle(f"Offline simulation (DSI paper, Figure 2), each at its best lookahead, mean of "
                 f"{grid.si.shape[-1]} repeats; black line: speedup 1")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_figure7(grid: Grid, path: Path, lookahead: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    si, dsi = grid.at_lookahead(lookahead)
    panels = [(grid.non_si / si, "SI vs non-SI"), (si / dsi, "DSI vs SI"), (grid.non_si / dsi, "DSI vs non-SI")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (values, title) in zip(axes, panels):
        _panel(ax, values, grid, f"{title}, lookahead {lookahead}", fig)
    fig.suptitle(f"Offline simulation at a fixed lookahead of {lookahead} (DSI paper, Figure 7)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
