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

Batch rows for the same reason: the caches of every handle on a set of weights are regions of one pool
(`KVPool`), each row reads its own region through the index, and a step's `width` rows may belong to several
sequences (`forward_rows`, what a server runs), each row computed as it would be alone.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speculant.errors import ConfigError
from speculant.models.base import Backend, Call, Capabilities, Interrupted, PointerCache
from speculant.models.windows import layer_windows
from speculant.trees.levels import grow
from speculant.trees.tree import TokenTree

ARCHITECTURES = ("llama", "qwen2", "mistral")
DEFAULT_SPAN = 2048  # positions a handle's cache holds when the model allows more
WIDTHS = (1, 2, 4, 8, 16, 32)  # the static widths a handle may run at
GROWTH = 4  # a full pool's growth: 1, 4, 16, 64, 256, 1024 regions
CAPTURING = threading.Lock()  # torch allows one CUDA graph capture underway at a time in a process
GRAPHS = 64  # the graphs torch.compile may make of one function here (`compile_graphs`): every pool's step (one per
# weights, width and pool size) is a graph of `StaticWeights.forward`'s, and every draft graph (one per depth, width and
# pool size; compiled depths are powers of two) one of `StaticWeights.draft`'s. On a GPU the levels run the step's own
# graph (`KVPool.levels_in_steps`): nothing more compiles, and each depth and width drafted is a CUDA graph.


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
    `forward(keys, values, ids, positions, slots, index, offsets)` runs `len(ids)` rows, writes their keys and
    values at `slots` of the caches ([layers, kv_heads, slots, head_dim]), lets row r attend to the cached
    positions 0..positions[r] (within a sliding window), key j of row r read from slot offsets[r] + index[r, j]
    (each row's sequence a region of the caches, `KVPool`), and returns the rows' logits [rows, vocab] in the
    weights' dtype and their last layer's output [rows, hidden] (what Yggdrasil's depth predictor reads)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        if config.model_type not in ARCHITECTURES:
            raise ConfigError(f"the static backend runs {', '.join(ARCHITECTURES)}, not {config.model_type}")
        if getattr(config, "mlp_bias", False):
            raise ConfigError("the static backend runs MLPs without biases")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"the static backend runs SiLU-gated MLPs, not {config.hidden_act}'s")
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
        self._compiled_draft: Any = None
        self.pools: dict[tuple[int, int, bool], KVPool] = {}  # (span, width, compiled) -> its handles' caches

    def pool(self, span: int, width: int, compiled: bool) -> KVPool:
        """The pool whose regions hold the caches of the handles of this span, width and compilation."""
        if (span, width, compiled) not in self.pools:
            self.pools[span, width, compiled] = KVPool(self, span, width, compiled)
        return self.pools[span, width, compiled]

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
                slots: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        rows, span = index.shape
        index = (index + offsets[:, None]).flatten()  # (flat for index_select: eager, cheaper than advanced indexing)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        x = self.embedding[ids]  # [rows, hidden]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        key_positions = torch.arange(span, device=ids.device)[None]
        seen = key_positions <= positions[:, None]  # [rows, span]
        # The caches are written by index_put_ on the whole tensors: written through a view (`keys[i, :, slots] = k`),
        # compiled (functionalized) code scatters the view back into a copy of the whole pool, once per layer.
        layer_at = torch.arange(len(self.layers), device=ids.device)
        kv_at = torch.arange(kv_heads, device=ids.device)[:, None]
        for i, layer in enumerate(self.layers):
            qkv = F.linear(self._norm(x, layer.attn_norm), layer.w_qkv, layer.b_qkv)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q = self._rotate(q.view(rows, heads, dim), cos, sin) * dim ** -0.5
            written = (layer_at[i], kv_at, slots)  # [kv_heads, rows] of layer i
            keys.index_put_(written, self._rotate(k.view(rows, kv_heads, dim), cos, sin).transpose(0, 1))
            values.index_put_(written, v.view(rows, kv_heads, dim).transpose(0, 1))
            visible = seen if layer.window is None else seen & (key_positions > positions[:, None] - layer.window)
            q = q.view(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv_heads, rows, group, dim]
            cached_keys = keys[i].index_select(1, index).view(kv_heads, rows, span, dim)
            scores = q @ cached_keys.transpose(-1, -2)  # [kv_heads, rows, group, span]
            scores = scores.float().masked_fill(~visible[None, :, None], float("-inf"))
            cached_values = values[i].index_select(1, index).view(kv_heads, rows, span, dim)
            attended = scores.softmax(-1).to(x.dtype) @ cached_values  # [kv_heads, rows, group, dim]
            x = x + F.linear(attended.transpose(0, 1).reshape(rows, heads * dim), layer.w_o, layer.b_o)
            gate, up = F.linear(self._norm(x, layer.ffn_norm), layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)  # SwiGLU (Shazeer 2020)
        return F.linear(self._norm(x, self.norm), self.head), x

    def compiled(self) -> Any:
        """The step under `torch.compile` (inductor; one graph per width, span and pool size), made once per weights.
        Inductor keeps what it compiled in its cache directory, so a later process compiles faster."""
        if self._compiled is None:
            self._compiled = compile_graphs(self.forward)
        return self._compiled

    def draft(self, keys: torch.Tensor, values: torch.Tensor, root_logits: torch.Tensor, root: torch.Tensor,
              offset: torch.Tensor, depth: int, width: int, rows: int, span: int,
              forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An equal-growth tree below the root cached at `root` of the region at `offset` (`trees.levels.grow`), its
        levels run as steps of `rows` rows by `forward` (this module's own by default: what `compiled_draft` makes
        one graph of; or the compiled step, whose inputs are then laid out as the pool's steps lay out theirs, so
        that it runs the graph compiled for them)."""
        forward = forward or self.forward

        def step(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return forward(keys, values, ids, positions, offset + slots, index, offset.repeat(rows))[0]

        return grow(step, root_logits, root, depth, width, rows, span)

    def compiled_draft(self) -> Any:
        """`draft` under `torch.compile`: a tree's levels as one graph (one per depth, width and shape of the pool)."""
        if self._compiled_draft is None:
            self._compiled_draft = compile_graphs(self.draft)
        return self._compiled_draft


def compile_graphs(fn: Callable[..., Any]) -> Any:
    """`fn` under torch.compile, one full graph per shape, GRAPHS of them allowed. torch.compile's limit of
    recompilations (8 by default; past it, a full graph fails) counts per code object, so the graphs of every
    StaticWeights count together. The limit is the function's own where torch.compile takes one (the process's other
    compiled functions keep theirs); with an older torch the process's is raised to GRAPHS (patched around each call
    instead, it would not be per thread there, and a stage drafter's thread compiles beside the decoder's)."""
    if compile_takes_limit():
        return torch.compile(fn, fullgraph=True, dynamic=False, recompile_limit=GRAPHS)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # (torch < 2.6)
    setattr(config, name, max(getattr(config, name), GRAPHS))
    return torch.compile(fn, fullgraph=True, dynamic=False)


def compile_takes_limit() -> bool:
    """Whether this torch's `torch.compile` takes a `recompile_limit` of the compiled function's own (asked at each
    call: a test stands an older signature in)."""
    return "recompile_limit" in inspect.signature(torch.compile).parameters


@dataclass(frozen=True)
class _Row:
    """One row of a step: a handle's token, its position, its slot in the handle's region and, for a tree node, the
    region's slots its keys are read from (None: slot j for key j)."""

    handle: StaticCausalLM
    token: int
    position: int
    slot: int
    index: np.ndarray | None = None


class KVPool:
    """The KV caches of every handle of one span, width and compilation on a StaticWeights: regions of one pair of
    tensors ([layers, kv_heads, regions x (span + width), head_dim]; a region's last `width` slots are written by
    padded rows), so that one step runs rows of several handles (`forward_rows`), each row reading only its own
    region. A handle takes a region when made and gives it back when dropped; where none is free the pool grows
    fourfold (`GROWTH`: each size is a compiled step of its own and a CUDA graph captured again, so few sizes). The
    step's input buffers, and on a GPU its one CUDA graph, are the pool's: a solo call and a batch run the same step
    at the same shapes, so a row's bits never depend on its company."""

    def __init__(self, weights: StaticWeights, span: int, width: int, compiled: bool) -> None:
        self.weights, self.span, self.width, self.compiled = weights, span, width, compiled
        self.stride = span + width
        self.device, self.dtype = weights.device, weights.dtype
        self.capacity, self.free = 0, []
        self._given: queue.SimpleQueue[int] = queue.SimpleQueue()  # regions handed back, not yet in `free`
        self.keys = self.values = torch.empty(0)
        with torch.inference_mode():  # (as a draft's levels make theirs: they then run the graph compiled for steps)
            self._rows = torch.zeros(4, width, dtype=torch.long, device=self.device)  # ids, positions, slots, offsets
            self._index = torch.arange(span, device=self.device).repeat(width, 1)  # row r's key j: slot j of its region
        self._index_moved = False  # a tree's step left the index other than the identity
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._root = torch.zeros(2, dtype=torch.long, device=self.device)  # a tree's root position and region offset
        self._root_logits = torch.zeros(weights.vocab_size, device=self.device)  # the drafter's logits at the root
        self._drafts: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Any]] = {}  # (depth, width): a CUDA graph
        # A compiled tree's levels each run by the compiled step, not compiled together (one inductor graph unrolls
        # depth x layers: on a GPU the 0.5B's depth-4 graph compiled for minutes); on a GPU the levels and the
        # choices between them are one CUDA graph all the same.
        self.levels_in_steps = self.device.type == "cuda"
        self.lock = threading.RLock()  # steps, the regions' bookkeeping, and a handle's work on its region
        # on a GPU: recorded after each step's work on its thread's stream (not yet recorded, it is waited for at once)
        self._done = torch.cuda.Event() if self.device.type == "cuda" else None

    def take(self) -> int:
        with self.lock:
            self.reserve(1)
            return self.free.pop()

    def reserve(self, regions: int) -> None:
        """Grow, by fourfold steps (a full pool's growth), to hold `regions` more than are taken."""
        with self.lock:
            while not self._given.empty():
                self.free.append(self._given.get())
            wanted, capacity = self.capacity - len(self.free) + regions, max(self.capacity, 1)
            while capacity < wanted:
                capacity *= GROWTH
            if capacity > self.capacity:
                self._grow(capacity)

    def give(self, region: int) -> None:
        """Hand a region back without waiting for the lock: a handle's finalizer may run on any thread at any
        allocation, e.g. in the garbage collection `torch.cuda.graph` starts while another pool's capture holds
        `CAPTURING` and this pool's step waits for it."""
        self._given.put(region)

    def _grow(self, capacity: int) -> None:
        shape = (len(self.weights.layers), self.weights.kv_heads, capacity * self.stride, self.weights.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)  # zeros: masked keys stay finite
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            used = self.capacity * self.stride
            self._follow()  # (after the steps that wrote them, on whichever stream; freed once copied)
            keys[:, :, :used], values[:, :, :used] = self.keys, self.values
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        self.keys, self.values = keys, values
        self.free = list(range(capacity - 1, self.capacity - 1, -1)) + self.free
        self.capacity, self._graph = capacity, None  # (graphs over the old tensors: captured again)
        self._drafts.clear()

    def region(self, region: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A region's keys and values (views: written in place)."""
        at = region * self.stride
        return self.keys[:, :, at:at + self.span], self.values[:, :, at:at + self.span]

    @torch.inference_mode()
    def run(self, rows: Sequence[_Row], interrupt: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' logits [len(rows), vocab] in float32 and last layer's outputs [len(rows), hidden], `width`
        rows a step in order (a sequence's rows in its calls' order: later ones read the keys earlier ones wrote),
        padded; `interrupt` checked between steps."""
        logits, hidden = [], []
        for at in range(0, len(rows), self.width):
            if interrupt is not None and interrupt():
                raise Interrupted()
            chunk = rows[at:at + self.width]
            with self.ordered():  # one step at a time through the pool's buffers (a drafter's thread shares them)
                out, x = self._step(chunk)  # copies: a CUDA graph's output buffers are rewritten by its next replay
                logits.append(out[:len(chunk)].to(torch.float32, copy=True))
                hidden.append(x[:len(chunk)].clone())
        if self.device.type == "cuda":  # return once computed (this thread's stream: a timer around it is honest)
            torch.cuda.current_stream(self.device).synchronize()
        return torch.cat(logits), torch.cat(hidden)

    @contextmanager
    def ordered(self) -> Iterator[None]:
        """The pool's lock, and on a GPU work queued on this thread's stream after the pool's last work (`_follow`) and
        marked as its last (`_mark`): a step, a tree's levels, or a handle's work on its region's storage."""
        with self.lock:
            self._follow()
            try:
                yield
            finally:
                self._mark()

    def _follow(self) -> None:
        """On a GPU, queue the next step after the pool's last one: another thread's stream (stage scheduling's
        drafter, drafting for itself) may have queued it, and the two share the input buffers and CUDA graphs."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)

    def _mark(self) -> None:
        if self._done is not None:  # (a wait queued before this record still waits for the record before it)
            self._done.record(torch.cuda.current_stream(self.device))

    @torch.inference_mode()
    def draft(self, handle: StaticCausalLM, root_logits: torch.Tensor, depth: int,
              width: int) -> tuple[list[int], list[int], list[float]]:
        """An equal-growth tree below `handle`'s last cached token, its levels in one call (`StaticWeights.draft`;
        compiled: one inductor graph of every level, or on a GPU each level the compiled step, captured together as
        one CUDA graph per depth and width): tokens, parents, path log-probabilities."""
        with self.ordered():
            self._root.copy_(torch.tensor([handle.cache_len - 1, handle.offset]))
            self._root_logits.copy_(root_logits)

            def run() -> tuple[torch.Tensor, ...]:
                args = (self.keys, self.values, self._root_logits, *self._root, depth, width, self.width, self.span)
                if not self.compiled:
                    return self.weights.draft(*args)
                if self.levels_in_steps:
                    return self.weights.draft(*args, forward=self.weights.compiled())
                return self.weights.compiled_draft()(*args)

            if not self.compiled or self.device.type != "cuda":
                out = run()
            else:
                if (depth, width) not in self._drafts:
                    self._drafts[depth, width] = self._capture(run)
                graph, out = self._drafts[depth, width]
                graph.replay()
            tokens, parents, scores = (tensor.tolist() for tensor in out)  # (read before another replay rewrites them)
        return tokens, parents, scores

    def _step(self, chunk: Sequence[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of `width` rows (the CUDA graph where one is captured): its inputs copied into the pool's
        buffers, the key index (one copy) only where a tree moves it or moved it."""
        first = chunk[0].handle.offset  # padded rows write the first row's region's last slots
        inputs = np.array([(row.token, row.position, row.handle.offset + row.slot, row.handle.offset)
                           for row in chunk] +
                          [(0, self.span + r, first + self.span + r, first) for r in range(len(chunk), self.width)],
                          dtype=np.int64).T
        trees = [(r, row.index) for r, row in enumerate(chunk) if row.index is not None]
        if trees or self._index_moved:
            index = np.tile(np.arange(self.span), (self.width, 1))
            for r, rows_index in trees:
                index[r] = rows_index
            self._index.copy_(torch.from_numpy(index))
            self._index_moved = bool(trees)
        self._rows.copy_(torch.from_numpy(inputs))
        if not self.compiled:
            return self.weights(self.keys, self.values, *self._inputs)
        step = self.weights.compiled()
        if self.device.type != "cuda":
            return self._timed(step)
        if self._graph is None:
            self._graph, self._out = self._capture(lambda: self._timed(step))
        self._graph.replay()
        return self._out

    @property
    def _inputs(self) -> tuple[torch.Tensor, ...]:
        """The step's inputs after the caches: ids, positions, slots, index, offsets."""
        ids, positions, slots, offsets = self._rows
        return ids, positions, slots, self._index, offsets

    def _timed(self, step: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A compiled step; the first one's time (mostly compiling) is kept on the weights."""
        if self.weights.compile_seconds is not None:
            return step(self.keys, self.values, *self._inputs)
        began = time.perf_counter()
        out = step(self.keys, self.values, *self._inputs)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.weights.compile_seconds = time.perf_counter() - began
        return out

    def _capture(self, run: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """`run` (a step, or a tree's draft levels, over the pool's caches and input buffers) as a CUDA graph, after two
        warm-up runs on a side stream (they compile it, and write what the captured run writes); its outputs."""
        # High priority: a stream from the pool apart from the default-priority streams (a stage drafter's among them)
        # that torch hands out in turn, so no other thread queues work on the stream being captured.
        stream = torch.cuda.Stream(self.device, priority=-1)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with CAPTURING, torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):  # (others run on)
            out = run()
        return graph, out


class StaticCausalLM(PointerCache, Backend):
    """A CausalLM (see models/base.py) on StaticWeights: a static KV cache of `span` positions, a region of its
    weights' `KVPool`, every call run as steps of `width` rows; with `compiled`, the step compiled and, on CUDA,
    captured as a CUDA graph that each step replays. Handles on the same weights batch their rows
    (`forward_rows`)."""

    backend = "static"
    capabilities = Capabilities(shares_weights=True, batches_rows=True, prefills_in_parts=True, interruptible=True,
                                fixed_cache=True, hidden_states=True, drafts_trees=True, reuses_prefixes=True)
    prefix_block = 1  # any position of a prompt may be restored: every row of a call is its token's one-row bits

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
        self.interrupt = None  # checked between steps
        self.pool = weights.pool(self.span, self.width, compiled)
        self._region = self.pool.take()
        weakref.finalize(self, self.pool.give, self._region)
        self._len = 0
        self.last_hidden: torch.Tensor | None = None  # the last call's rows of the last layer (`hidden_states`)

    def __repr__(self) -> str:
        return f"StaticCausalLM({self.name!r}, {self.numerics}, device={self.device}, compiled={self.compiled})"

    @property
    def offset(self) -> int:
        """Where its region starts in the pool's caches."""
        return self._region * self.pool.stride

    @property
    def _keys(self) -> torch.Tensor:
        return self.pool.region(self._region)[0]

    @property
    def _values(self) -> torch.Tensor:
        return self.pool.region(self._region)[1]

    @property
    def weights_key(self) -> int:
        return id(self.pool)

    def rows_forward(self) -> Any:
        """`forward_rows` (see CausalLM)."""
        return forward_rows

    def reserve(self, handles: int) -> None:
        """A compiled handle's pool grows now to hold them: each size of a pool is a step compiled and, on a GPU,
        captured again, which a server's worker would otherwise do under load, every request waiting. An eager
        pool grows when a handle is made (a copy), holding no memory before."""
        if self.compiled:
            self.pool.reserve(handles)

    def share(self) -> StaticCausalLM:
        """Another handle on the same weights with a cache of its own (a region of the same pool)."""
        return StaticCausalLM(self.weights, self.tokenizer, self.name, self.eos_token_ids, self.identity,
                              self.span, self.width, self.compiled)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self._len = 0
        return self._run(self._place(list(ids), None), prompt=True)[-1]

    @torch.inference_mode()
    def continue_prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """A part of a prompt (`prefill_parts`): run apart, the parts give one prefill's bits, every row being
        computed as its token alone would be."""
        return self._run(self._place(list(ids), None), prompt=True)[-1]

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        """With `tree`, `ids` are its last len(ids) nodes, its earlier nodes the last cached positions; each node
        attends to the cache before the tree and its own ancestors."""
        rows = self._place(list(ids), tree, positions)
        return self._run(rows) if rows else torch.empty(0, self.vocab_size, device=self.device)

    def keep(self, kept: int, path: Sequence[int]) -> None:
        with self.pool.ordered():  # (the pool growing on another thread moves every region's storage)
            super().keep(kept, path)

    def export_kv(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.pool.ordered():
            return super().export_kv(start, end)

    def import_kv(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with self.pool.ordered():
            super().import_kv(pieces)

    def compile_seconds(self) -> float | None:
        return self.weights.compile_seconds

    def draft_tree(self, root_logits: torch.Tensor, depth: int, width: int) -> tuple[list[int], list[int], list[float]]:
        """`drafts_trees` (see Capabilities): the pool's `draft`. Where its levels compile together, the tree is grown
        to the next power of two of `depth` where the cache has room and cut to `depth` levels (equal growth's first
        levels do not depend on later ones), so that a few graphs serve every depth: each graph compiles its levels
        unrolled."""
        grown = 2 ** (depth - 1).bit_length() if self.compiled and not self.pool.levels_in_steps else depth
        if self._len + (grown - 1) * width > self.span:  # (no room to grow: the depth asked)
            grown = depth
        if self._len + (grown - 1) * width > self.span:
            raise ValueError(f"{self._len + (grown - 1) * width} positions exceed the static cache of {self.span}")
        tokens, parents, scores = self.pool.draft(self, root_logits, grown, width)
        self._len += (grown - 1) * width  # (the levels it ran; a DraftCache drops them at its next run)
        self.last_hidden = None
        nodes = 1 + depth * width
        return tokens[:nodes], parents[:nodes], scores[:nodes]

    def _place(self, ids: list[int], tree: TokenTree | None, positions: Sequence[int] | None = None) -> list[_Row]:
        """A call's rows, after the cached positions: a chain's at consecutive positions, a tree's nodes at their
        root's position plus their depth, each reading its ancestors' keys in depth order."""
        start = self._len
        if start + len(ids) > self.span:
            raise ValueError(f"{start + len(ids)} positions exceed the static cache of {self.span}")
        if tree is None:
            if positions is not None and list(positions) != list(range(start, start + len(ids))):
                raise ValueError("the static backend places a chain's tokens right after the cache")
            return [_Row(self, token, start + i, start + i) for i, token in enumerate(ids)]
        first = len(tree) - len(ids)
        root = start - first  # cache position of the tree's root
        if first < 0 or root < 0 or list(ids) != list(tree.tokens[first:]):
            raise ValueError("ids must be the last nodes of the tree, with the earlier ones cached")
        if positions is not None and list(positions) != tree.positions(root)[first:]:
            raise ValueError("tree nodes run at their root's position plus their depth")
        rows = []
        for i, node in enumerate(range(first, len(tree))):
            index = np.arange(self.span)
            path = root + tree.ancestor_mask[node].nonzero().squeeze(1).numpy()  # ascending, itself last
            index[root:root + len(path)] = path
            rows.append(_Row(self, ids[i], root + tree.depths[node], start + i, index))
        return rows

    def _run(self, rows: list[_Row], prompt: bool = False) -> torch.Tensor:
        logits, hidden = self.pool.run(rows, self.interrupt)  # (interrupted: the cache as it was before this forward)
        self._ran(len(rows), hidden, prompt)
        return logits

    def _ran(self, n: int, hidden: torch.Tensor, prompt: bool) -> None:
        """After a call of `n` rows, alone or in a batch: the cache holds them; `last_hidden` their last layer's rows
        (a prompt's last only: not a view keeping the prompt's rows)."""
        self._len += n
        self.last_hidden = hidden[-1:].clone() if prompt else hidden


def forward_rows(rows: Sequence[tuple[StaticCausalLM, Call]]) -> list[torch.Tensor]:
    """One forward for several sequences on the same weights, each a (handle, call) row with a region of the pool
    for its cache; each gets what its call returns alone (a prefill: its last token's logits [vocab]; a forward:
    one row per token [n, vocab]), bit for bit: every step runs `width` rows whatever they belong to, and a row
    reads only its own region."""
    pool = rows[0][0].pool
    if any(handle.pool is not pool for handle, _ in rows):
        raise ValueError("forward_rows needs handles on the same weights, span, width and compilation")
    if len({id(handle) for handle, _ in rows}) < len(rows):
        raise ValueError("forward_rows takes one call per handle")
    if any(call.prefill and not call.ids for _, call in rows):
        raise ValueError("prefill needs at least one token")
    placed = []
    with torch.inference_mode():
        for handle, call in rows:
            if call.prefill and not call.resumes:
                handle.rollback(0)
            placed.append(handle._place(list(call.ids), call.tree, call.positions))
        logits, hidden = pool.run([row for calls in placed for row in calls])
    out, at = [], 0
    for (handle, call), calls in zip(rows, placed):
        mine = logits[at:at + len(calls)]
        out.append(mine[-1] if call.prefill else mine if call.rows is None else mine[max(len(mine) - call.rows, 0):])
        handle._ran(len(calls), hidden[at:at + len(calls)], call.prefill)
        at += len(calls)
    return out
