"""Print a README results table from `speculant bench` result directories, so no README number is typed by hand.

    python scripts/readme_table.py docs/results/bench-core-mixed --methods ar auto --baseline llamacpp-cli-ar
    python scripts/readme_table.py docs/results/bench-core-mixed docs/results/bench-core-humaneval \\
        --methods ar auto --baseline llamacpp-cli-ar --bold auto --source

Each directory given is one column group (named after its prompt set, or by --names); each method one row;
the cells are speedups over --baseline measured in the same run, with the 95% bootstrap interval over prompts
that `speculant bench` reports. --by-category prints one row per method and one column per prompt category.

Where the run's own baseline is the one asked for, the numbers are the run's summary as `results.json` stores it
(what its report.md shows). For another baseline of the same run they are recomputed from the run's rows the way
`speculant.bench.summary` computes them (total tokens over total time, the same seeded bootstrap over prompts).
A directory that keeps only its report.md (its results.json removed from the tree; git keeps it) is read from
the report's tables: its own baseline then, or ratios of its point estimates for another.

Pure Python (json, argparse, random, and speculant.bench.bootstrap, which imports no torch): no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from speculant.bench.bootstrap import ratio_interval

COLUMNS = {  # name -> (header, what it shows)
    "whole": ("whole", "speedup over whole requests (prefill included), 95% CI"),
    "decode": ("decode", "speedup after the first token, 95% CI"),
    "median": ("median", "median of per-prompt ratios (whole requests)"),
    "toks": ("tok/s", "tokens per second over whole requests"),
    "decode-toks": ("decode tok/s", "tokens per second after the first token"),
    "accepted": ("mean accepted", "tokens committed per target verification"),
    "acceptance": ("acceptance", "share of drafted tokens accepted"),
    "identical": ("identical to `ar`", "share of outputs equal to ar's on the same weights"),
    "ttft": ("TTFT s", "mean time to first token"),
}


@dataclass
class Cell:
    """What one method measured in one run (or one category of it), over one baseline."""

    method: str
    tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    speedup: float | None = None
    speedup_ci95: tuple[float, float] | None = None
    median_speedup: float | None = None
    decode_speedup: float | None = None
    decode_speedup_ci95: tuple[float, float] | None = None
    mean_accepted_length: float | None = None
    acceptance_rate: float | None = None
    identical_to_ar: float | None = None
    ttft_s: float | None = None


@dataclass
class Run:
    path: Path
    command: str
    machine: str
    baseline: str | None  # the run's own baseline label (None: its first `ar`)
    name: str  # the prompt set, for a column group's header
    summary: dict[str, Cell]
    by_category: dict[str, dict[str, Cell]]
    rows: list[dict] | None = None  # the generations, where results.json is in the tree
    methods: list[str] = field(default_factory=list)


def _set_name(config: dict) -> str:
    prompts = config.get("prompts")
    if prompts:
        return Path(prompts).stem
    dataset = config.get("dataset") or "?"
    return dataset.replace("humaneval", "HumanEval")


def _cell(s: dict) -> Cell:
    ci = lambda v: tuple(v) if v else None  # noqa: E731
    return Cell(s["method"], s.get("tokens_per_s"), s.get("decode_tokens_per_s"), s.get("speedup"),
                ci(s.get("speedup_ci95")), s.get("median_speedup"), s.get("decode_speedup"),
                ci(s.get("decode_speedup_ci95")), s.get("mean_accepted_length"), s.get("acceptance_rate"),
                s.get("identical_to_ar"), s.get("ttft_s"))


def _from_json(path: Path) -> Run:
    data = json.loads((path / "results.json").read_text())
    config = data["config"]
    summary = {s["method"]: _cell(s) for s in data["summary"]}
    by_category = {c: {s["method"]: _cell(s) for s in rows} for c, rows in data.get("by_category", {}).items()}
    return Run(path, config.get("command", ""), config.get("machine", ""), config.get("baseline"), _set_name(config),
               summary, by_category, data["rows"], [s["method"] for s in data["summary"]])


_NUMBER = re.compile(r"^([0-9.]+)(x|%)?(?: \(([0-9.]+)-([0-9.]+)\))?$")


def _parse(text: str) -> tuple[float | None, tuple[float, float] | None]:
    match = _NUMBER.match(text.strip().strip("*"))
    if not match:
        return None, None
    value = float(match[1]) / (100 if match[2] == "%" else 1)
    return value, (float(match[3]), float(match[4])) if match[3] else None


def _table(lines: list[str]) -> dict[str, Cell]:
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    cells = {}
    for line in lines[2:]:
        values = dict(zip(header, (v.strip() for v in line.strip().strip("|").split("|"))))
        get = lambda key: _parse(values.get(key, "-"))  # noqa: E731
        cell = Cell(values["method"])
        cell.tokens_per_s, _ = get("tok/s")
        cell.decode_tokens_per_s, _ = get("decode tok/s")
        cell.speedup, cell.speedup_ci95 = get("speedup (95% CI)")
        if cell.speedup is None:
            cell.speedup, _ = get("speedup")
        cell.median_speedup, _ = get("median speedup")
        cell.decode_speedup, cell.decode_speedup_ci95 = get("decode speedup (95% CI)")
        cell.mean_accepted_length, _ = get("mean accepted length")
        cell.acceptance_rate, _ = get("acceptance")
        cell.identical_to_ar, _ = get("identical to ar")
        cell.ttft_s, _ = get("TTFT s")
        cells[cell.method] = cell
    return cells


def _from_report(path: Path) -> Run:
    text = (path / "report.md").read_text()
    command = re.search(r"^Command: `(.*)`$", text, re.M)
    machine = re.search(r"^Machine: (.*)$", text, re.M)
    over = re.search(r"over `([^`]+)` of the same run", text)
    tables, current, section = {}, [], None
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
            continue
        if current:
            tables[section] = _table(current)
            current = []
        if line.startswith("## "):
            section = line[3:].strip()
    command_text = command[1] if command else ""
    dataset = re.search(r"--dataset (\S+)", command_text)
    prompts = re.search(r"--prompts (\S+)", command_text)
    name = _set_name({"prompts": prompts[1] if prompts else None, "dataset": dataset[1] if dataset else None})
    summary = tables.pop(None, {})
    return Run(path, command_text, machine[1] if machine else "", over[1] if over else None, name, summary, tables,
               None, list(summary))


def load(path: Path) -> Run:
    if (path / "results.json").exists():
        return _from_json(path)
    if (path / "report.md").exists():
        return _from_report(path)
    raise SystemExit(f"{path}: neither results.json nor report.md")


# The rates and the interval below are speculant.bench.summary's, on the JSON rows (so a README table over another
# baseline is what `speculant bench --report-from results.json --baseline NAME` would print).

def _rate(rows: list[dict]) -> float:
    seconds = sum(r["stats"]["wall_s"] for r in rows)
    return sum(r["stats"]["new_tokens"] for r in rows) / seconds if seconds else 0.0


def _decode_rate(rows: list[dict]) -> float:
    seconds = sum(max(r["stats"]["wall_s"] - r["stats"]["ttft_s"], 0.0) for r in rows)
    return sum(max(r["stats"]["new_tokens"] - 1, 0) for r in rows) / seconds if seconds else 0.0


def _speed(row: dict) -> float:
    return row["stats"]["new_tokens"] / row["stats"]["wall_s"] if row["stats"]["wall_s"] > 0 else 0.0


def rebased(run: Run, cells: dict[str, Cell], baseline: str, category: str | None) -> dict[str, Cell]:
    """`cells` (a run's summary or one category's) over another method of the same run."""
    if baseline not in cells:
        raise SystemExit(f"{run.path}: no method {baseline!r} (it has {', '.join(cells)})")
    out = {}
    if run.rows is None:  # a report only: ratios of its point estimates, no interval
        base = cells[baseline]
        for name, c in cells.items():
            ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
            out[name] = Cell(**{**c.__dict__, "speedup": ratio(c.speedup, base.speedup), "speedup_ci95": None,
                                "median_speedup": None, "decode_speedup": ratio(c.decode_speedup, base.decode_speedup),
                                "decode_speedup_ci95": None})
        return out
    rows = [r for r in run.rows if category is None or r["category"] == category]
    base_rows = [r for r in rows if r["method"] == baseline]
    base_by_key = {(r["prompt_id"], r["repeat"]): r for r in base_rows}
    for name, c in cells.items():
        mine = [r for r in rows if r["method"] == name]
        new = Cell(**c.__dict__)
        if _rate(base_rows):
            new.speedup = _rate(mine) / _rate(base_rows)
            new.speedup_ci95 = ratio_interval(mine, base_rows, _rate, lambda r: r["prompt_id"])
            new.median_speedup = statistics.median(_speed(r) / _speed(base_by_key[r["prompt_id"], r["repeat"]])
                                                   for r in mine)
        if _decode_rate(base_rows):
            new.decode_speedup = _decode_rate(mine) / _decode_rate(base_rows)
            new.decode_speedup_ci95 = ratio_interval(mine, base_rows, _decode_rate, lambda r: r["prompt_id"])
        out[name] = new
    return out


def over(run: Run, baseline: str | None, category: str | None = None) -> dict[str, Cell]:
    cells = run.summary if category is None else run.by_category[category]
    if baseline is None or baseline == run.baseline:
        return cells
    return rebased(run, cells, baseline, category)


def _x(value: float | None, ci: tuple[float, float] | None, bold: bool, intervals: bool) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}x"
    text = f"**{text}**" if bold else text
    return text + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci and intervals else "")


def cell_text(c: Cell, column: str, bold: bool, intervals: bool) -> str:
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return {
        "whole": lambda: _x(c.speedup, c.speedup_ci95, bold, intervals),
        "decode": lambda: _x(c.decode_speedup, c.decode_speedup_ci95, bold, intervals),
        "median": lambda: _x(c.median_speedup, None, bold, intervals),
        "toks": lambda: num(c.tokens_per_s, ".2f"),
        "decode-toks": lambda: num(c.decode_tokens_per_s, ".2f"),
        "accepted": lambda: num(c.mean_accepted_length, ".2f"),
        "acceptance": lambda: pct(c.acceptance_rate),
        "identical": lambda: pct(c.identical_to_ar),
        "ttft": lambda: num(c.ttft_s, ".2f"),
    }[column]()


def _commit(path: Path) -> str:
    try:
        out = subprocess.run(["git", "log", "--format=%h", "-1", "--", str(path)], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent.parent, check=False)
        return out.stdout.strip()
    except OSError:
        return ""


def _label(method: str) -> str:
    return f"`{method}`"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="bench result directories (results.json or report.md)")
    parser.add_argument("--methods", nargs="+", help="method labels, one row each, in this order (default: all but "
                                                     "the baseline)")
    parser.add_argument("--baseline", help="the method the speedups are over (default: each run's own)")
    parser.add_argument("--columns", nargs="+", default=["whole", "decode"], choices=list(COLUMNS),
                        help="cells per directory: " + "; ".join(f"{k}: {v[1]}" for k, v in COLUMNS.items())
                        .replace("%", "%%"))
    parser.add_argument("--names", nargs="+", help="column-group names, one per directory (default: the prompt set)")
    parser.add_argument("--by-category", action="store_true",
                        help="one column per prompt category of the first directory (its first --columns entry)")
    parser.add_argument("--bold", nargs="*", default=[], help="methods whose speedups print in bold")
    parser.add_argument("--no-intervals", action="store_true", help="leave the 95%% intervals out")
    parser.add_argument("--rows-only", action="store_true", help="print the rows without the header")
    parser.add_argument("--source", action="store_true",
                        help="after the table, each directory's command, machine and last commit")
    args = parser.parse_args(argv)

    runs = [load(path) for path in args.dirs]
    names = args.names or [run.name for run in runs]
    if len(names) != len(runs):
        raise SystemExit("--names needs one name per directory")
    baseline = args.baseline
    methods = args.methods or [m for m in runs[0].methods if m != (baseline or runs[0].baseline)]
    intervals = not args.no_intervals
    title = f"over `{baseline or runs[0].baseline or 'ar'}`"
    lines = []
    if args.by_category:
        run, column = runs[0], args.columns[0]
        categories = list(run.by_category)
        if not categories:
            raise SystemExit(f"{run.path}: no categories")
        tables = {c: over(run, baseline, c) for c in categories}
        whole = over(run, baseline)
        lines.append(f"| {COLUMNS[column][0]} {title} | {names[0]} | " + " | ".join(categories) + " |")
        lines.append("|---|" + "---:|" * (len(categories) + 1))
        for m in methods:
            cells = [cell_text(whole[m], column, m in args.bold, intervals)]
            cells += [cell_text(tables[c][m], column, m in args.bold, False) for c in categories]
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    else:
        tables = [over(run, baseline) for run in runs]
        headers = [f"{name}, {COLUMNS[c][0]}" for name in names for c in args.columns]
        lines.append(f"| {title} | " + " | ".join(headers) + " |")
        lines.append("|---|" + "---:|" * len(headers))
        for m in methods:
            cells = []
            for run, table in zip(runs, tables):
                if m not in table:
                    raise SystemExit(f"{run.path}: no method {m!r} (it has {', '.join(table)})")
                cells += [cell_text(table[m], c, m in args.bold, intervals) for c in args.columns]
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    print("\n".join(lines[2:] if args.rows_only else lines))
    if args.source:
        print()
        for run in runs:
            commit = _commit(run.path)
            print(f"- `{run.path}`" + (f" (commit {commit})" if commit else "") + f": `{run.command}`; {run.machine}")


if __name__ == "__main__":
    main(sys.argv[1:])
