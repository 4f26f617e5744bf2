"""Row-invariant attention: a token's attention output is bit-identical however many tokens share its forward.

Speculative decoding is lossless only if the target scores a token the same way when it verifies it
inside a block of k + 1 tokens as when it decodes it alone. In fp32 the kernels differ in the last bits
at most, which almost never moves an argmax. A model that quantizes its activations (`int8` on CPU)
amplifies those bits: a value near a rounding boundary lands on the other int8 level and the logits
move by ~0.1 (measured on Qwen2.5-Coder-0.5B@int8: its last MLP turned 5e-6 of attention noise into
3e-2). So such a model runs attention one query at a time over exactly the keys it may see, in cache
order, which is the very computation of a one-token decoding step; its int8 linears are row-invariant
by construction (`quant.Int8DynamicLinear`), and norms, rotary embeddings and activations act per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from speculant.errors import ConfigError

ROW_INVARIANT = "speculant_row_invariant"
HARMLESS = frozenset({"sliding_window", "position_ids", "cache_position", "use_cache", "output_attentions"})
# what transformers passes that the mask, the rotated q and k or the cache carry already


@dataclass(frozen=True)
class Segment:
    """One sequence's new tokens inside a forward that runs several sequences as one (`hf.forward_rows`):
    tokens [start, start + n) of the input, appended to `cache` (that sequence's own), attending as
    `mask` says (None: causal over the cache and the new tokens; else a [1, 1, n, cached + n] mask)."""

    start: int
    n: int
    cache: Any  # a transformers Cache
    mask: torch.Tensor | None


def row_invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, segments: Sequence[Segment] | None = None,
                            softcap: float | None = None, is_causal: bool | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (batch 1): query [1, heads, q, d], key/value [1, kv_heads, k, d].

    `attention_mask` is None (causal: query i is the (k - q + i)-th position) or a 4D mask, boolean or
    additive, such as a token tree's (each node sees the cache before the tree and its ancestors).
    With `segments` the input holds several sequences' new tokens (key/value: theirs only, no cache
    given to the model): each segment's keys join its own cache and its queries attend there, exactly
    as in a forward of that sequence alone. `softcap` (Gemma 2): scores become softcap * tanh(score / softcap)
    before the softmax. Any other argument that would change the numbers (attention sinks: `s_aux`, `sinks`;
    `is_causal=False`) is refused, never dropped."""
    refused = sorted(name for name, value in kwargs.items() if name not in HARMLESS and value is not None)
    refused += ["is_causal=False"] if is_causal is False else []
    if refused:
        raise ConfigError(f"speculant's row-invariant attention does not compute {', '.join(refused)}, which "
                          f"{type(module).__name__} passes")
    if segments is not None:
        parts = []
        for s in segments:
            rows = slice(s.start, s.start + s.n)
            key_s, value_s = s.cache.update(key[:, :, rows], value[:, :, rows], module.layer_idx)
            parts.append(row_invariant_attention(module, query[:, :, rows], key_s, value_s, s.mask, scaling,
                                                 softcap=softcap)[0])
        return torch.cat(parts, dim=1), None
    if query.shape[0] != 1:
        raise ValueError("row-invariant attention runs one sequence at a time")
    q_len, k_len = query.shape[2], key.shape[2]
    rows = []
    for i in range(q_len):
        if attention_mask is None:
            visible = k_len - q_len + i + 1
        else:
            row = attention_mask[0, 0, i, :k_len]
            visible = (row if row.dtype == torch.bool else row == 0).nonzero().squeeze(1)
            if int(visible[-1]) + 1 == visible.numel():
                visible = visible.numel()  # a prefix of the cache
        if isinstance(visible, int):  # views: copying every prefix would cost more than attending to it
            key_i, value_i = key[:, :, :visible], value[:, :, :visible]
        else:
            key_i, value_i = key.index_select(2, visible), value.index_select(2, visible)
        rows.append(_attend(query[:, :, i : i + 1], key_i, value_i, scaling, softcap))
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
            softcap: float | None) -> torch.Tensor:
    """One query token's attention, query [1, heads, 1, d] over the keys and values it sees [1, kv_heads, k, d];
    scores soft-capped where `softcap` (which torch's fused attention does not do), as transformers' eager
    attention computes them (softmax in fp32)."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    if not softcap:
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=kv_heads != heads)
    grouped = query.reshape(1, kv_heads, heads // kv_heads, dim)  # the heads that share each kv head (repeat_kv's order)
    scores = grouped @ key.transpose(2, 3) * (scaling if scaling is not None else dim ** -0.5)
    weights = (torch.tanh(scores / softcap) * softcap).softmax(-1, dtype=torch.float32).to(value.dtype)
    return (weights @ value).view(1, heads, 1, dim)


AttentionInterface.register(ROW_INVARIANT, row_invariant_attention)


def use_row_invariant_attention(model: nn.Module) -> None:
    """Switch a transformers model to row-invariant attention."""
    model.set_attn_implementation(ROW_INVARIANT)
