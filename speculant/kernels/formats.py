"""GGUF K-quant tensors repacked, once, into the panel layouts speculant's kernels read (see common.h):
the same quants and scales as the file (no requantization), regrouped so that one 16-lane register load
holds four inputs of each of 16 outputs.

ggml's block layouts (ggml-common.h): Q4_K super-blocks of 256 inputs, `d`, `dmin` (f16), 12 bytes of
six-bit scales and mins for 8 blocks of 32, 128 bytes of nibbles; Q6_K super-blocks of 256, 128 bytes of
low nibbles, 64 bytes of high bit pairs, 16 int8 scales for blocks of 16, `d` (f16).
"""

from __future__ import annotations

import numpy as np

PANEL = 16
SUPER = 256
QUANTUM = 128  # a matrix's inputs are padded to a multiple of this, not of SUPER (see `pack`)
BYTES = {"q4_k": 2368, "q6_k": 3360}  # one panel's super-block in speculant's layout
TAIL = {"q4_k": 64 + 4 * 288, "q6_k": 32 + 8 * 208}  # its first half: header and the blocks of 128 inputs
GGUF_BYTES = {"q4_k": 144, "q6_k": 210}  # one output's super-block in the file


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
    return inputs // SUPER * BYTES[kind] + (TAIL[kind] if inputs % SUPER else 0)


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
    if kind == "q4_k":
        d, dmin, sc, m, q = unpack_q4_k(raw)
        q = q.reshape(rows, supers, 8, 2, 4, 4)  # [O, S, block, nibble, c, t]
        nibbles = q[..., 0, :, :] | (q[..., 1, :, :] << 4)  # [O, S, block, c, t]
        nibbles = np.moveaxis(nibbles.reshape(-1, PANEL, supers, 8, 4, 4), 1, 4)  # [P, S, block, c, j, t]
        blocks = np.concatenate([_panels(sc, supers), _panels(m, supers),
                                 nibbles.reshape(-1, supers, 8, 256)], axis=-1)  # [P, S, 8, 288]
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
    if kind == "q4_k":
        d, dmin, sc, m, q = unpack_q4_k(raw)
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
    rows = x.shape[0]
    blocks = x.reshape(rows, -1, 8, 32)
    low, high = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    scale, offset = (high - low) / 15, -low
    d = np.maximum(scale.max(-1), 1e-8) / 63
    dmin = np.maximum(offset.max(-1), 1e-8) / 63
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.rint(scale / d.astype(np.float32)[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = np.clip(np.rint((blocks + (dmin.astype(np.float32)[..., None] * m)[..., None]) / step), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
        (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)  # the inverse of ggml's get_scale_min_k4
    q = q.reshape(rows, -1, 4, 2, 32)  # [O, S, chunk, low/high nibble, 32]
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, -1, 128)
    return np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed_scales, qs],
                          axis=-1).reshape(rows, -1)


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
