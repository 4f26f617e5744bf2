"""A drafter's catch-up with and without the output head's rows it throws away: `forward(rows)` against
`catch_up(rows)` (the last row's logits only) after 24 cached tokens, interleaved, medians; the 0.5B catalog drafter
on the lean backend by default.

    python scripts/catch_up_cost.py [--model qwen2.5-coder-0.5b@lean] [--rows 8 31 64 128] [--repeats 12] [--out F]
"""

import argparse
import json
import statistics
import time

from speculant.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b@lean")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 31, 64, 128])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out")
    args = parser.parse_args()
    model = load_model(args.model)
    ids = list(range(1000, 1024 + max(args.rows)))
    results = {}
    for rows in args.rows:
        rest = ids[24:24 + rows]
        times: dict[str, list[float]] = {"forward": [], "catch_up": []}
        for _ in range(args.repeats):
            for name, run in (("forward", lambda: model.forward(rest)), ("catch_up", lambda: model.catch_up(rest))):
                model.prefill(ids[:24])
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
        forward, catch_up = (statistics.median(times[name]) * 1e3 for name in ("forward", "catch_up"))
        results[rows] = {"forward ms": forward, "catch_up ms": catch_up, "ratio": catch_up / forward}
        print(f"{rows} rows: forward {forward:.1f} ms, catch_up {catch_up:.1f} ms, {catch_up / forward:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "repeats": args.repeats, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
