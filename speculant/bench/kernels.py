"""T(W) of speculant's 4-bit kernels on a model's own weights: the time of one pass of W rows through every
matrix of the lean model (attention and MLP projections and the output head; not the attention itself,
norms or the embedding lookup), on each ISA path the machine has. `speculant bench-kernels`."""

from __future__ import annotations

import statistics
import time

import torch

from speculant import kernels
from speculant.errors import ConfigError


def linear_weights(model: str) -> list[kernels.QuantWeight]:
    """The model's matrices in the kernels' layout, as the lean backend loads them (repacked once, cached)."""
    from speculant.models.backends.lean import shared_weights
    from speculant.models.loading import gguf_file

    return shared_weights(gguf_file(model)).matrices()


def pass_seconds(weights: list[kernels.QuantWeight], width: int, isa: str, repeats: int) -> float:
    """Median time of W rows through every weight (each input quantized on its own)."""
    inputs = {w.in_features: torch.randn(width, w.in_features, generator=torch.Generator().manual_seed(width))
              for w in weights}
    times = []
    for _ in range(repeats + 1):  # the first warms caches and page tables
        start = time.perf_counter()
        for weight in weights:
            kernels.matmul(kernels.quantize_rows(inputs[weight.in_features], isa), weight, isa)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench_kernels(model: str, widths: list[int], isas: list[str] | None, repeats: int) -> dict:
    found = kernels.paths()
    if isas is None:
        kernels.best()  # (where none builds: the compiler's refusal, in one line)
        isas = [isa for isa in found if isa != "scalar"]
        if not isas:
            raise ConfigError("this machine runs only the scalar reference: give --isa scalar to time it")
    missing = [isa for isa in isas if isa not in found]
    if missing:
        raise ConfigError(f"this machine runs {', '.join(found)}; not {', '.join(map(repr, missing))}")
    weights = linear_weights(model)
    rows = {isa: {width: pass_seconds(weights, width, isa, repeats) for width in widths} for isa in isas}
    return {"model": model, "threads": torch.get_num_threads(), "matrices": len(weights),
            "bytes": sum(w.data.numel() for w in weights), "seconds": rows}


def report(result: dict) -> str:
    widths = list(next(iter(result["seconds"].values())))
    lines = [f"{result['model']}: {result['matrices']} matrices, {result['bytes'] / 1e6:.0f} MB packed, "
             f"{result['threads']} threads",
             "| path | " + " | ".join(f"T({w})" if w == widths[0] else f"T({w}) / T({widths[0]})"
                                    for w in widths) + " |",
             "|---|" + "---:|" * len(widths)]
    for isa, seconds in result["seconds"].items():
        one = seconds[widths[0]]
        cells = [f"{seconds[w] * 1e3:.1f} ms" if w == widths[0] else f"{seconds[w] / one:.2f}x" for w in widths]
        lines.append(f"| {isa} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
