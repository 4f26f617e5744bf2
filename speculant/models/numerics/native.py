"""speculant's exact linear kernels for transformers weights (their C in `speculant/kernels/`), compiled once per
machine with the system C compiler and loaded with ctypes (no build step at install). Both compute a linear layer batch-invariantly by construction:

- `avx2` (`exact_linear.c`, AVX2 + FMA): bf16 or fp32 weights, fp32 activations, each output accumulated
  by fused multiply-adds in input order.
- `amx` (`amx_linear.c`, Intel AMX): bf16 weights and activations, fp32 accumulation, each output row
  of a tile accumulating its own chunks of 32 inputs in order; and int8 weights and activations with
  exact int32 accumulation (`pack_int8`, `linear_int8`: quantized models).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from speculant.kernels.build import HEADERS, compile_library
from speculant.machine import cpu_has

PANEL = 16  # output rows per packed panel, both kernels
AMX_CHUNK = 32  # inputs per AMX tile multiply
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class NativeKernel:
    name: str
    source: str
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    weight_dtypes: tuple[torch.dtype, ...]

    def library(self) -> ctypes.CDLL | None:
        return _library(self)

    def available(self, dtype: torch.dtype) -> bool:
        return dtype in self.weight_dtypes and self.library() is not None

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[O, K] weights in the kernel's layout (zeros pad the last panel, and AMX's last chunk)."""
        out_features, in_features = weight.shape
        weight = weight.detach().contiguous()
        panels = -(-out_features // PANEL)
        if self.name == "amx":
            packed = torch.empty(panels * PANEL * -(-in_features // AMX_CHUNK) * AMX_CHUNK, dtype=torch.bfloat16)
            self.library().amx_pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
        else:
            packed = torch.empty(panels * PANEL * in_features, dtype=weight.dtype)
            getattr(self.library(), f"pack_{_suffix(weight.dtype)}")(weight.data_ptr(), out_features, in_features,
                                                                      packed.data_ptr())
        return packed

    def unpack(self, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """The [O, K] weights back from the kernel's layout."""
        if self.name == "amx":
            chunks = -(-in_features // AMX_CHUNK)
            tiles = packed.view(-1, chunks, AMX_CHUNK // 2, PANEL, 2)  # [panel, chunk, pair, output, of pair]
            dense = tiles.permute(0, 3, 1, 2, 4).reshape(-1, chunks * AMX_CHUNK)
        else:
            dense = packed.view(-1, in_features, PANEL).permute(0, 2, 1).reshape(-1, in_features)
        return dense[:out_features, :in_features]

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [n, K] times the packed weights: [n, out_features] fp32."""
        lib = self.library()
        x = x.to(torch.bfloat16 if self.name == "amx" else torch.float32).contiguous()
        y = torch.empty(x.shape[0], out_features)
        function = lib.amx_linear if self.name == "amx" else getattr(lib, f"linear_{_suffix(packed.dtype)}")
        function(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), out_features, y.data_ptr(),
                 torch.get_num_threads())
        return y


AVX2 = NativeKernel("avx2", "exact_linear.c", ("-mavx2", "-mfma"), ("avx2", "fma"), (torch.bfloat16, torch.float32))
AMX = NativeKernel("amx", "amx_linear.c", ("-mamx-tile", "-mamx-bf16", "-mamx-int8"), ("amx_tile", "amx_bf16", "amx_int8"),
                   (torch.bfloat16,))
KERNELS = {kernel.name: kernel for kernel in (AMX, AVX2)}


def _suffix(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]


@cache
def _library(kernel: NativeKernel) -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run (CPU features missing, no C compiler, a failed
    build, no AMX permission from the OS)."""
    if not cpu_has(*kernel.cpu_flags):
        return None
    lib = compile_library(HEADERS / kernel.source, kernel.flags)
    if lib is None:
        return None
    if kernel.name == "amx":
        lib.amx_pack.argtypes = lib.amx_pack_i8.argtypes = [_P, _I, _I, _P]
        lib.amx_linear.argtypes = [_P, _I, _I, _P, _I, _P, ctypes.c_int]
        lib.amx_linear_i8.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, ctypes.c_int]
        if not lib.amx_ready():
            return None
    else:
        for suffix in ("bf16", "f32"):
            getattr(lib, f"pack_{suffix}").argtypes = [_P, _I, _I, _P]
            getattr(lib, f"linear_{suffix}").argtypes = [_P, _I, _I, _P, _I, _P, ctypes.c_int]
    return lib


AMX_CHUNK8 = 64  # int8 inputs per AMX tile multiply


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """[O, K] int8 weights in the AMX int8 layout (panels of 16 outputs, chunks of 64 inputs)."""
    out_features, in_features = weight.shape
    weight = weight.contiguous()  # held: a temporary's memory would be freed before the kernel reads it
    packed = torch.empty(-(-out_features // PANEL) * PANEL * -(-in_features // AMX_CHUNK8) * AMX_CHUNK8, dtype=torch.int8)
    AMX.library().amx_pack_i8(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def linear_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [n, K] (fp32), each row quantized to int8 on its own, times the packed int8 weights, scaled back by
    the row's scale and the per-output `scales`, plus `bias`: [n, out_features] fp32. The sums are exact
    int32, so a row's result never depends on the other rows."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], out_features)
    AMX.library().amx_linear_i8(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), scales.data_ptr(),
                                bias.data_ptr() if bias is not None else None, out_features, y.data_ptr(),
                                torch.get_num_threads())
    return y
