"""Weight quantization of every linear layer, for cheap drafters on CPU and CUDA.

`int4`: weight-only int4, asymmetric, one scale and zero point per `group_size` inputs, bf16
activations; torch's packed tinygemm kernels on both devices (`_weight_int4pack_mm[_for_cpu]`).
`int8`: per-output-channel int8 weights. On CPU each token's activations are quantized to int8 per call
too (Intel AMX where the CPU has it, else fbgemm's dynamic kernels), and attention runs row-invariant
(`invariant.py`), so the model scores a token bit-identically in any forward and can be an exactly
lossless target. On CUDA the weight is
dequantized inside the matmul call (weight-only: it halves the memory of bf16, and on an H100 it is not
faster than bf16 - int4 is the fast one).
The speculative-sampling paper suggests exactly this kind of drafter (Chen et al. 2023, section 1:
a quantized copy of the target); losslessness never depends on the drafter's precision.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from tqdm import tqdm
from transformers.pytorch_utils import Conv1D

from speculant.config import QUANTS
from speculant.errors import ConfigError
from speculant.models.numerics import native
from speculant.models.numerics.exact import ExactLinear
from speculant.models.numerics.invariant import use_row_invariant_attention

CUDA_INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CUDA tinygemm kernel supports
GROUP_SIZE = 32  # int4's weights per scale and offset, unless told another
INT4_ROWS = 16  # the packed int4 kernels need output sizes in multiples of this: odd sizes are padded
log = logging.getLogger("speculant")


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b with W per-output-channel int8 and each token x quantized to int8 per call (fbgemm, CPU).

    fbgemm's dynamic kernel quantizes the whole input with one scale, which would make a token's output
    depend on the other tokens of the call (and on later ones: not even causal), so a quantized target
    would verify differently than it decodes. Scaling every row to max |x| = 1 and appending one guard
    row that holds +1 and -1 pins the tensor's range, and with it the quantization parameters: each token
    is quantized on its own, the int32 accumulation is exact, and a token's output is bit-identical
    whatever else is in the call.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch marks the eager quantization API deprecated
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = linear.bias.detach().float() if linear.bias is not None else None
        self._guard = torch.zeros(1, linear.in_features)
        self._guard[0, 0], self._guard[0, -1] = 1.0, -1.0
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        row_max = rows.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
        guarded = torch.empty(rows.shape[0] + 1, rows.shape[1])
        torch.div(rows, row_max, out=guarded[:-1])
        guarded[-1:] = self._guard
        y = torch.ops.quantized.linear_dynamic(guarded, self._packed, True)[:-1].mul_(row_max)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


class AMXInt8Linear(nn.Module):
    """y = (q(x) W_q^T) s_x s_w + b on Intel AMX: per-output-channel int8 weights and each token's activations
    quantized to int8 on its own (symmetric, scale max |x| / 127); the int32 sums are exact, so a token's
    output never depends on the other tokens of the call. Chosen over fbgemm wherever AMX runs
    (`speculant profile --model NAME@int8` shows its T(W))."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8)
        quantized = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("packed", native.pack_int8(quantized))
        self.register_buffer("scales", scales.contiguous())
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = native.linear_int8(x.reshape(-1, shape[-1]), self.packed, self.scales, self.bias, self.out_features)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


class Int8WeightOnlyLinear(nn.Module):
    """y = (x W_q^T) * s + b with W_q per-output-channel int8 and s its scales (any device)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8)
        self.register_buffer("weight", (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class Int4WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W in asymmetric int4 groups along the input dimension (bf16 activations)."""

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        out_features, k = linear.weight.shape
        if k % group_size:
            raise ConfigError(f"int4 needs input sizes divisible by the group size {group_size}, got {k}")
        self.on_cuda = linear.weight.is_cuda
        if self.on_cuda:
            _check_cuda_int4(linear.weight.device, group_size)
        n = -(-out_features // INT4_ROWS) * INT4_ROWS  # zero rows pad the output size; their outputs are dropped
        weight = nn.functional.pad(linear.weight.detach().float(), (0, 0, 0, n - out_features))
        groups = weight.view(n, k // group_size, group_size)
        low = groups.amin(-1, keepdim=True)
        scale = ((groups.amax(-1, keepdim=True) - low) / 15).clamp_min(1e-8)
        q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        self.register_buffer("packed", _pack_int4(q, self.on_cuda))
        # The kernels dequantize as (q - 8) * scale + zero, so shift the zero point by 8 steps.
        scale, low = scale.view(n, -1), low.view(n, -1)
        scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).contiguous()  # [k/g, n, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16))
        self.group_size, self.out_features = group_size, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        mm = torch._weight_int4pack_mm if self.on_cuda else torch._weight_int4pack_mm_for_cpu
        y = mm(flat, self.packed, self.group_size, self.scales_and_zeros)[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


def _pack_int4(q: torch.Tensor, on_cuda: bool) -> torch.Tensor:
    """Pack int32 values in [0, 15] ([n, k]) into the layout of torch's int4 matmul kernel."""
    if not on_cuda:
        return torch._convert_weight_to_int4pack_for_cpu(q, 1)
    k = q.shape[1]
    inner_k_tiles = next(tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0)
    return torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), inner_k_tiles)


def _check_cuda_int4(device: torch.device, group_size: int) -> None:
    if torch.cuda.get_device_capability(device) < (8, 0):
        raise ConfigError(f"int4 on CUDA needs compute capability 8.0 or newer (Ampere+); "
                          f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}")
    if group_size not in CUDA_INT4_GROUP_SIZES:
        raise ConfigError(f"int4 on CUDA supports group sizes {CUDA_INT4_GROUP_SIZES}, got {group_size}")


def as_linear(module: nn.Module) -> nn.Linear:
    """A linear layer as an nn.Linear: a transformers `Conv1D` (weight [in, out], as GPT-2 uses) or an
    ExactLinear (`exact.py`) becomes the equivalent nn.Linear."""
    if isinstance(module, nn.Linear):
        return module
    weight = module.weight.detach().t() if isinstance(module, Conv1D) else module.weight.detach()
    linear = nn.Linear(weight.shape[1], weight.shape[0], module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = None if module.bias is None else nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear


def quantize(model: nn.Module, quant: str, group_size: int = GROUP_SIZE) -> nn.Module:
    """Replace every linear layer of `model` (nn.Linear and GPT-2's Conv1D; the LM head too, untied) by its
    quantized version, in place. A layer int4 cannot take (an input size not divisible by the group
    size) stays in full precision, and a one-line warning says how many did."""
    if quant not in QUANTS:
        raise ConfigError(f"unknown quantization '{quant}' (choose from {', '.join(QUANTS)})")
    device = next(model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{quant} quantization runs on CPU and CUDA, not on {device.type}")
    if quant == "int8" and device.type == "cpu":
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ConfigError("int8 quantization on CPU needs torch's fbgemm engine (x86 CPUs)")
        torch.backends.quantized.engine = "fbgemm"
    # Untie: the quantized head gets weights of its own and the input embedding stays as it is (quantized
    # layers never write to the tensors they were built from); nothing may tie them again later.
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (nn.Linear, Conv1D, ExactLinear))]
    kept = [name for name, module in targets if quant == "int4" and as_linear(module).in_features % group_size]
    for name, module in tqdm(targets, desc=f"quantizing to {quant}", disable=len(targets) < 50, leave=False):
        if name in kept:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _quantized(as_linear(module), quant, group_size))
    if kept:
        log.warning(f"speculant: int4 kept {len(kept)} of {len(targets)} linear layers in full precision (input sizes "
                    f"not divisible by the group size {group_size}: {', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''})")
    if hasattr(model, "set_attn_implementation"):
        use_row_invariant_attention(model)  # a quantized target verifies exactly as it decodes too
    return model


def _quantized(linear: nn.Linear, quant: str, group_size: int) -> nn.Module:
    if quant == "int4":
        return Int4WeightOnlyLinear(linear, group_size)
    if linear.weight.is_cuda:
        return Int8WeightOnlyLinear(linear)
    return AMXInt8Linear(linear) if native.AMX.library() is not None else Int8DynamicLinear(linear)
