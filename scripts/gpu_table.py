"""Print the README's GPU table from the JSON that scripts/gpu_static.py writes (docs/results/gpu-h100.json).

    python scripts/gpu_table.py docs/results/gpu-h100.json

Rows: T(1) and T(16) of the 1.5B configuration (ms per forward after 256 cached tokens) on speculant's hf backend,
the static backend eager, and compiled with CUDA graphs; then greedy `ar` tok/s compiled against transformers' own
`generate` with a static cache under torch.compile and with its dynamic cache. Pure Python (json).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="gpu_static.py's output JSON")
    args = parser.parse_args(argv)
    d = json.load(open(args.file))
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
    print(f"| transformers `generate`, static cache, compiled | | | "
          f"{ar['transformers generate, static cache, compiled']['tok/s (whole request)']:.0f} tok/s (whole request) |")
    print(f"| transformers `generate`, dynamic cache | | | "
          f"{ar['transformers generate, dynamic cache']['tok/s (whole request)']:.0f} tok/s (whole request) |")


if __name__ == "__main__":
    main(sys.argv[1:])
