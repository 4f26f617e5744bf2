"""Stage scheduling's hit rate and overlap over a bench run's `tree:...,schedule=stage` rows (GenerationStats.stage):
of the trees drafted ahead, the share the committed context matched, and the share of their drafting time that ran
during verification rather than while the decoder waited for it.

    python scripts/stage_record.py docs/results/tree-stage/mixed/results.json [...]
"""

from __future__ import annotations

import argparse
import json


def main(paths: list[str]) -> None:
    for path in paths:
        drafted = hits = ahead = waited = 0.0
        for row in json.load(open(path))["rows"]:
            if stage := row["stats"].get("stage"):
                drafted, hits = drafted + stage["drafted"], hits + stage["hits"]
                ahead, waited = ahead + stage["ahead_s"], waited + stage["waited_s"]
        if drafted:
            print(f"{path}: hit rate {hits / drafted:.0%} ({hits:.0f} of {drafted:.0f} trees), overlap "
                  f"{1 - waited / ahead:.0%} ({ahead:.1f} s drafting ahead, {waited:.1f} s of it waited for)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="a bench run's results.json")
    main(parser.parse_args().results)
