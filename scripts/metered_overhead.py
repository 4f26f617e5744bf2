"""What `Metered` (the wrapper that counts and times a target's forwards, `models/wrappers/metered.py`) adds to one
forward, for the CHANGELOG's entry on `ar` running its target metered as every method does: a stand-in model whose
forward costs tens of microseconds, raw against metered, alternated A B B A, median of each.

    python scripts/metered_overhead.py [--rounds 5] [--forwards 20000]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import MarkovLM  # noqa: E402

from speculant.models.wrappers.metered import Metered  # noqa: E402


def per_forward_us(model, raw: MarkovLM, forwards: int) -> float:
    start = time.perf_counter()
    for _ in range(forwards):
        model.forward([5])
        raw.rollback(3)
    return (time.perf_counter() - start) / forwards * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forwards", type=int, default=20000)
    args = parser.parse_args()
    raw = MarkovLM(12, 0)
    raw.prefill([1, 2, 3])
    times: dict[str, list[float]] = {"raw": [], "metered": []}
    for _ in range(args.rounds):
        for name, model in (("raw", raw), ("metered", Metered(raw)), ("metered", Metered(raw)), ("raw", raw)):
            times[name].append(per_forward_us(model, raw, args.forwards))
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    print(f"us per forward, median of {2 * args.rounds}: raw {median['raw']:.1f}, metered {median['metered']:.1f}, "
          f"added {median['metered'] - median['raw']:.1f}")


if __name__ == "__main__":
    main()
