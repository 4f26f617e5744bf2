"""Batch-invariant linear layers: a token's output is bit-identical however many tokens share its forward.

Greedy speculation equals greedy `ar` only if the target scores a token the same way when it decodes it
alone as when it verifies it inside a block or a tree, or prefills it. Library matmuls break that: they
pick their blocking, and with it the order of each sum, from the number of rows (one-row calls even
take a separate matrix-vector path), and in bf16 a different order moves an argmax every few hundred
tokens. Their differences can be rare enough (2 in 10^5 bf16 outputs) that no self-test sees them
reliably, so speculant runs every bf16/fp32 linear layer on a kernel whose order of summation it
defines, invariant by construction:

- `amx` (`kernels/amx_linear.c`, Intel AMX CPUs, bf16): each output row of a tile accumulates its own
  chunks of 32 inputs in order, so its cost is nearly flat from 1 to 16 rows (`speculant profile`).
- `avx2` (`kernels/exact_linear.c`, AVX2 + FMA, bf16 or fp32 weights): each output accumulated by fused
  multiply-adds in input order, in fp32.
- `rows`: torch's matmul one row per call (the same call shape every time), n times one row's cost:
  any device, CUDA included.

The kernel is chosen per machine, dtype and weight shapes by timing the available ones (one token plus an
8-token verification) and remembered in the speculant cache. Attention runs row-invariant
(`invariant.py`); norms, rotary embeddings and activations act per row.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from speculant.cache import cache_root, write_json
from speculant.machine import cpu_info
from speculant.models.numerics.invariant import use_row_invariant_attention
from speculant.models.numerics.native import KERNELS

PLANS = "linear-kernels.json"
ROWS = "rows"
_planning = threading.Lock()  # one thread at a time reads, times and writes the plans: each key is measured once


class ExactLinear(nn.Module):
    """A linear layer (the weights of an nn.Linear or a GPT-2 Conv1D) run by a batch-invariant kernel.
    `weight` is [out, in]; `conv1d` keeps the state dict in the layout of the Conv1D it replaced."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str, conv1d: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel, self.conv1d = kernel, conv1d
        # Buffers, not parameters: copies of the module tree share them, nothing trains them.
        native = KERNELS.get(kernel)
        self.register_buffer("packed", native.pack(weight) if native else None, persistent=False)
        self.register_buffer("dense", None if native else weight.detach(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weights (unpacked on demand from a native kernel's layout; quantization reads them)."""
        if self.dense is not None:
            return self.dense
        return KERNELS[self.kernel].unpack(self.packed, self.out_features, self.in_features)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """A state dict as the nn.Linear it replaces has: `weight` and `bias`."""
        destination[prefix + "weight"] = self.weight.t() if self.conv1d else self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args) -> None:
        weight, bias = state_dict.get(prefix + "weight"), state_dict.get(prefix + "bias")
        if weight is not None:
            weight = weight.t() if self.conv1d else weight
            self.__init__(weight.to(self.weight.dtype), bias if bias is not None else self.bias, self.kernel, self.conv1d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel == ROWS:
            y = torch.cat([F.linear(row[None], self.dense) for row in rows])
        else:
            y = KERNELS[self.kernel].linear(rows, self.packed, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if type(m) in (nn.Linear, Conv1D, ExactLinear)]


def dense_weight(module: nn.Module) -> torch.Tensor:
    """[out, in] weights of an nn.Linear, an ExactLinear or a Conv1D (whose weight is [in, out])."""
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


def _dtype(module: nn.Module) -> torch.dtype:
    return (module.packed if isinstance(module, ExactLinear) and module.packed is not None else module.weight).dtype


def _cost(kernel: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, repeats: int = 3) -> float:
    """Seconds of one token plus an 8-token verification through a random layer of `shape` (median)."""
    layer = ExactLinear((torch.randn(shape) * 0.02).to(device=device, dtype=dtype), None, kernel)
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for n in (1, 8):
            layer(torch.zeros(n, shape[1], dtype=dtype, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def kernels_for(dtype: torch.dtype, device: torch.device) -> list[str]:
    native = [name for name, k in KERNELS.items() if device.type == "cpu" and k.available(dtype)]
    return [*native, ROWS]


def choose_kernel(typical: tuple[int, int], dtype: torch.dtype, device: torch.device) -> str:
    """The fastest batch-invariant kernel here for layers like `typical` (timed on random weights)."""
    return min(kernels_for(dtype, device), key=lambda kernel: _cost(kernel, typical, dtype, device))


def kernel_for(typical: tuple[int, int], dtype: torch.dtype, device: torch.device) -> str:
    """`choose_kernel`, remembered per machine, dtype and shape in the speculant cache (by one thread at a time: two
    that load models at once neither time the kernels together nor write the file over each other)."""
    path = cache_root() / "machine" / PLANS
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_info()[0]
    key = f"{where}|torch {torch.__version__}|{dtype}|{list(typical)}"
    with _planning:
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if known.get(key) in kernels_for(dtype, device):
            return known[key]
        known[key] = choose_kernel(typical, dtype, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, known)
        return known[key]


def make_exact(model: nn.Module) -> str | None:
    """Swap every bf16/fp32 linear layer of `model` (in place: a backend's private copy) for an ExactLinear
    on this machine's kernel, and switch attention to row-invariant; return the kernel's name. Layers
    already exact on that kernel stay as they are. None if the model has no such layers (quantized)."""
    layers = [(name, m) for name, m in linear_layers(model) if _dtype(m) in (torch.float32, torch.bfloat16)]
    if not layers:
        return None
    dtypes = {_dtype(m) for _, m in layers}
    if len(dtypes) > 1:
        raise ValueError(f"linear layers of several dtypes: {dtypes}")
    weights: dict[tuple[int, int], int] = {}
    for _, module in layers:
        shape = tuple(dense_weight(module).shape) if not isinstance(module, ExactLinear) else \
            (module.out_features, module.in_features)
        weights[shape] = weights.get(shape, 0) + shape[0] * shape[1]
    device = next(model.parameters()).device
    kernel = kernel_for(max(weights, key=weights.get), dtypes.pop(), device)  # timed where most weights are
    for name, module in layers:
        if isinstance(module, ExactLinear) and module.kernel == kernel:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        conv1d = isinstance(module, Conv1D) or getattr(module, "conv1d", False)
        setattr(parent, child, ExactLinear(dense_weight(module).detach().contiguous(), module.bias, kernel, conv1d))
    use_row_invariant_attention(model)
    return kernel


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` as transformers built it: library linear layers (nn.Linear, or Conv1D where
    that is what an ExactLinear replaced) and torch's SDPA attention. What peers such as transformers'
    own `generate()` run on; the copy's weights are the exact layers' weights (unpacked where packed)."""
    from copy import deepcopy

    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    copy = deepcopy(model, memo)
    for name, module in list(copy.named_modules()):
        if not isinstance(module, ExactLinear):
            continue
        weight, bias = module.weight, module.bias
        if module.conv1d:
            layer = Conv1D(module.out_features, module.in_features)
            layer.weight = nn.Parameter(weight.t().contiguous(), requires_grad=False)
        else:
            layer = nn.Linear(module.in_features, module.out_features, bias is not None, device="meta")
            layer.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(copy.get_submodule(parent_name) if parent_name else copy, child, layer)
    if hasattr(copy, "set_attn_implementation"):
        copy.set_attn_implementation("sdpa")
    return copy
