"""T(W) of the lean backend's whole forward: the time of one forward over W new tokens after a cached context
(docs/results/cpu.md, beside llama.cpp's `llama-bench -p 1,2,4,8,16 -n 0 -d 256`).

    python scripts/lean_tw.py                                   # medians of 15 rounds, W = 1, 2, 4, 8, 16
    python scripts/lean_tw.py after --rounds 25 --stat faster-half --context fixed --widths 1,2,4,8

Loads Qwen2.5-Coder-1.5B on the lean backend, prefills a context of --context-len tokens, then runs rounds of one
forward per width (rolled back after each, so every forward sees the same cache), interleaved so that the VM's
drift touches every width alike. Prints each width's time in ms and its ratio to T(1), with the kernels' build.
Why: T(W) / T(1) is what speculation buys on a machine (Leviathan et al. 2023, eq. 1: a draft of k pays when the
expected accepted tokens exceed the cost of verifying k + 1 tokens), so the lean model is held to T(4) <= 1.3x and
T(8) <= 1.8x T(1).

The settings of the page's tables: `--rounds 15 --stat median --context random` (the default; the tables after
the per-256 scales and the AMX path) and `--rounds 25 --stat faster-half --context fixed --widths 1,2,4,8` (the
tables of "A vectorized exp" and after the broadcasts were folded; run once per commit, e.g. from a `git
worktree` with PYTHONPATH on it, LABEL naming it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label", nargs="?", default="", help="printed first (e.g. before / after)")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--widths", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--stat", choices=("median", "faster-half"), default="median",
                        help="median of the rounds, or mean of the faster half")
    parser.add_argument("--context", choices=("random", "fixed"), default="random",
                        help="random ids in 100-20000, or the fixed sequence (7919 i + 11) mod 150000")
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from speculant import kernels
    from speculant.models.loading import load_lean

    torch.set_num_threads(args.threads)
    model = load_lean(args.model)
    n = args.context_len
    ids = torch.randint(100, 20000, (n,)).tolist() if args.context == "random" else \
        [(7919 * i + 11) % 150000 for i in range(n)]
    model.prefill(ids)
    times = {int(w): [] for w in args.widths.split(",")}
    for _ in range(args.rounds):
        for w in times:
            model.rollback(n)
            start = time.perf_counter()
            model.forward(list(range(1000, 1000 + w)))
            times[w].append(time.perf_counter() - start)

    def stat(t: list[float]) -> float:
        if args.stat == "median":
            return statistics.median(t)
        half = sorted(t)[:max(len(t) // 2, 1)]
        return sum(half) / len(half)

    one = stat(times[min(times)])
    print(args.label, kernels.build(),
          {f"T({w})": f"{stat(t) * 1e3:.1f} ms ({stat(t) / one:.2f}x)" for w, t in times.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
