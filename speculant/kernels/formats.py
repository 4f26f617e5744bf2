"""GGUF tensors repacked, once, into the panel layouts speculant's kernels read (see common.h): the same
weights as the file (no requantization), regrouped so that one 16-lane register load holds four inputs of each
of 16 outputs. Q4_K, Q5_K and Q6_K keep their own layouts (`q4_k`; `q5_k`, q4_k's with each block's high bits;
`q6_k`); the types whose blocks of 32 are integers times a scale plus an offset become `q4_b` (Q4_0, Q4_1: q4_k's
nibbles, the block's scale and offset in f16), `q5_b` (Q5_0, Q5_1: q4_b's with q5_k's high bits) or `q8_b` (Q8_0: a
byte per weight, the scale and offset in fp32); F16, BF16 and F32 matrices become `f32` rows.

ggml's block layouts (ggml-common.h): Q4_K super-blocks of 256 inputs, `d`, `dmin` (f16), 12 bytes of
six-bit scales and mins for 8 blocks of 32, 128 bytes of nibbles; Q6_K super-blocks of 256, 128 bytes of
low nibbles, 64 bytes of high bit pairs, 16 int8 scales for blocks of 16, `d` (f16).
"""

from __future__ import annotations

import numpy as np

PANEL = 16
SUPER = 256
QUANTUM = 128  # a matrix's inputs are padded to a multiple of this, not of SUPER (see `pack`)
BYTES = {"q4_k": 2368, "q5_k": 2880, "q6_k": 3360, "q8_b": 8 * 640, "q4_b": 8 * 320,
         "q5_b": 8 * 384}  # one panel's super-block in speculant's layout
TAIL = {"q4_k": 64 + 4 * 288, "q5_k": 64 + 4 * 352, "q6_k": 32 + 8 * 208, "q8_b": 4 * 640, "q4_b": 4 * 320,
        "q5_b": 4 * 384}  # its first half: header, blocks of 128 inputs
GGUF_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # one output's super-block in the file
KIND_OF = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q8_0": "q8_b",
           **dict.fromkeys(("Q4_0", "Q4_1"), "q4_b"), **dict.fromkeys(("Q5_0", "Q5_1"), "q5_b"),
           **dict.fromkeys(("F32", "F16", "BF16"), "f32")}  # the kernel that reads each GGUF type, exactly
HIGH_SHIFTS = (2 * np.arange(4, dtype=np.uint8) + np.arange(2, dtype=np.uint8)[:, None])[..., None]  # [half, c, 1]
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}  # per 32 inputs


def unpack_q4_k(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """[O, S*144] bytes -> d, dmin [O, S] f16; sc, m [O, S, 8] u8; q [O, S*256] u8 (0..15)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    scales = blocks[..., 4:16].reshape(rows, -1, 3, 4)
    lo, hi, mixed = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return d, dmin, sc, m, (qs & 0x0F).reshape(rows, -1)


def unpack_q5_k(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """[O, S*176] bytes -> Q4_K's fields (`unpack_q4_k`) with q 0..31: ggml's block_q5_k holds Q4_K's d, dmin, scales
    and nibbles, and 32 bytes of high bits between them (bit b of byte l: input l of block b)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 176)
    d, dmin, sc, m, low = unpack_q4_k(np.concatenate([blocks[..., :16], blocks[..., 48:]], axis=-1).reshape(rows, -1))
    high = (blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    return d, dmin, sc, m, (low.reshape(rows, -1, 8, 32) | (high << 4)).reshape(rows, -1)


def unpack_q6_k(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """[O, S*210] bytes -> d [O, S] f16; sc [O, S, 16] i8; q [O, S*256] u8 (0..63, w = d*sc*(q - 32))."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 210)
    ql = blocks[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> shifts
    q = (ql & 0x0F).reshape(rows, -1, 8, 32) | ((qh & 0x03).reshape(rows, -1, 8, 32) << 4)
    sc = blocks[..., 192:208].view(np.int8)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0]
    return d, sc, q.reshape(rows, -1)


def width(ggml_type: str, raw: np.ndarray) -> int:
    """The inputs of a GGUF tensor of a type in KIND_OF, as GGUFReader gives its data ([O, bytes] or [O, K])."""
    kind = KIND_OF[ggml_type]
    if kind in GGUF_BYTES:
        return raw.shape[1] // GGUF_BYTES[kind] * SUPER
    if ggml_type in BLOCK_BYTES:
        return raw.shape[1] // BLOCK_BYTES[ggml_type] * 32
    return raw.shape[1] * raw.itemsize // {"F32": 4, "F16": 2, "BF16": 2}[ggml_type]


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def unpack_blocks32(ggml_type: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[O, bytes] of a type whose blocks are 32 integers times a scale plus an offset (Q4_0 to Q8_0: `q4_b`, `q5_b`,
    `q8_b`) -> q [O, K] int8, d and m [O, K/32] fp32: weight i of block b is
    d[b] * q[i] + m[b], exactly ggml's de-quantized value (ggml-quants.c's dequantize_row_*)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[ggml_type])
    d = _f16(blocks[..., 0:2])
    offset = ggml_type in ("Q4_1", "Q5_1")
    m = _f16(blocks[..., 2:4]) if offset else np.zeros_like(d)
    if ggml_type == "Q8_0":
        return blocks[..., 2:].view(np.int8).reshape(rows, -1), d, m
    nibbles = blocks[..., -16:].reshape(rows, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (nibbles & 0x0F).reshape(rows, -1, 32)
    if ggml_type in ("Q5_0", "Q5_1"):
        bits = blocks[..., 2 + 2 * offset:6 + 2 * offset].copy().view(np.uint32)
        q = q | (((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    centre = 0 if offset else (8 if ggml_type == "Q4_0" else 16)
    return (q.astype(np.int16) - centre).astype(np.int8).reshape(rows, -1), d, m


def floats(ggml_type: str, raw: np.ndarray) -> np.ndarray:
    """[O, K] fp32 of an F32, F16 or BF16 tensor (as GGUFReader gives its data)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[ggml_type]).astype(np.float32)


def _panels(a: np.ndarray, supers: int) -> np.ndarray:
    """[O, S, ...] -> [P, S, ..., 16]: each panel's 16 outputs innermost."""
    a = a.reshape(-1, PANEL, supers, *a.shape[2:])
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def inputs_of(width: int) -> int:
    """The inputs a matrix of `width` inputs holds in speculant's layout (its activations are padded alike)."""
    return -(-width // QUANTUM) * QUANTUM


def panel_bytes(kind: str, inputs: int) -> int:
    """One panel's bytes: its whole super-blocks, then, where `inputs` is an odd multiple of 128, the first half
    of one (a requantized drafter's 896 inputs: 3.5 super-blocks, not 4 of which one is half zeros)."""
    if kind == "f32":
        return PANEL * inputs * 4
    return inputs // SUPER * BYTES[kind] + (TAIL[kind] if inputs % SUPER else 0)


def pack_type(ggml_type: str, raw: np.ndarray, inputs: int) -> tuple[str, np.ndarray]:
    """A GGUF tensor of any type in KIND_OF ([O, its bytes], or F16/F32 values) in its kernel's layout: (kind,
    [P, panel_bytes]). `inputs`: where its rows are padded with zero weights to, a multiple of 128."""
    kind = KIND_OF[ggml_type]
    if kind in GGUF_BYTES:
        return kind, pack(kind, raw, inputs)
    if kind == "f32":
        weights = floats(ggml_type, raw)
        width = weights.shape[1]
        return kind, _padded(weights, inputs, width).reshape(-1, PANEL * inputs).view(np.uint8)
    q, d, m = unpack_blocks32(ggml_type, raw)
    width = q.shape[1]
    if kind in ("q4_b", "q5_b"):
        return kind, _pack_nibbles(ggml_type, q, d, m, inputs)
    u = (_padded(q, inputs, width).view(np.uint8) ^ 0x80).reshape(-1, PANEL, inputs // 32, 8, 4)  # q + 128
    u = np.moveaxis(u, 1, 3)  # [P, block, g, j, t]: byte g*64 + j*4 + t is input 4g + t of output j
    scales = [np.ascontiguousarray(np.moveaxis(_padded(v, inputs // 32, width // 32).reshape(-1, PANEL, inputs // 32),
                                               1, 2)) for v in (d, m)]  # [P, block, j]
    blocks = np.concatenate([scales[0].view(np.uint8), scales[1].view(np.uint8), u.reshape(*u.shape[:2], -1)],
                            axis=-1)
    return kind, np.ascontiguousarray(blocks.reshape(len(blocks), -1))


def _nibbles_and_high_bits(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quants [..., half, c, t] (input half*16 + 4c + t of a block of 32) -> the bytes of q4_k's nibbles
    [..., c, t] (the low half's low, the high half's high) and of five-bit quants' high bits [..., t] (input 4c + t's
    at bit 2c, 16 + 4c + t's at bit 2c + 1: common.h's q5_k)."""
    nibbles = (q[..., 0, :, :] & 0x0F) | ((q[..., 1, :, :] & 0x0F) << 4)
    return nibbles, np.bitwise_or.reduce((q >> 4) << HIGH_SHIFTS, axis=(-3, -2))


def _pack_nibbles(ggml_type: str, q: np.ndarray, d: np.ndarray, m: np.ndarray, inputs: int) -> np.ndarray:
    """Q4_0/Q4_1 blocks as `q4_b`, Q5_0/Q5_1 as `q5_b`: the quants made unsigned (Q4_0's q + 8, Q5_0's q + 16, their
    offset -8d or -16d, exact in f16 as d is), nibbles in q4_k's block layout and, for five bits, the high bits as
    q5_k's (`pack`), d and m in f16 (the file's own values)."""
    centre = {"Q4_0": 8, "Q5_0": 16}.get(ggml_type, 0)
    u = (q.astype(np.int16) + centre).astype(np.uint8)
    offset = (m - centre * d).astype(np.float16)
    if not np.isfinite(offset).all() or not np.array_equal(offset.astype(np.float32), m - centre * d):
        raise ValueError(f"a {ggml_type} offset is not exact in f16")
    width = q.shape[1]
    u = _padded(u, inputs, width).reshape(-1, PANEL, inputs // 32, 2, 4, 4)  # [P, j, block, half, c, t]
    nibbles, high = _nibbles_and_high_bits(u)
    nibbles = np.moveaxis(nibbles, 1, 3)  # [P, block, c, j, t]
    scales = [np.ascontiguousarray(np.moveaxis(_padded(v.astype(np.float16), inputs // 32, width // 32)
                                               .reshape(-1, PANEL, inputs // 32), 1, 2)) for v in (d, offset)]
    parts = [scales[0].view(np.uint8), scales[1].view(np.uint8), nibbles.reshape(*nibbles.shape[:2], -1)]
    if KIND_OF[ggml_type] == "q5_b":  # high [P, j, block, t] -> [P, block, j*4 + t]
        parts.append(np.moveaxis(high, 1, 2).reshape(*nibbles.shape[:2], -1))
    blocks = np.concatenate(parts, axis=-1)  # [P, block, 320 or 384]
    return np.ascontiguousarray(blocks.reshape(len(blocks), -1))


def _padded(a: np.ndarray, columns: int, width: int) -> np.ndarray:
    """a [O, width] with zero columns to `columns` and zero rows to a multiple of PANEL."""
    if width > columns:
        raise ValueError(f"{width} inputs do not fit {columns}")
    rows = -(-a.shape[0] // PANEL) * PANEL
    out = np.zeros((rows, columns), dtype=a.dtype)
    out[:a.shape[0], :width] = a
    return out


def pack(kind: str, raw: np.ndarray, inputs: int) -> np.ndarray:
    """A GGUF tensor's bytes [O, S*block bytes] holding `inputs` inputs, in speculant's layout: [P, panel_bytes],
    the last panel padded with zero weights. Where `inputs` is S*256 - 128, the last super-block's second half
    holds zero weights (`requantize`'s padding) and is left out."""
    supers = raw.shape[1] // GGUF_BYTES[kind]
    if inputs % QUANTUM or not supers * SUPER - QUANTUM <= inputs <= supers * SUPER:
        raise ValueError(f"{inputs} inputs do not fit {supers} super-blocks")
    if raw.shape[0] % PANEL:
        raw = np.concatenate([raw, np.zeros((PANEL - raw.shape[0] % PANEL, raw.shape[1]), dtype=np.uint8)])
    rows = raw.shape[0]
    if kind in ("q4_k", "q5_k"):
        d, dmin, sc, m, q = (unpack_q4_k if kind == "q4_k" else unpack_q5_k)(raw)
        q = q.reshape(rows, supers, 8, 2, 4, 4)  # [O, S, block, nibble, c, t]
        nibbles, high = _nibbles_and_high_bits(q)  # [O, S, block, c, t], [O, S, block, t]
        nibbles = np.moveaxis(nibbles.reshape(-1, PANEL, supers, 8, 4, 4), 1, 4)  # [P, S, block, c, j, t]
        parts = [_panels(sc, supers), _panels(m, supers), nibbles.reshape(-1, supers, 8, 256)]
        if kind == "q5_k":
            high = np.moveaxis(high.reshape(-1, PANEL, supers, 8, 4), 1, 3)  # [P, S, block, j, t]
            parts.append(high.reshape(-1, supers, 8, 64))
        blocks = np.concatenate(parts, axis=-1)  # [P, S, 8, 288 or 352]
        header = np.concatenate([_panels(d, supers).view(np.uint8), _panels(dmin, supers).view(np.uint8)], axis=-1)
    elif kind == "q6_k":
        d, sc, q = unpack_q6_k(raw)
        q = q.reshape(rows, supers, 16, 16)
        low = (q & 0x0F).reshape(rows, supers, 16, 2, 2, 4)  # [O, S, block, half, c, t]
        low = low[..., 0, :, :] | (low[..., 1, :, :] << 4)  # [O, S, block, c, t]
        low = np.moveaxis(low.reshape(-1, PANEL, supers, 16, 2, 4), 1, 4)  # [P, S, block, c, j, t]
        high = (q >> 4).reshape(rows, supers, 16, 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        high = np.bitwise_or.reduce(high, axis=3)  # [O, S, block, t]
        high = np.moveaxis(high.reshape(-1, PANEL, supers, 16, 4), 1, 3)  # [P, S, block, j, t]
        blocks = np.concatenate([_panels(sc, supers).view(np.uint8), low.reshape(-1, supers, 16, 128),
                                 high.reshape(-1, supers, 16, 64)], axis=-1)  # [P, S, 16, 208]
        header = _panels(d, supers).view(np.uint8)
    else:
        raise ValueError(f"no kernel for {kind}")
    full = np.concatenate([header, blocks.reshape(*blocks.shape[:2], -1)], axis=-1).reshape(len(header), -1)
    return np.ascontiguousarray(full[:, :panel_bytes(kind, inputs)])


def dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    """The [O, K] fp32 weights the kernels compute with: S*q - M per block, S and M in fp32."""
    rows = raw.shape[0]
    if kind in ("q4_k", "q5_k"):
        d, dmin, sc, m, q = (unpack_q4_k if kind == "q4_k" else unpack_q5_k)(raw)
        scale = d.astype(np.float32)[..., None] * sc.astype(np.float32)
        offset = dmin.astype(np.float32)[..., None] * m.astype(np.float32)
        width = 32
    else:
        d, sc, q = unpack_q6_k(raw)
        scale = d.astype(np.float32)[..., None] * sc.astype(np.float32)
        offset = scale * np.float32(32)
        width = 16
    q = q.reshape(rows, -1, width).astype(np.float32)
    return (scale.reshape(rows, -1, 1) * q - offset.reshape(rows, -1, 1)).reshape(rows, -1)


def requantize(kind: str, raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """A GGUF tensor of a type the kernels do not read ([O, bytes] of `ggml_type`, e.g. Q5_0 or Q8_0) de-quantized
    and quantized again as `kind`, its inputs padded with zero weights to a multiple of 256: GGUF bytes for `pack`
    (which leaves out a last half super-block of zeros).
    Not the file's numerics: for drafters, whose weights only change what they guess."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    weights = gguf_dequantize(raw, GGMLQuantizationType[ggml_type]).astype(np.float32)
    if weights.shape[1] % SUPER:
        weights = np.pad(weights, ((0, 0), (0, SUPER - weights.shape[1] % SUPER)))
    return {"q4_k": quantize_q4_k, "q6_k": quantize_q6_k}[kind](weights)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[O, K] fp32 -> GGUF Q4_K bytes [O, K/256 * 144]: per block of 32 a scale and a min, each in six bits of
    the super-block's d and dmin (a plain min-max rule, not llama.cpp's search)."""
    d, dmin, packed_scales, q = _scales_and_mins(x, 15)
    rows = x.shape[0]
    q = q.reshape(rows, -1, 4, 2, 32)  # [O, S, chunk, low/high nibble, 32]
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, -1, 128)
    return np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed_scales, qs],
                          axis=-1).reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[O, K] fp32 -> GGUF Q5_K bytes [O, K/256 * 176] (gguf has no Q5_K quantizer; the tests write Q5_K files):
    quantize_q4_k's scales and mins, five-bit quants whose high bits lie in qh (bit b of byte l: block b, input l)."""
    d, dmin, packed_scales, q = _scales_and_mins(x, 31)
    rows = x.shape[0]
    pairs = (q & 0x0F).reshape(rows, -1, 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, -1, 128)
    qh = np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=2)  # [O, S, 32]
    return np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed_scales, qh, qs],
                          axis=-1).reshape(rows, -1)


def _scales_and_mins(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K's and Q5_K's shared part: per block of 32 a scale and a min, each six bits of the super-block's d and
    dmin (a plain min-max rule), packed as ggml's get_scale_min_k4 reads them, and the quants 0..levels [O, S, 8, 32]."""
    rows = x.shape[0]
    blocks = x.reshape(rows, -1, 8, 32)
    low, high = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    scale, offset = (high - low) / levels, -low
    d = (np.maximum(scale.max(-1), 1e-8) / 63).astype(np.float16)
    dmin = (np.maximum(offset.max(-1), 1e-8) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / d.astype(np.float32)[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = np.clip(np.rint((blocks + (dmin.astype(np.float32)[..., None] * m)[..., None]) / step), 0, levels).astype(np.uint8)
    packed_scales = np.concatenate([
        (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
        (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)  # the inverse of ggml's get_scale_min_k4
    return d, dmin, packed_scales, q


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[O, K] fp32 -> GGUF Q6_K bytes [O, K/256 * 210]: per block of 16 an int8 scale of the super-block's d."""
    rows = x.shape[0]
    blocks = x.reshape(rows, -1, 16, 16)
    scale = np.abs(blocks).max(-1) / 31
    d = (np.maximum(scale.max(-1), 1e-8) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / d.astype(np.float32)[..., None]), 1, 127).astype(np.int8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = (np.clip(np.rint(blocks / step), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 128)  # [O, S, half, 128]
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # [O, S, half, 64]
    qh = (q >> 4).reshape(rows, -1, 2, 4, 32) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    qh = np.bitwise_or.reduce(qh, axis=3)  # [O, S, half, 32]
    return np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                           d[..., None].view(np.uint8)], axis=-1).reshape(rows, -1)
