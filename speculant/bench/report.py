"""What a bench run shows: a terminal table, a markdown report and PNG plots."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from speculant.bench.summary import MethodSummary

COLUMNS = ("method", "tok/s", "speedup (95% CI)", "median speedup", "decode tok/s", "decode speedup (95% CI)",
           "mean accepted length", "acceptance", "SWI", "identical to ar", "TTFT s")


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _with_interval(value: float | None, interval: tuple[float, float] | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else "")


def _share(value: float | None) -> str:
    """A share as a percentage, never rounded up to 100% (one output in 250 unlike ar's reads 99.6%)."""
    if value is None:
        return "-"
    return "100%" if value == 1 else f"{math.floor(value * 1000) / 10:.1f}%"


def _cells(s: MethodSummary) -> tuple[str, ...]:
    return (s.method, f"{s.tokens_per_s:.2f}", _with_interval(s.speedup, s.speedup_ci95),
            _fmt(s.median_speedup, "{:.2f}x"), f"{s.decode_tokens_per_s:.2f}",
            _with_interval(s.decode_speedup, s.decode_speedup_ci95), _fmt(s.mean_accepted_length, "{:.2f}"),
            _fmt(s.acceptance_rate, "{:.0%}"), _fmt(s.swi, "{:.2f}"), _share(s.identical_to_ar),
            f"{s.ttft_s:.2f}")


def markdown_table(summaries: list[MethodSummary]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(_cells(s)) + " |" for s in summaries]
    return "\n".join(lines)


def print_table(summaries: list[MethodSummary], title: str, console: Console | None = None) -> None:
    table = Table(title=title)
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right",  # a long label folds, never cut short
                         overflow="fold" if i == 0 else "ellipsis")
    for s in summaries:
        table.add_row(*_cells(s))
    console = console or Console()
    if not console.is_terminal:  # a pipe or a file: do not wrap method names at 80 columns
        console.width = 200
    console.print(table)


def markdown_report(summaries: list[MethodSummary], by_category: dict[str, list[MethodSummary]],
                    command: str, machine: str, baseline: str | None = None,
                    drafters: dict[str, str] | None = None) -> str:
    """The run's report: its command and machine, the drafters each method ran (`drafters`: by method label, as its
    `default` resolved for the target), its table overall and per category, and what the columns mean."""
    ran = "; ".join(f"`{label}`: {names}" for label, names in (drafters or {}).items())
    parts = [f"# speculant bench\n\nCommand: `{command}`\n\nMachine: {machine}\n"
             + (f"\nDrafters: {ran}\n" if ran else ""), markdown_table(summaries)]
    for category, summary in by_category.items():
        parts.append(f"\n## {category}\n\n{markdown_table(summary)}")
    over = f"`{baseline}` of the same run" if baseline else \
        "the same run's first `ar` that samples as the method does, on its target weights where one ran (else " \
        "its first `ar`)"
    parts.append(f"\nspeedup = total tokens / total time (whole requests, prefill included) over {over}, with a "
                 "95% bootstrap interval over prompts (a prompt's repeats resampled together; none over a single "
                 "prompt); median speedup = median of the ratios per prompt and repeat; decode = after the first "
                 "token: tokens after the first "
                 "over time after TTFT; mean accepted length = tokens committed per target "
                 "verification; SWI = standardized wall-time improvement, tokens / (target forwards + sum of drafter "
                 "forwards x c), c = a drafter's measured forward time over the target's (CS Drafting, section 5); "
                 "identical to ar = share of prompts whose output equals that of an `ar` on the same target weights "
                 "that samples alike (\"-\" where the run has none; when sampling, outputs of one distribution, "
                 "not of one draw, so a low share is expected: the distribution is what the tests check); \"-\" marks "
                 "what was not measured.")
    return "\n".join(parts) + "\n"


PLOTS = ("speedup.png", "acceptance.png", "categories.png")  # what `plot` writes


def plot(summaries: list[MethodSummary], by_category: dict[str, list[MethodSummary]], out: Path,
         baseline: str | None = None) -> list[Path]:
    """speedup.png (the methods with a speedup over `baseline`, as `summarize` took it; none where no method has
    one), acceptance.png (where a method drafted) and (with categories) categories.png under `out`; a plot this run
    has nothing for is removed, not left from an earlier run beside this one's report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = [s.method for s in summaries]
    if sped := [s for s in summaries if s.speedup is not None]:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(sped)), 4))
        below = [s.speedup - s.speedup_ci95[0] if s.speedup_ci95 else 0.0 for s in sped]  # (the 95% interval)
        above = [s.speedup_ci95[1] - s.speedup if s.speedup_ci95 else 0.0 for s in sped]
        ax.bar(range(len(sped)), [s.speedup for s in sped], yerr=[below, above], capsize=3, color="tab:blue")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(sped)), [s.method for s in sped], rotation=30, ha="right", fontsize=8)
        # (without a baseline each method's is its own ar: that of its sampling, on its weights where one ran)
        ax.set_ylabel(f"speedup over {baseline or 'its ar'} (same run, 95% CI)")
        ax.set_title("Speedup per method")
        fig.tight_layout()
        paths.append(out / "speedup.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    if drafted := [s for s in summaries if s.acceptance_per_position]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for s in drafted:
            positions = range(1, len(s.acceptance_per_position) + 1)
            ax.plot(positions, s.acceptance_per_position, marker="o", label=s.method)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance (given the position was reached)")
        ax.set_ylim(0, 1.05)
        ax.set_title("Acceptance per draft position")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "acceptance.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    if by_category:
        categories = list(by_category)
        width = 0.8 / len(names)
        fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(categories)), 4))
        for i, name in enumerate(names):
            values = [next(s.tokens_per_s for s in by_category[c] if s.method == name) for c in categories]
            ax.bar([c + i * width for c in range(len(categories))], values, width, label=name)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories, rotation=20, ha="right")
        ax.set_ylabel("tokens/s")
        ax.set_title("Tokens/s per category")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "categories.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    for name in PLOTS:
        if out / name not in paths:
            (out / name).unlink(missing_ok=True)
    return paths
