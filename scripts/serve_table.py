"""Print a README serving table from `speculant bench-serve` results (results.jsonl), so its numbers are not typed
by hand.

    python scripts/serve_table.py docs/results/serve-1.5b-http-paired/5-with-llama-server/results.jsonl \\
        --servers llama-server ar auto --over llama-server --bold auto
    python scripts/serve_table.py docs/results/serve-0.5b/results.jsonl --value tok/s ttft
    python scripts/serve_table.py docs/results/serve-conversations/results.jsonl --value tok/s ttft-first ttft-later

One row per server label (bench-serve's --label), one column per concurrency (or open-loop arrival rate) and value; with --over, the ratio of
each server's tok/s to that server's at the same concurrency, in the same run. Passes labelled "warm..." are left
out; where a label has several passes at one concurrency, their mean (tok/s) or median (latencies) is shown.
Pure Python (json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

VALUES = {"tok/s": ("tok/s", lambda r: r["throughput_tok_s"]),
          "ttft": ("TTFT p50 s", lambda r: r["ttft_ms"]["p50"] / 1000),
          "ttft-first": ("first turns' TTFT p50 s", lambda r: r["ttft_first_turn_ms"]["p50"] / 1000),
          "ttft-later": ("later turns' TTFT p50 s", lambda r: r["ttft_later_turns_ms"]["p50"] / 1000),
          "tpot": ("TPOT p50 ms", lambda r: r["tpot_ms"]["p50"]),
          "itl": ("ITL p50 ms", lambda r: r["itl_ms"]["p50"])}  # (runs since ITL is counted by chunk)


def arrivals(r: dict) -> tuple[str, float]:
    """A pass's column: its concurrency (closed loop) or its conversations' arrival rate (open loop)."""
    return ("C", r["concurrency"]) if r.get("rate") is None else ("rate", r["rate"])


def heading(key: tuple[str, float]) -> str:
    return f"C = {key[1]}" if key[0] == "C" else f"{key[1]:g} conversations/s"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="bench-serve results.jsonl files")
    parser.add_argument("--servers", nargs="+", help="labels, one row each, in this order (default: all)")
    parser.add_argument("--concurrency", nargs="+", type=int, help="columns (default: every concurrency, ascending)")
    parser.add_argument("--value", nargs="+", default=["tok/s"], choices=list(VALUES))
    parser.add_argument("--over", help="a label: add each row's tok/s over its tok/s at the same concurrency")
    parser.add_argument("--bold", nargs="*", default=[], help="labels whose tok/s print in bold")
    args = parser.parse_args(argv)
    passes = defaultdict(list)
    for path in args.files:
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                r["label"] = r.get("label") or r["url"]  # (files of older versions: no label given, none written)
                if not r["label"].startswith("warm"):
                    passes[r["label"], arrivals(r)].append(r)
    servers = args.servers or list(dict.fromkeys(label for label, _ in passes))
    concurrency = [("C", c) for c in args.concurrency] if args.concurrency else sorted({c for _, c in passes})

    def value(label: str, c: tuple[str, float], name: str) -> float | None:
        rows = passes.get((label, c))
        if not rows:
            return None
        values = [VALUES[name][1](r) for r in rows]
        return statistics.mean(values) if name == "tok/s" else statistics.median(values)

    headers = [f"{heading(c)}, {VALUES[v][0]}" if len(args.value) > 1 else heading(c) for c in concurrency
               for v in args.value]
    if args.over:
        headers += [f"over `{args.over}`, {heading(c)}" for c in concurrency]
    unit = VALUES[args.value[0]][0] if len(args.value) == 1 else ""
    print(f"| server{', ' + unit if unit else ''} | " + " | ".join(headers) + " |")
    print("|---|" + "---:|" * len(headers))
    for label in servers:
        cells = []
        for c in concurrency:
            for v in args.value:
                x = value(label, c, v)
                text = "-" if x is None else f"{x:.2f}" if v.startswith("ttft") else f"{x:.1f}"
                cells.append(f"**{text}**" if label in args.bold and v == "tok/s" and x is not None else text)
        if args.over:
            for c in concurrency:
                mine, theirs = value(label, c, "tok/s"), value(args.over, c, "tok/s")
                cells.append("-" if mine is None or not theirs else f"{mine / theirs:.2f}x")
        print(f"| `{label}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
