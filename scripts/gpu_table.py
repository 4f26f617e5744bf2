"""Print a table of docs/results/gpu.md (or the README's GPU table) from the JSON that scripts/gpu_static.py writes.

    python scripts/gpu_table.py docs/results/gpu-h200-133a0c1.json                      # the README's
    python scripts/gpu_table.py docs/results/gpu-h200-133a0c1.json --table speculation  # one of gpu.md's

Tables (`--table`), each read from the sections of one lent GPU's call, so a new call's JSON replaces every row
(`python scripts/readme_tables.py --write docs/results/gpu.md` after naming the new file in the markers):
- `summary`: T(1) and T(16) of the 1.5B configuration on speculant's hf backend, the static backend eager, and
  compiled with CUDA graphs; greedy `ar` tok/s compiled against transformers' own `generate` (the README's);
- `tw`: T(W) of every model and path measured, ms per forward after 256 cached tokens;
- `ar`: greedy `ar` tok/s of every path measured;
- `speculation`: `sd` and `tree` on the compiled pair, with and without stage scheduling;
- `machinery`: the CUDA tests, batch rows, one-graph drafting, the drafter's cost ratio, a quantized target;
- `syncs`: host syncs per target forward, greedy and sampled;
- `auto`: `auto` against `ar` where nothing is accepted, every such section of the files given (A B B A rounds).
Pure Python (json).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys

TABLES = ("summary", "tw", "ar", "speculation", "machinery", "syncs", "auto")
WIDTHS = ("1", "2", "4", "8", "16", "32")
FAILED = "failed (its error is in the JSON)"  # a row gpu_static.py kept as its error
PATHS = {"hf": "hf backend (transformers, dynamic cache, exact row by row), eager",
         "static": "static backend, eager (width = W)"}
SPECULATION = {  # gpu_static.py's run labels, read out
    "ar": "`ar`", "sd k4 0.5b": "`sd` k = 4, the random 0.5B",
    "sd k4 self": "`sd` k = 4, the target drafting for itself",
    "sd k8 self": "`sd` k = 8, the target drafting for itself",
    "tree self d4 w2": "`tree` d4 w2, the target drafting for itself, level by level",
    "tree self d4 w2, one graph": "... its levels as one CUDA graph",
    "tree self d4 w2, one graph, stage": "... one graph, `schedule=stage`",
    "tree 0.5b d4 w2": "`tree` d4 w2, the random 0.5B (one graph)", "tree 0.5b d4 w2, stage": "... `schedule=stage`"}


def path_name(key: str) -> str:
    """'1.5b compiled x16' -> '1.5B, static backend, compiled + CUDA graph, width 16'; '0.5b hf' -> '0.5B, hf ...'."""
    model, kind, *width = key.split()
    model = model.upper()
    if kind == "compiled":
        return f"{model}, static backend, compiled + CUDA graph, width {width[0].lstrip('x')}"
    return f"{model}, {PATHS.get(kind, kind)}"


def measured(section: dict) -> dict:
    """A section's measurements, without its seconds and error (what the call's plan and failures record)."""
    return {key: value for key, value in section.items() if key not in ("seconds", "error")}


def rate(row: dict) -> str:
    """An `ar` row's tokens per second and what they count, or that it failed (gpu_static.py keeps the error)."""
    return next((f"{v:.1f} ({'decode' if k == 'decode tok/s' else k.removeprefix('tok/s ').strip('()')})"
                 for k, v in row.items() if "tok/s" in k), FAILED)


def summary(d: dict) -> None:
    eager, compiled, ar = d["eager T(W) ms"], d["compiled T(W) ms"], d["ar"]
    rows = [("1.5B, hf backend (transformers, exact row by row), eager", eager["1.5b hf"]),
            ("1.5B, static backend, eager", eager["1.5b static"]),
            ("1.5B, static backend, compiled + CUDA graph (width 16)", compiled["1.5b compiled x16"])]
    print(f"| {d['device']}, torch {d['torch']} | T(1) ms | T(16) ms | greedy `ar`, 128 tokens |")
    print("|---|---:|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {t['1']:.1f} | {t['16']:.1f} | |")
    print(f"| speculant static, compiled, width 1 / 16 | | | **{ar['static compiled x1']['decode tok/s']:.0f} / "
          f"{ar['static compiled x16']['decode tok/s']:.0f} tok/s** (decode) |")
    for label in ("static cache, compiled", "dynamic cache"):
        whole = ar[f"transformers generate, {label}"].get("tok/s (whole request)")
        print(f"| transformers `generate`, {label} | | | "
              f"{FAILED if whole is None else f'{whole:.0f} tok/s (whole request)'} |")


def tw(d: dict) -> None:
    if not {"eager T(W) ms", "compiled T(W) ms"} & set(d):
        raise KeyError("eager T(W) ms")
    print(f"| {d['device']}, ms | " + " | ".join(f"W={w}" for w in WIDTHS) + " | pool regions | first call s |")
    print("|---|" + "---:|" * (len(WIDTHS) + 2))
    for section in ("eager T(W) ms", "compiled T(W) ms"):
        for key, t in measured(d.get(section, {})).items():
            first = next((f"{v:.1f}" for k, v in t.items() if k.startswith("first call") and v > 1), "")
            cells = [f"{t[w]:.2f}" if w in t else "" for w in WIDTHS]
            print(f"| {path_name(key)} | " + " | ".join(cells) + f" | {t.get('regions', '')} | {first} |")


def ar(d: dict) -> None:
    print(f"| greedy `ar`, 1.5B, 200-token prompt, {d['ar'].get('static compiled x1', {}).get('tokens', 128)} new "
          "tokens | tok/s |\n|---|---:|")
    names = {"static eager x16": "speculant static, eager, width 16", "static compiled x1":
             "speculant static, compiled, width 1", "static compiled x16":
             "speculant static, compiled, width 16 (exact verification at any width up to 16)"}
    for key, row in measured(d["ar"]).items():
        name = names.get(key, key.replace("transformers generate", "transformers `generate`"))
        print(f"| {name} | {rate(row)} |")


def speculation(d: dict) -> None:
    print(f"| 1.5B target, width 16, {d['device']} | decode tok/s | mean accepted | equals `ar` | stage: hit rate, "
          "overlap |\n|---|---:|---:|---|---|")
    for key, row in measured(d["speculation"]).items():
        stage = row.get("stage")
        drafted = f"{stage['hit rate']:.0%} ({stage['hits']} of {stage['drafted']}), {stage['overlap']:.2f}" \
            if stage else ""
        print(f"| {SPECULATION.get(key, key)} | {row['decode tok/s']:.1f} | {row['mean accepted']:.2f} | "
              f"{'yes' if row['equals ar'] else '**no**'} | {drafted} |")


def machinery(d: dict) -> None:
    print(f"| {d['device']} | result |\n|---|---|")
    if tests := d.get("tests"):
        counts = ", ".join(f"{n} {outcome.lower()}" for outcome, n in sorted(tests.get("counts", {}).items()))
        failed = "; failed: " + ", ".join(f"`{name.split('::')[-1]}`" for name in tests["failed"]) \
            if tests.get("failed") else ""
        print(f"| the suite's CUDA cases (`--sections tests`) | {counts}{failed} |")
    if rows := d.get("rows"):
        print(f"| {rows['rows']} sequences batched in the compiled 16-row step, against each alone (a pool of "
              f"{rows['regions']} regions) | **{rows['batched tok/s']:.1f}** against {rows['alone tok/s']:.1f} tok/s "
              f"({rows['batched tok/s'] / rows['alone tok/s']:.1f}x), "
              f"{'the same tokens' if rows['equal'] else '**other tokens**'} |")
    for depth, row in measured(d.get("draft", {})).items():
        print(f"| a tree of the 0.5B, {depth}, width 4: its levels as one CUDA graph, against a replay per level | "
              f"**{row['one call ms']:.2f}** against {row['levels ms']:.2f} ms ({row['levels / one call']:.2f}x; "
              f"first call {row['one call first ms']:.0f} ms), {'the same tree' if row['equal'] else '**another**'} |")
    if drafter := d.get("drafter"):
        print(f"| the drafter's cost ratio c: the 0.5B at width 1 over the 1.5B at width 16 | {drafter['0.5b x1']:.2f} "
              f"/ {drafter['1.5b x16']:.2f} ms = **{drafter['c']:.2f}** |")
    if quantized := measured(d.get("quantized", {})):
        equal = [key for key, row in quantized.items() if row["equals ar"]]
        print(f"| a quantized transformers target (the 0.5B, hf backend) against its `ar` | "
              f"{len(equal)} of {len(quantized)} equal: " + ", ".join(f"`{key}`" for key in quantized) + " |")


def syncs(d: dict) -> None:
    rows = measured(d["syncs"])
    print(f"| host syncs per target forward, {d['device']} | greedy | at 0.7 | beyond `ar`'s, greedy / at 0.7 |\n"
          "|---|---:|---:|---|")
    for label in dict.fromkeys(key.rsplit(" T=", 1)[0] for key in rows):
        greedy, sampled = rows[f"{label} T=0.0"], rows[f"{label} T=0.7"]
        more = "beyond ar's"
        beyond = "" if label == "ar" else f"+{greedy[more]:.1f} / +{sampled[more]:.1f}"
        print(f"| `{label}` | {greedy['syncs per forward']:.1f} | {sampled['syncs per forward']:.1f} | {beyond} |")


def auto_sections(node, path=()):
    """Every `auto` section below `node` (a dict with `auto / ar`), with the keys leading to it."""
    if isinstance(node, dict):
        if "auto / ar" in node:
            yield path, node
        else:
            for key, value in node.items():
                yield from auto_sections(value, (*path, key))


def auto(files: dict[str, dict]) -> None:
    print("| `auto` (the random 0.5B and Max-Gram) where nothing is accepted | `ar` decode tok/s | `auto` | "
          "`auto` / `ar` | its A B B A rounds | steps that drafted | outputs equal |")
    print("|---|---:|---:|---:|---|---:|---|")
    for name, d in files.items():
        for path, row in auto_sections(d):
            a, b = row["ar decode tok/s"], row["auto decode tok/s"]
            rounds = [statistics.mean(b[i:i + 2]) / statistics.mean(a[i:i + 2]) for i in range(0, len(a) - 1, 2)]
            steps = sum(row["auto choices"].values())
            where = " / ".join(key.split(":")[0] for key in path if key != "auto")
            print(f"| `{name}`{': ' + where if where else ''} | {statistics.mean(a):.1f} | {statistics.mean(b):.1f} | "
                  f"**{row['auto / ar']:.3f}** | {min(rounds):.3f}-{max(rounds):.3f} ({len(rounds)}) | "
                  f"{steps - row['auto choices'].get('plain', 0)} of {steps} | "
                  f"{'yes' if row['outputs equal'] else '**no**'} |")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="gpu_static.py's output JSON (`auto` reads every file given)")
    parser.add_argument("--table", choices=TABLES, default="summary")
    args = parser.parse_args(argv)
    read = {}
    for path in args.files:
        try:
            read[path.rsplit("/", 1)[-1]] = json.loads(open(path).read())
        except (OSError, ValueError) as error:
            raise SystemExit(f"cannot read {path}: {error}") from None
    table = io.StringIO()  # (printed whole or not at all)
    try:
        with contextlib.redirect_stdout(table):
            if args.table == "auto":
                auto(read)
            else:
                {"summary": summary, "tw": tw, "ar": ar, "speculation": speculation, "machinery": machinery,
                 "syncs": syncs}[args.table](next(iter(read.values())))
    except (KeyError, TypeError) as error:
        raise SystemExit(f"{args.files[0]}: no `{args.table}` table in it ({error!r}): not a gpu_static.py run's "
                         "JSON with that section") from None
    print(table.getvalue(), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
