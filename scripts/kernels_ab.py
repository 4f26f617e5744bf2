"""A/B of two builds of speculant's 4-bit kernels on the 1.5B's own matrices (docs/results/cpu.md).

    python scripts/kernels_ab.py OLD.c NEW.c --widths 1,2,4,8,16 --repeats 11
    python scripts/kernels_ab.py OLD.c NEW.c --isa avx2 --repeats 7        # the AVX2 sources
    python scripts/kernels_ab.py OLD.c NEW.c --isa amx_int8 --amx-rows 1 --kind q6_k   # every row on AMX tiles
    python scripts/kernels_ab.py avx512.c avx512.c --isa amx_int8 --amx-rows 17,1     # vpdpbusd, then tiles

Measures, for each width W, the time of one pass of W activation rows through all 197 matrices of
Qwen2.5-Coder-1.5B (its attention and MLP projections and the Q6_K output head, as the lean backend packs
them), the two libraries interleaved pass by pass, and prints the median of each with their ratio. Before timing
it checks that both builds give the same bits at every width (`--no-check` where the numerics changed on
purpose, as with the per-256 activation scales). OLD.c is typically `git show HEAD~1:speculant/kernels/avx512.c`
saved beside copies of the headers it includes (common.h, layer.h, amx.h, tiles.h; avx2.c's avx2_k.h too). An
avx512.c from before 9a86bef ran the five-bit kinds on avx2_k.h's FMA kernels: build it with `--flag=-mfma`.

Each library quantizes its own activations (`quantize_rows`), in the layout it was built for: per-256 scales with
per-32 and per-16 integer sums (the current kernels), or `--old-layout per32` / `--new-layout per32` for a build
from before commit 661cf61 (a float scale per 32 inputs). Why it exists: a kernel change that keeps the bits must
be timed against the code it replaces on the same matrices in the same process, since a VM's speed drifts between
processes by more than such a change.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the C source of the old build (avx512.c or avx2.c)")
    parser.add_argument("new", type=Path, help="the C source of the new build")
    parser.add_argument("--widths", default="1,2,4,8,16", help="rows per pass, comma-separated")
    parser.add_argument("--repeats", type=int, default=11, help="timed passes per library and width")
    parser.add_argument("--isa", default="avx512_vnni", help="whose compiler flags build both (a kernels.ISAS name)")
    parser.add_argument("--flag", action="append", default=[], help="a compiler flag added to both builds' (e.g. "
                        "-mfma for an avx512.c from before 9a86bef)")
    parser.add_argument("--old-layout", choices=("per256", "per32"), default="per256")
    parser.add_argument("--new-layout", choices=("per256", "per32"), default="per256")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-check", action="store_true", help="do not require the same bits from both builds")
    parser.add_argument("--kind", choices=("q4_k", "q5_k", "q6_k", "q4_b", "q5_b", "q8_b"),
                        help="only the matrices of this kind")
    parser.add_argument("--amx-rows", help="AMX builds: the fewest rows a tile multiplies on tiles, of every kind, "
                        "in the old build [and the new]: 1 every row, 17 none (vpdpbusd); a build from before the "
                        "cut-over per kind reads the kind as its one cut-over, so only 1 means what it says there")
    args = parser.parse_args(argv)

    import torch

    from speculant import kernels
    from speculant.bench.kernels import linear_weights
    from speculant.kernels.build import compile_library

    torch.set_num_threads(args.threads)
    P, I = ctypes.c_void_p, ctypes.c_int64
    isa = next(i for i in kernels.ISAS if i.name == args.isa)

    def load(source: Path) -> ctypes.CDLL:
        lib = compile_library(source, (*kernels.FLAGS, *isa.flags, *args.flag))
        if lib is None:
            raise SystemExit(f"{source}: no C compiler, or it did not build")
        lib.quantize_rows.argtypes = [P, I, I, P, P, P, P, ctypes.c_int]
        for kind in kernels.KINDS:  # (an older source may lack the later kinds)
            if hasattr(lib, f"matmul_{kind}"):
                getattr(lib, f"matmul_{kind}").argtypes = [P, P, P, P, I, I, P, I, P, ctypes.c_int]
        if isa.amx and not lib.amx_ready():
            raise SystemExit("Linux refused this process AMX's tile state")
        return lib

    weights = [m for m in linear_weights(args.model) if args.kind in (None, m.kind)]  # the head included
    widths = [int(w) for w in args.widths.split(",")]

    def activations(lib: ctypes.CDLL, layout: str) -> dict:
        out = {}
        for w in widths:
            for k in {m.in_features for m in weights}:
                x = torch.randn(w, k, generator=torch.Generator().manual_seed(w))
                q = torch.empty(w, k, dtype=torch.int8)
                if layout == "per32":
                    a = (q, torch.empty(w, k // 32), torch.empty(w, k // 32), torch.empty(w, k // 16))
                else:
                    a = (q, torch.empty(w, -(-k // 256)), torch.empty(w, k // 32, dtype=torch.int16),
                         torch.empty(w, k // 16, dtype=torch.int32))
                lib.quantize_rows(x.data_ptr(), w, k, *(t.data_ptr() for t in a), args.threads)
                out[w, k] = a
        return out

    if args.amx_rows and not isa.amx:
        raise SystemExit(f"--amx-rows applies to an AMX build (--isa amx_int8), not {isa.name}")
    rows = [int(r) for r in args.amx_rows.split(",")] * 2 if args.amx_rows else [None] * 2
    builds = {}
    for name, source, layout, least in (("old", args.old, args.old_layout, rows[0]),
                                        ("new", args.new, args.new_layout, rows[1])):
        lib = load(source)
        builds[name] = (lib, activations(lib, layout), least)

    def run(name: str, w: int) -> tuple[float, list]:
        lib, acts, least = builds[name]
        for kind in range(len(kernels.AMX_KINDS) if least is not None else 0):  # each run: a source loads once
            lib.amx_set_rows(kind, least)
        outs, start = [], time.perf_counter()
        for m in weights:
            y = torch.empty(w, m.data.shape[0] * 16)
            getattr(lib, f"matmul_{m.kind}")(*(t.data_ptr() for t in acts[w, m.in_features]), w, m.in_features,
                                             m.data.data_ptr(), y.shape[1], y.data_ptr(), args.threads)
            outs.append(y)
        return time.perf_counter() - start, outs

    if not args.no_check:
        for w in widths:
            if not all(torch.equal(a, b) for a, b in zip(run("old", w)[1], run("new", w)[1])):
                raise SystemExit(f"the two builds differ at W = {w} (--no-check to time them anyway)")
    times = {(name, w): [] for name in builds for w in widths}
    for _ in range(args.repeats):
        for w in widths:
            for name in builds:
                times[name, w].append(run(name, w)[0])
    for w in widths:
        old, new = (statistics.median(times[name, w]) * 1e3 for name in builds)
        print(f"T({w}) {old:.1f} -> {new:.1f} ms ({new / old:.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
