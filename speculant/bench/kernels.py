"""T(W) of speculant's 4-bit kernels on a model's own weights: the time of one pass of W rows through every
linear layer the kernels cover (attention and MLP projections and the output head; not the attention
itself, norms or the embedding lookup), on each ISA path the machine has. `speculant bench-kernels`."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from speculant import kernels
from speculant.errors import ConfigError

KINDS = {"Q4_K": "q4_k", "Q6_K": "q6_k"}


def gguf_path(model: str) -> Path:
    from speculant.models.catalog import CATALOG, gguf_checkpoint

    if model in CATALOG:
        return gguf_checkpoint(CATALOG[model]) / "model.gguf"
    if model.endswith(".gguf") and Path(model).is_file():
        return Path(model)
    raise ConfigError(f"'{model}' is neither a catalog name ({', '.join(CATALOG)}) nor a GGUF file")


def linear_weights(path: Path) -> tuple[list[kernels.QuantWeight], float]:
    """The model's K-quant matrices in the kernels' layout (the embedding table excepted: it is looked up,
    not multiplied) and the fraction of the other matrices' bytes they cover."""
    from gguf import GGUFReader

    weights, covered, total = [], 0, 0
    for tensor in GGUFReader(path).tensors:
        if len(tensor.shape) != 2 or tensor.name == "token_embd.weight":
            continue
        total += tensor.n_bytes
        kind = KINDS.get(tensor.tensor_type.name)
        if kind is not None:
            weights.append(kernels.QuantWeight.from_gguf(kind, np.asarray(tensor.data)))
            covered += tensor.n_bytes
    return weights, covered / max(total, 1)


def pass_seconds(weights: list[kernels.QuantWeight], width: int, isa: str, repeats: int) -> float:
    """Median time of W rows through every weight (each input quantized on its own)."""
    inputs = {w.in_features: torch.randn(width, w.in_features, generator=torch.Generator().manual_seed(width))
              for w in weights}
    times = []
    for _ in range(repeats + 1):  # the first warms caches and page tables
        start = time.perf_counter()
        for weight in weights:
            kernels.matmul(kernels.quantize(inputs[weight.in_features], isa), weight, isa)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench_kernels(model: str, widths: list[int], isas: list[str] | None, repeats: int) -> dict:
    found = kernels.paths()
    isas = isas or [isa for isa in found if isa != "scalar"]
    missing = [isa for isa in isas if isa not in found]
    if missing:
        raise ConfigError(f"this machine runs {', '.join(found)}; not {', '.join(missing)}")
    weights, coverage = linear_weights(gguf_path(model))
    if not weights:
        raise ConfigError(f"'{model}' has no Q4_K or Q6_K matrices for speculant's kernels")
    rows = {isa: {width: pass_seconds(weights, width, isa, repeats) for width in widths} for isa in isas}
    return {"model": model, "threads": torch.get_num_threads(), "coverage": coverage,
            "bytes": sum(w.data.numel() for w in weights), "seconds": rows}


def report(result: dict) -> str:
    widths = list(next(iter(result["seconds"].values())))
    lines = [f"{result['model']}: {result['bytes'] / 1e6:.0f} MB of packed weights ({result['coverage']:.0%} of the "
             f"matrices' bytes), {result['threads']} threads",
             "| path | " + " | ".join(f"T({w})" for w in widths) + " |",
             "|---|" + "---:|" * len(widths)]
    for isa, seconds in result["seconds"].items():
        one = seconds[widths[0]]
        cells = [f"{seconds[w] * 1e3:.1f} ms" if w == widths[0] else f"{seconds[w] / one:.2f}x" for w in widths]
        lines.append(f"| {isa} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
