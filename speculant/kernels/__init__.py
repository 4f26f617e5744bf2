"""speculant's exact kernels: GGUF weights (repacked once, `formats.py`: Q4_K, Q5_K and Q6_K as they are, the types
whose blocks are integers times a scale plus an offset as nibbles (Q4_0, Q4_1; Q5_0, Q5_1 with their high bits) or a
byte per weight (Q8_0), F16/BF16/F32 as fp32 rows) times int8 activation rows (fp32 rows for fp32 weights), one C
file per ISA (`scalar.c`, `avx2.c`, `avx512.c`), chosen at run time by the CPU's features; where the CPU has AMX
int8, tiles of up to 16 rows of Q4_K or Q6_K take their integer sums from AMX tile multiplies (`amx.h`) from the
number of rows where those pay, timed once per machine and kind (`amx_rows`). Each weight block is unpacked once per
call for every row of a tile (llamafile's tinyBLAS register tiling), and each output is accumulated in the same order
whatever the number of rows, the tile, the thread or the ISA: row r of a W-row call equals the 1-row call, and every
path equals the scalar reference, bit for bit.

    act = quantize_rows(x)                  # x [W, K] fp32, each row on its own (ggml's Q8_K: a scale per 256)
    y = matmul(act, weight)                 # weight: QuantWeight.from_gguf("Q4_K", raw); y [W, O] fp32

Each library also holds a whole decoder layer of the lean model on those matmuls (`layer.h`, `layer`).
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from speculant.cache import remembered
from speculant.errors import ConfigError
from speculant.kernels import formats
from speculant.kernels.build import build_error, compile_library
from speculant.machine import cpu_has, cpu_info

_P, _I = ctypes.c_void_p, ctypes.c_int64
log = logging.getLogger("speculant")


@dataclass(frozen=True)
class Isa:
    name: str
    source: str
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]

    @property
    def amx(self) -> bool:
        """Whether its library holds amx.h's tile kernels."""
        return "-DAMX" in self.flags


AVX512 = (("-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c"), ("avx512f", "avx512bw", "avx512_vnni", "f16c"))
ISAS = (  # fastest first
    Isa("amx_int8", "avx512.c", (*AVX512[0], "-DAMX"), (*AVX512[1], "amx_tile", "amx_int8")),
    Isa("avx512_vnni", "avx512.c", *AVX512),
    Isa("avx2", "avx2.c", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    Isa("scalar", "scalar.c", (), ()),
)
# The AMX kernels with their tile instructions done in C: what a CPU without AMX runs to test them; never chosen.
EMULATED = Isa("amx_int8_emulated", "avx512.c", (*AVX512[0], "-DAMX", "-DAMX_EMULATED"), AVX512[1])
FLAGS = ("-fno-trapping-math",)  # every ISA's: lets compilers vectorize exp_poly's selects; no value changes
KINDS = ("q4_k", "q6_k", "q8_b", "f32", "q4_b", "q5_k", "q5_b")  # layer.h's Mat.kind: the index here


@cache
def library(name: str) -> ctypes.CDLL | None:
    """The ISA's compiled kernels, or None where the CPU lacks its features (AMX: or Linux refuses the process
    its tile state), or no C compiler is found."""
    isa = next(isa for isa in (*ISAS, EMULATED) if isa.name == name)
    if not cpu_has(*isa.cpu_flags):
        return None
    lib = compile_library(*_build(isa))
    if lib is None or isa.amx and not lib.amx_ready():
        return None
    if isa.amx:
        lib.amx_set_rows.argtypes, lib.amx_set_rows.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    lib.quantize_rows.argtypes = [_P, _I, _I, _P, _P, _P, _P, ctypes.c_int]
    for kind in formats.BYTES:
        getattr(lib, f"matmul_{kind}").argtypes = [_P, _P, _P, _P, _I, _I, _P, _I, _P, ctypes.c_int]
    lib.matmul_f32.argtypes = [_P, _I, _I, _P, _I, _P, ctypes.c_int]
    lib.lean_layer.argtypes = [ctypes.POINTER(LayerStruct), _I, _I, _I, _I, ctypes.c_float, ctypes.c_int, _P, _I,
                               _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int, ctypes.c_float,
                               ctypes.c_int]
    return lib


def _build(isa: Isa) -> tuple[Path, tuple[str, ...]]:
    """The C source and flags of `isa`'s library."""
    return Path(__file__).with_name(isa.source), (*FLAGS, *isa.flags)


AMX_KINDS = ("q4_k", "q6_k")  # the kinds amx.h multiplies on tiles, in amx_set_rows's order
CHECK_SECONDS = 300  # what `amx_rows`'s child may take: a child still running then has hung


@cache
def amx_rows(name: str) -> tuple[int, ...]:
    """For AMX path `name`: for each of AMX_KINDS, the fewest rows a tile must have for its tile multiplies to pay
    on this machine (17: no width), or zeros where it fails `check`. Found in a child process once per build of
    its library and CPU (remembered): the tile instructions were tested only on an emulation when they were
    written, so a fault, a wrong bit or a hang costs a child, and the path, never this process."""
    def failed(why: str) -> list[int]:
        log.warning(f"speculant: the {name} kernels failed their check ({why}); they will not be chosen")
        return [0] * len(AMX_KINDS)

    def measure() -> list[int]:
        try:
            child = subprocess.run([sys.executable, "-c", f"from speculant.kernels import AMX_KINDS, check, cut_over; "
                                    f"check({name!r}); print(*(cut_over({name!r}, kind) for kind in AMX_KINDS))"],
                                   capture_output=True, text=True, timeout=CHECK_SECONDS)
        except subprocess.TimeoutExpired:
            return failed(f"no answer in {CHECK_SECONDS} s")
        except OSError as error:
            return failed(str(error))
        if child.returncode:
            return failed(f"exit {child.returncode}; {(child.stderr.strip().splitlines() or ['no message'])[-1]}")
        return [int(rows) for rows in child.stdout.split()[-len(AMX_KINDS):]]

    return tuple(remembered("kernels-amx.json", f"{Path(library(name)._name).name}|{cpu_info()[0]}", measure))


def set_amx_rows(name: str, rows: tuple[int, ...]) -> tuple[int, ...]:
    """Give AMX path `name`'s library its cut-over for each of AMX_KINDS; returns those it replaces."""
    return tuple(library(name).amx_set_rows(kind, least) for kind, least in enumerate(rows))


def cut_over(name: str, kind: str = "q4_k", repeats: int = 7, panels: int = 512) -> int:
    """The fewest rows from which AMX path `name`'s tiles are faster than its vpdpbusd kernels at every width up to
    16 (17: at none) on weights of `kind`, timed on `panels` x 16 outputs of 4096 inputs of random blocks (19 MB
    of q4_k), the two kernels interleaved, from 16 rows down until the tiles lose (a loss by more than half is
    plain at the first repeat). Both kernels give the same bits: this decides speed only."""
    lib, inputs, index = library(name), 4096, AMX_KINDS.index(kind)
    data = torch.randint(0, 256, (panels, formats.panel_bytes(kind, inputs)), dtype=torch.uint8)
    head = {"q4_k": 64, "q6_k": 32}[kind]  # the super-block's f16 scales (d, and q4_k's dmin): no NaN, no subnormal
    scales = torch.from_numpy(np.full(head // 2, 1e-3, dtype=np.float16).view(np.uint8))
    data.view(panels, -1, formats.BYTES[kind])[:, :, :head] = scales
    weight = QuantWeight(kind, panels * formats.PANEL, inputs, data)
    before = lib.amx_set_rows(index, 1)

    def seconds(rows: int, act: Activations) -> float:  # rows: the fewest a tile multiply takes
        lib.amx_set_rows(index, rows)
        start = time.perf_counter()
        matmul(act, weight, name)
        return time.perf_counter() - start

    try:
        for width in range(16, 0, -1):
            act, tiles, vpdpbusd = quantize_rows(torch.randn(width, inputs), name), [], []
            for _ in range(repeats):
                tiles.append(seconds(1, act))
                vpdpbusd.append(seconds(17, act))
                if min(tiles) > 1.5 * max(vpdpbusd):
                    break
            if statistics.median(tiles) >= statistics.median(vpdpbusd):
                return width + 1
        return 1
    finally:
        lib.amx_set_rows(index, before)


def check(name: str) -> None:
    """Raise unless path `name` gives every row of calls of 1 to 20 rows the scalar reference's bits, on weights
    of every kind with a last half super-block: every tile height of every kernel the path mixes in a call."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    generator = torch.Generator().manual_seed(0)
    for ggml_type in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_1", "Q4_1", "F16"):
        dense = torch.randn(48, 768, generator=generator)
        dense[:, 640:] = 0.0
        if formats.KIND_OF[ggml_type] in formats.GGUF_BYTES:  # 768 inputs, of which the kernels read 640
            raw = getattr(formats, f"quantize_{formats.KIND_OF[ggml_type]}")(dense.numpy())
        else:
            raw = quantize(dense[:, :640].numpy(), GGMLQuantizationType[ggml_type])
        weight = QuantWeight.from_gguf(ggml_type, raw, 640)
        x = torch.randn(20, 640, generator=generator) * 3
        reference = matmul(quantize_rows(x, "scalar"), weight, "scalar", threads=1)
        for width in range(1, 21):
            if not torch.equal(matmul(quantize_rows(x[:width], name), weight, name), reference[:width]):
                raise RuntimeError(f"{name}: rows of a {width}-row {weight.kind} call differ from the scalar "
                                   f"reference")


def usable(isa: Isa) -> bool:
    """Whether the machine runs `isa`; an AMX path only where its tiles pay at some width for some kind
    (`amx_rows`, which its library then follows)."""
    if library(isa.name) is None or not isa.amx:
        return library(isa.name) is not None
    rows = amx_rows(isa.name)
    if not all(rows) or min(rows) > 16:
        return False
    set_amx_rows(isa.name, rows)
    return True


def paths(emulated: bool = False) -> list[str]:
    """The ISAs this machine runs, fastest first (an AMX path only where its tiles pay: `usable`). With `emulated`,
    every path the tests hold to the scalar reference: each whose library loads (an AMX path: and passes `check`),
    whether or not it pays, and the AMX kernels emulated where AMX itself does not run. A test's parameters must not
    hang on a timing: two test processes that each timed the tiles once collected different tests."""
    if not emulated:
        return [isa.name for isa in ISAS if usable(isa)]
    found = [isa.name for isa in ISAS if library(isa.name) is not None and (not isa.amx or all(amx_rows(isa.name)))]
    if "amx_int8" not in found and library(EMULATED.name) is not None:
        found.insert(found.index("scalar"), EMULATED.name)
    return found


@cache
def best() -> str:
    """The fastest ISA this machine runs (asked on every call of `quantize_rows` and `matmul`: found once); a
    ConfigError where none builds (the scalar reference needs only a C compiler with OpenMP)."""
    found = paths()
    if not found:
        raise ConfigError(f"speculant's kernels need a C compiler with OpenMP (gcc): {build_error(*_build(ISAS[-1]))}")
    return found[0]


def build() -> str:
    """The fastest path and its compiled library (named by the sources' digest): what a measured T(W) of code
    on these kernels depends on."""
    return f"{best()} ({Path(library(best())._name).stem})"


@dataclass(frozen=True)
class QuantWeight:
    """A [out_features, in_features] weight matrix in a kernel's layout (uint8 bytes)."""
    kind: str
    out_features: int
    in_features: int
    data: torch.Tensor

    @classmethod
    def from_gguf(cls, ggml_type: str, raw: np.ndarray, inputs: int | None = None) -> "QuantWeight":
        """`raw`: a GGUF tensor of a type in `formats.KIND_OF` as GGUFReader gives it, one row per output;
        `inputs`: its width padded to a multiple of 128 (default), or K - 128 where the last 128 inputs of K-quant
        blocks are `formats.requantize`'s zero padding (see `formats.pack`)."""
        inputs = inputs or formats.inputs_of(formats.width(ggml_type, raw))
        kind, data = formats.pack_type(ggml_type, raw, inputs)
        return cls(kind, raw.shape[0], inputs, torch.from_numpy(data))


class MatStruct(ctypes.Structure):
    """layer.h's Mat: a QuantWeight as the C layer reads it."""
    _fields_ = [("packed", _P), ("K", _I), ("O", _I), ("out", _I), ("kind", ctypes.c_int32)]


class LayerStruct(ctypes.Structure):
    """layer.h's Layer: one decoder layer's norms, biases (None: NULL) and matrices."""
    _fields_ = [(name, _P) for name in ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm",
                                        "q_bias", "k_bias", "v_bias")] + \
        [(name, MatStruct) for name in ("q", "k", "v", "o", "gate", "up", "down")]


def layer_struct(norms: tuple[torch.Tensor | None, ...], biases: tuple[torch.Tensor | None, ...],
                 matrices: tuple[QuantWeight, ...]) -> LayerStruct:
    """The C view of a layer (attention and MLP norms; q and k norms per head, norms of attention's and the MLP's
    outputs, or None; q, k, v biases; q, k, v, o, gate, up, down): the tensors must outlive it."""
    def mat(w: QuantWeight) -> MatStruct:
        return MatStruct(w.data.data_ptr(), w.in_features, w.data.shape[0] * formats.PANEL, w.out_features,
                         KINDS.index(w.kind))

    pointers = [t.data_ptr() if t is not None else None for t in (*norms, *biases)]
    return LayerStruct(*pointers, *map(mat, matrices))


@dataclass(frozen=True)
class Places:
    """Where each of n rows of a layer call sits: rotated by `positions`, written at cache position `slots`,
    seeing its cache's positions j < `seen` where its mask row allows (`masks`: addresses of uint8 rows, 0 for
    none); `keys`, `values`: the address of each row's cache [layers, kv_heads, capacity, head_dim]. All int64
    [n]; `held` keeps alive what the addresses point into."""
    positions: torch.Tensor
    slots: torch.Tensor
    seen: torch.Tensor
    masks: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    capacity: int
    held: tuple[Any, ...] = ()


def layer(config: Any, layer: LayerStruct, index: int, x: torch.Tensor, places: Places, cos: torch.Tensor,
          sin: torch.Tensor, neox: bool, isa: str | None = None) -> None:
    """Decoder layer `index` (layer.h) on the residual stream x [n, hidden] in place, its rows placed by
    `places` (rows of several sequences, each with a cache of its own, may share one call). `config`: the lean
    model's (its shape, scores' scale and soft cap, GeGLU or SwiGLU)."""
    layer_size = config.kv_heads * places.capacity * config.head_dim
    library(isa or best()).lean_layer(
        ctypes.byref(layer), config.hidden, config.heads, config.kv_heads, config.head_dim, config.eps, int(neox),
        x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), places.positions.data_ptr(),
        places.slots.data_ptr(), places.seen.data_ptr(), places.masks.data_ptr(), places.keys.data_ptr(),
        places.values.data_ptr(), index * layer_size, places.capacity, config.attn_scale or config.head_dim ** -0.5,
        torch.get_num_threads(), config.attn_softcap, int(config.gelu))


@dataclass(frozen=True)
class Activations:
    """Rows of activations quantized to int8: quants [W, K], one scale per super-block of 256 inputs [W, K/256
    rounded up], the sums of the quants per 32 inputs [W, K/32] (int16, for q4_k's mins and q8_b's offsets) and
    -32 times those per 16 [W, K/16] (int32, q6_k's offsets); and the rows as they were, zero-padded to K [W, K]
    (what fp32 weights multiply)."""
    quants: torch.Tensor
    scales: torch.Tensor
    sums32: torch.Tensor
    offsets16: torch.Tensor
    inputs: torch.Tensor

    @property
    def rows(self) -> int:
        return self.quants.shape[0]


def quantize_rows(x: torch.Tensor, isa: str | None = None) -> Activations:
    """x [W, K], each row quantized on its own; K is padded with zeros to a multiple of 128, as the inputs of
    weights whose inputs are not (`formats.inputs_of`)."""
    x, inputs = x.float(), formats.inputs_of(x.shape[1])
    if inputs != x.shape[1]:
        x = F.pad(x, (0, inputs - x.shape[1]))
    x = x.contiguous()
    rows, width = x.shape
    act = Activations(torch.empty(rows, width, dtype=torch.int8), torch.empty(rows, -(-width // formats.SUPER)),
                      torch.empty(rows, width // 32, dtype=torch.int16),
                      torch.empty(rows, width // 16, dtype=torch.int32), x)
    library(isa or best()).quantize_rows(x.data_ptr(), rows, width, act.quants.data_ptr(), act.scales.data_ptr(),
                                         act.sums32.data_ptr(), act.offsets16.data_ptr(), torch.get_num_threads())
    return act


def matmul(act: Activations, weight: QuantWeight, isa: str | None = None, threads: int | None = None) -> torch.Tensor:
    """act [W, K] times weight^T: [W, out_features] fp32."""
    if act.quants.shape[1] != weight.in_features:
        raise ValueError(f"{act.quants.shape[1]} inputs for a weight of {weight.in_features}")
    padded, lib, threads = weight.data.shape[0] * formats.PANEL, library(isa or best()), threads or torch.get_num_threads()
    y = torch.empty(act.rows, padded)
    if weight.kind == "f32":
        lib.matmul_f32(act.inputs.data_ptr(), act.rows, weight.in_features, weight.data.data_ptr(), padded,
                       y.data_ptr(), threads)
    else:
        getattr(lib, f"matmul_{weight.kind}")(
            act.quants.data_ptr(), act.scales.data_ptr(), act.sums32.data_ptr(), act.offsets16.data_ptr(), act.rows,
            weight.in_features, weight.data.data_ptr(), padded, y.data_ptr(), threads)
    return y if padded == weight.out_features else y[:, :weight.out_features].contiguous()
