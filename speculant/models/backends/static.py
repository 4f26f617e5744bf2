"""The static model: the catalog's decoder architectures (Llama, Qwen2, Mistral; RMSNorm, RoPE, GQA, SwiGLU,
sliding windows) on torch's own kernels, with a preallocated KV cache and a length pointer (gpt-fast's shape),
its step compiled with `torch.compile` and, on a GPU, replayed as a CUDA graph. It is the lean model's path for
devices where torch has the fast kernels (`models/backends/lean.py` is the CPU's, on speculant's 4-bit kernels); its
weights are a transformers model's (a catalog model's de-quantized once, or any checkpoint).

Exact by one width. A handle runs every call (a prompt, a decoding step, a verification, a tree) as chunks of
exactly `width` rows, the rest padded, so every row goes through the same kernels at the same shapes. Linear
layers, norms and rotary embeddings act per row; attention reads each row's visible keys in position order
through an index (a tree node's ancestors in depth order, laid out as decoding them one by one lays them out)
over the whole static span, the rest masked. So a row's logits never depend on what shares its call, and
verification reproduces decoding bit for bit in every dtype, compiled or not, whatever the device's matmuls do
between shapes. On a GPU a forward of 16 rows costs about what one costs (reading the weights bounds both), so
the fixed width is nearly free there; on a CPU T(W) grows with W, and `lean` is the backend to use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speculant.errors import ConfigError
from speculant.models.base import Backend, Capabilities, Interrupted, PointerCache
from speculant.models.windows import layer_windows
from speculant.trees.tree import TokenTree

ARCHITECTURES = ("llama", "qwen2", "mistral")
DEFAULT_SPAN = 2048  # positions a handle's cache holds when the model allows more
WIDTHS = (1, 2, 4, 8, 16, 32)  # the static widths a handle may run at


def default_width(device: torch.device) -> int:
    """16 rows on a GPU, where they cost about one (docs/results/gpu.md); 4 on a CPU."""
    return 16 if device.type == "cuda" else 4


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters.get("rope_type", "default") != "default":
        raise ConfigError(f"the static backend runs plain RoPE, not {parameters['rope_type']} scaling")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class _Layer(nn.Module):
    def __init__(self, source: nn.Module, window: int | None) -> None:
        super().__init__()
        attn, mlp = source.self_attn, source.mlp

        def fused(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = torch.cat([m.weight.detach() for m in linears])
            if all(m.bias is None for m in linears):
                return weight, None
            return weight, torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                                      for m in linears])

        self.window = window
        self.register_buffer("attn_norm", source.input_layernorm.weight.detach())
        self.register_buffer("ffn_norm", source.post_attention_layernorm.weight.detach())
        for name, linears in (("qkv", (attn.q_proj, attn.k_proj, attn.v_proj)), ("o", (attn.o_proj,)),
                              ("gate_up", (mlp.gate_proj, mlp.up_proj)), ("down", (mlp.down_proj,))):
            weight, bias = fused(*linears)
            self.register_buffer(f"w_{name}", weight)
            self.register_buffer(f"b_{name}", bias)


class StaticWeights(nn.Module):
    """A transformers model's weights in the static model's layout (q/k/v and gate/up fused), and its step:
    `forward(keys, values, ids, positions, slots, index)` runs `len(ids)` rows, writes their keys and values at
    `slots` of the caches ([layers, kv_heads, slots, head_dim]), lets row r attend to the cached positions
    0..positions[r] (within a sliding window), key j of row r read from slot index[r, j], and returns the
    rows' logits [rows, vocab] in the weights' dtype."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        if config.model_type not in ARCHITECTURES:
            raise ConfigError(f"the static backend runs {', '.join(ARCHITECTURES)}, not {config.model_type}")
        if getattr(config, "mlp_bias", False):
            raise ConfigError("the static backend runs MLPs without biases")
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.max_positions = config.max_position_embeddings
        self.vocab_size = model.get_output_embeddings().out_features
        self.model_type = config.model_type
        base = model.base_model
        self.layers = nn.ModuleList(_Layer(layer, window) for layer, window in zip(base.layers, layer_windows(config)))
        self.register_buffer("embedding", base.embed_tokens.weight.detach())
        self.register_buffer("norm", base.norm.weight.detach())
        self.register_buffer("head", model.get_output_embeddings().weight.detach())
        half = self.head_dim // 2
        inv_freq = _rope_theta(config) ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(self.max_positions + max(WIDTHS), dtype=torch.float64), inv_freq)
        device = self.embedding.device
        self.register_buffer("cos", angles.cos().float().to(device))  # [positions, head_dim / 2]
        self.register_buffer("sin", angles.sin().float().to(device))
        self.compile_seconds: float | None = None  # the first compiled step's compile time
        self._compiled: Any = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm (Zhang & Sennrich 2019) in float32, as transformers computes it."""
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE (Su et al. 2021, eq. 34) in transformers' layout: dimension i pairs with i + head_dim/2."""
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)

    def forward(self, keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows, span = index.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        x = self.embedding[ids]  # [rows, hidden]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        key_positions = torch.arange(span, device=ids.device)[None]
        seen = key_positions <= positions[:, None]  # [rows, span]
        for i, layer in enumerate(self.layers):
            qkv = F.linear(self._norm(x, layer.attn_norm), layer.w_qkv, layer.b_qkv)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q = self._rotate(q.view(rows, heads, dim), cos, sin) * dim ** -0.5
            keys[i, :, slots] = self._rotate(k.view(rows, kv_heads, dim), cos, sin).transpose(0, 1)
            values[i, :, slots] = v.view(rows, kv_heads, dim).transpose(0, 1)
            visible = seen if layer.window is None else seen & (key_positions > positions[:, None] - layer.window)
            q = q.view(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv_heads, rows, group, dim]
            scores = q @ keys[i][:, index].transpose(-1, -2)  # [kv_heads, rows, group, span]
            scores = scores.float().masked_fill(~visible[None, :, None], float("-inf"))
            attended = scores.softmax(-1).to(x.dtype) @ values[i][:, index]  # [kv_heads, rows, group, dim]
            x = x + F.linear(attended.transpose(0, 1).reshape(rows, heads * dim), layer.w_o, layer.b_o)
            gate, up = F.linear(self._norm(x, layer.ffn_norm), layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)  # SwiGLU (Shazeer 2020)
        return F.linear(self._norm(x, self.norm), self.head)

    def compiled(self) -> Any:
        """The step under `torch.compile` (inductor; one graph per width and span), made once per weights.
        Inductor keeps what it compiled in its cache directory, so a later process compiles faster."""
        if self._compiled is None:
            self._compiled = torch.compile(self.forward, fullgraph=True, dynamic=False)
        return self._compiled


class StaticCausalLM(PointerCache, Backend):
    """A CausalLM (see models/base.py) on StaticWeights: a static KV cache of `span` positions (plus `width` slots
    that padded rows write), every call run as chunks of `width` rows; with `compiled`, the step compiled and, on
    CUDA, captured once per handle as a CUDA graph that each chunk replays."""

    backend = "static"
    capabilities = Capabilities(shares_weights=True, prefills_in_parts=True, interruptible=True,
                                sliding_window=True)  # rows: not yet

    def draft_model(self, spec: Any, dtype: str | None) -> Any:
        from speculant.models.loading import transformers_drafter

        return transformers_drafter(self, spec, dtype, "static")

    def __init__(self, weights: StaticWeights, tokenizer: Any | None = None, name: str | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), identity: str | None = None,
                 span: int | None = None, width: int | None = None, compiled: bool = False) -> None:
        self.weights, self.tokenizer, self.identity = weights, tokenizer, identity
        self.name = name or weights.model_type
        self.eos_token_ids, self.vocab_size = eos_token_ids, weights.vocab_size
        self.device, self.dtype = weights.device, weights.dtype
        self.width = width or default_width(self.device)
        if self.width not in WIDTHS:
            raise ConfigError(f"the static backend's width is one of {', '.join(map(str, WIDTHS))}, not {self.width}")
        self.max_positions = self.span = min(span or DEFAULT_SPAN, weights.max_positions)
        self.compiled = compiled
        self.kernel = ("CUDA graph" if self.device.type == "cuda" else "inductor") if compiled else "torch eager"
        self.numerics = f"static {str(self.dtype).removeprefix('torch.')} x{self.width}"  # rows of one width
        self.interrupt = None  # checked between chunks
        shape = (len(weights.layers), weights.kv_heads, self.span + self.width, weights.head_dim)
        self._keys = torch.zeros(shape, dtype=self.dtype, device=self.device)  # zeros: masked keys stay finite
        self._values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._rows = torch.zeros(3, self.width, dtype=torch.long, device=self.device)  # ids, positions, slots
        self._index = torch.arange(self.span, device=self.device).repeat(self.width, 1)  # row r's key j: slot j
        self._index_moved = False  # a tree's chunk left the index other than the identity
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self._len = 0

    def __repr__(self) -> str:
        return f"StaticCausalLM({self.name!r}, {self.numerics}, device={self.device}, compiled={self.compiled})"

    def share(self) -> StaticCausalLM:
        """Another handle on the same weights with a cache of its own."""
        return StaticCausalLM(self.weights, self.tokenizer, self.name, self.eos_token_ids, self.identity,
                              self.span, self.width, self.compiled)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self._len = 0
        return self._run(list(ids), None, None)[-1]

    @torch.inference_mode()
    def continue_prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """A part of a prompt (`prefill_parts`): run apart, the parts give one prefill's bits, every row being
        computed as its token alone would be."""
        return self._run(list(ids), None, None)[-1]

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        """With `tree`, `ids` are its last len(ids) nodes, its earlier nodes the last cached positions; each node
        attends to the cache before the tree and its own ancestors."""
        if tree is None:
            if positions is not None and list(positions) != list(range(self._len, self._len + len(ids))):
                raise ValueError("the static backend places a chain's tokens right after the cache")
            return self._run(list(ids), None, None)
        first = len(tree) - len(ids)
        root = self._len - first  # cache position of the tree's root
        if first < 0 or root < 0 or list(ids) != list(tree.tokens[first:]):
            raise ValueError("ids must be the last nodes of the tree, with the earlier ones cached")
        return self._run(list(ids), tree, root)

    def _run(self, ids: list[int], tree: TokenTree | None, root: int | None) -> torch.Tensor:
        if self._len + len(ids) > self.span:
            raise ValueError(f"{self._len + len(ids)} positions exceed the static cache of {self.span}")
        width, out, begin = self.width, [], self._len
        for at in range(0, len(ids), width):
            if self.interrupt is not None and self.interrupt():
                self._len = begin  # the cache as it was before this forward
                raise Interrupted()
            chunk = ids[at:at + width]
            start, n = self._len, len(chunk)
            slots = np.arange(start, start + width)
            if tree is None:
                positions, index = slots, None
            else:
                first = len(tree) - len(ids) + at  # the chunk's first node
                depths = tree.depths[first:first + n]
                positions = np.concatenate([root + np.asarray(depths), slots[n:]])
                index = np.tile(np.arange(self.span), (width, 1))
                for r, node in enumerate(range(first, first + n)):
                    path = root + tree.ancestor_mask[node].nonzero().squeeze(1).numpy()  # ascending, itself last
                    index[r, root:root + len(path)] = path
            # a copy: a CUDA graph's output buffer is rewritten by its next replay
            out.append(self._step(chunk + [0] * (width - n), positions, slots, index)[:n].to(torch.float32, copy=True))
            self._len += n
        logits = torch.cat(out)
        if self.device.type == "cuda":  # return once computed, so that a timer around a forward is honest
            torch.cuda.synchronize(self.device)
        return logits

    def _step(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, index: np.ndarray | None
              ) -> torch.Tensor:
        """One chunk of `width` rows through the step (the CUDA graph where one is captured): its inputs copied
        into the handle's buffers, the key index only where a tree moved it or moves it now."""
        self._rows.copy_(torch.from_numpy(np.stack([np.asarray(ids), positions, slots]).astype(np.int64)))
        if index is not None:
            self._index.copy_(torch.from_numpy(index))
        elif self._index_moved:
            self._index.copy_(torch.arange(self.span, device=self.device).expand(self.width, -1))
        self._index_moved = index is not None
        if not self.compiled:
            return self.weights(self._keys, self._values, *self._inputs)
        step = self.weights.compiled()
        if self.device.type != "cuda":
            return self._timed(step)
        if self._graph is None:
            self._graph, self._out = self._capture(step)
        self._graph.replay()
        return self._out

    @property
    def _inputs(self) -> tuple[torch.Tensor, ...]:
        """The step's inputs after the caches: ids, positions, slots, index."""
        return (*self._rows, self._index)

    def _timed(self, step: Any) -> torch.Tensor:
        """A compiled step; the first one's time (mostly compiling) is kept on the weights."""
        if self.weights.compile_seconds is not None:
            return step(self._keys, self._values, *self._inputs)
        began = time.perf_counter()
        out = step(self._keys, self._values, *self._inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.weights.compile_seconds = time.perf_counter() - began
        return out

    def _capture(self, step: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step as a CUDA graph over this handle's cache and input buffers, after warm-up runs on a side
        stream (they compile it, and write what the captured chunk writes)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._timed(step)
            step(self._keys, self._values, *self._inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(self._keys, self._values, *self._inputs)
        return graph, out
