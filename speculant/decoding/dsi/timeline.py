"""A DSI run as a picture: each drafter and each target server as rows, forwards as bars (a preempted
forward cut short inside the model hatched), rejections as red lines (like Figure 1 of the DSI paper)."""

from __future__ import annotations

from pathlib import Path

from speculant.decoding.dsi.record import DSIRecord

COLORS = {"kept": "#4c72b0", "discarded": "#a6bddb", "used": "#55a868", "preempted": "#c44e52",
          "redundant": "#bbbbbb"}


def plot_timeline(record: DSIRecord, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, drafters = len(record.servers), len(record.drafters)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * (rows + drafters)))
    for outcome, color in COLORS.items():
        for row in range(-drafters, rows):
            for cut in (False, True):
                bars = [(b.start * 1000, (b.end - b.start) * 1000) for b in record.bars
                        if b.row == row and b.outcome == outcome and b.cut_short == cut]
                if bars:
                    ax.broken_barh(bars, (rows - 1 - row - 0.4, 0.8), facecolors=color, edgecolors="white",
                                   linewidth=0.3, hatch="////" if cut else None)
        ax.bar(0, 0, color=color, label=outcome)  # legend entry
    ax.bar(0, 0, color=COLORS["preempted"], hatch="////", edgecolor="white", label="cut short")
    for seconds, _ in record.rejections:
        ax.axvline(seconds * 1000, color="#c44e52", linewidth=0.6, alpha=0.6)
    labels = [f"server {i}" + (" (in process)" if record.fallback and i == rows - 1 else "") for i in range(rows)]
    names = [f"drafter {d}: {name}" if drafters > 1 else "drafter" for d, name in enumerate(record.drafters)]
    ax.set_yticks(range(rows + drafters), [*labels[::-1], *names])  # row r at height rows - 1 - r
    ax.set_xlabel("ms since start")
    ax.set_title(f"DSI timeline ({record.executor}, lookahead {record.lookahead}); red lines: rejections")
    ax.legend(loc="upper right", fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=path.suffix.lstrip(".").lower() or "png")  # (no suffix: a PNG there, not at .png)
    plt.close(fig)
    return path
