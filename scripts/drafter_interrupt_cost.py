"""What a DSI drafter's interrupt check costs a llama.cpp forward (a restart cuts a stale draft short through it: on
llama.cpp a Python call per graph node): one-token forwards of a catalog model with no check and with one that never
fires, alternated A B B A, their medians printed. The CHANGELOG (12-02) keeps what it gave.

    python scripts/drafter_interrupt_cost.py [--model qwen2.5-coder-0.5b] [--forwards 30] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

from speculant.models import load_model


def per_forward_ms(model, ids: list[int], check, forwards: int) -> float:
    model.interrupt = check
    try:
        model.prefill(ids)
        start = time.perf_counter()
        for i in range(forwards):
            model.forward([ids[i % len(ids)]])
        return (time.perf_counter() - start) / forwards * 1000
    finally:
        model.interrupt = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--forwards", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model = load_model(args.model, backend="llamacpp")
    ids = model.tokenizer.encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n")
    per_forward_ms(model, ids, None, 5)  # warm-up
    times: dict[str, list[float]] = {"no check": [], "check": []}
    for r in range(args.rounds):
        for name in ("no check", "check") if r % 2 == 0 else ("check", "no check"):
            times[name].append(per_forward_ms(model, ids, None if name == "no check" else (lambda: False),
                                              args.forwards))
    for name, ms in times.items():
        print(f"{name}: median {statistics.median(ms):.2f} ms a forward ({', '.join(f'{t:.2f}' for t in ms)})")


if __name__ == "__main__":
    main()
