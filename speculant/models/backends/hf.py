"""CausalLM backend over any transformers causal LM, with a DynamicCache."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from copy import deepcopy
from functools import partial
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel

from speculant.errors import ConfigError
from speculant.models.base import Backend, Call, Capabilities, Interrupted, checked_path
from speculant.models.numerics.exact import make_exact
from speculant.models.windows import layer_windows
from speculant.trees.tree import TokenTree

# Attention kernels on CUDA. cuDNN's (torch's first choice on Hopper) builds a plan for every new
# sequence length - once per decoding step, which costs more than the step (CHANGELOG.md: 35 ms a step on an H100).
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which `model.forward` takes its KV cache: `cache` since transformers 5.x renamed
    `past_key_values` (accepted with a warning until 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def model_name(model: PreTrainedModel) -> str:
    """What a transformers model object is called where no name was given: its checkpoint's, else its class's."""
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def eos_ids(model: PreTrainedModel, tokenizer: Any | None) -> frozenset[int]:
    """Every token id that ends generation: the generation config's, the model config's, the tokenizer's."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (generation_config, model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


_running = threading.local()  # the interrupt check of the forward this thread runs (handles share modules), and
# the base model's last hidden state of it


def _check_interrupt(module: torch.nn.Module, args: Any) -> None:
    check = getattr(_running, "check", None)
    if check is not None and check():
        raise Interrupted


def _keep_hidden(module: torch.nn.Module, args: Any, output: Any) -> None:
    _running.hidden = output[0]


def make_interruptible(model: PreTrainedModel) -> None:
    """A check before every decoder layer: a forward whose handle has an `interrupt` stops there; and the base
    model's output kept for the handle (`last_hidden`: the one state transformers' outputs would hold of all)."""
    depth = model.config.num_hidden_layers
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth), None)
    for layer in layers if layers is not None else []:
        layer.register_forward_pre_hook(_check_interrupt)
    model.base_model.register_forward_hook(_keep_hidden)


def private_copy(model: PreTrainedModel) -> PreTrainedModel:
    """New module objects around the same weight tensors: what a backend may rewire (linear layers,
    attention) without touching the caller's model."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return deepcopy(model, memo)


class HFCausalLM(Backend):
    """A transformers model and the KV cache of one sequence.

    Rollback only shortens the cache; `forward` never re-runs cached positions. The backend works on
    a private copy of the model's modules (sharing its weights), whose bf16/fp32 linear layers and
    attention it swaps for batch-invariant ones (`exact.py`): a token's logits do not depend on how many
    tokens share its forward, so verification reproduces decoding bit for bit.
    """

    backend = "hf"
    capabilities = Capabilities(shares_weights=True, batches_rows=True, prefills_in_parts=True, interruptible=True,
                                hidden_states=True, reuses_prefixes=True,
                                replicates=True, quantizes_self=True)

    def catalog_drafter_spec(self, drafter: str) -> str:
        """Quantized to int8 where speculant's AMX int8 kernel runs (its cost stays flat over the several tokens a
        drafter catches up on after an accepted draft), to int4 elsewhere."""
        from speculant.models.numerics import native

        return f"{drafter}@{'int8' if native.AMX.library() is not None else 'int4'}"

    def draft_model(self, spec: Any, dtype: str | None) -> Any:
        from speculant.models.loading import transformers_drafter

        return transformers_drafter(self, spec, dtype, "hf")

    def replicas(self, servers: int, drafting: bool) -> Callable[[str], HFCausalLM]:
        """The weights shared, not copied: threads share the module, processes receive it through shared memory."""
        return partial(hf_replica, self.model, self.name, self.eos_token_ids)

    def self_drafter(self, spec: Any) -> Any:
        if spec.quant:
            from speculant.models.loading import quantized_copy

            return quantized_copy(self, spec.quant)
        return super().self_drafter(spec)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any | None = None,
        name: str | None = None,
        extra_eos: frozenset[int] = frozenset(),
        identity: str | None = None,
        kernel: str | None = None,
    ):
        if kernel is None:  # a new model: rewire a private copy; else another handle on a backend's modules
            model = private_copy(model).eval()
            kernel = make_exact(model) or "quantized"
            make_interruptible(model)
        self.model = model
        self.kernel = kernel  # the batch-invariant linear kernel
        self.tokenizer = tokenizer
        self.name = name or model_name(model)
        self.identity = identity  # what the weights are when loaded by name: machine profiles persist per identity
        self.vocab_size = model.get_output_embeddings().out_features  # width of a logits row
        self.eos_token_ids = eos_ids(model, tokenizer) | extra_eos
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        self.numerics = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(model.dtype, str(model.dtype))
        self.window, self.mixed = attention_window(model.config)
        self._cache = DynamicCache()  # every layer keeps every position: rollback crops it, the window is a mask
        self._cache_argument = cache_argument(model)
        self._len = 0
        self.interrupt: Callable[[], bool] | None = None  # see CausalLM; checked before every decoder layer
        self.last_hidden: torch.Tensor | None = None  # the last call's rows of the last hidden state (`hidden_states`)

    def __repr__(self) -> str:
        return f"HFCausalLM({self.name!r}, dtype={self.model.dtype}, device={self.device})"

    @property
    def weights_key(self) -> int:
        return id(self.model)

    def rows_forward(self) -> Any:
        """`forward_rows` where this architecture's rows batch, else None (see CausalLM)."""
        return forward_rows if batches_rows(self) else None

    def share(self) -> HFCausalLM:
        """Another handle on the same weights with a cache of its own (e.g. a model drafting for itself)."""
        return HFCausalLM(self.model, self.tokenizer, self.name, self.eos_token_ids, self.identity, self.kernel)

    @property
    def cache_len(self) -> int:
        return self._len

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return self.prefill_by_parts(ids)

    @torch.inference_mode()
    def continue_prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """A later part of a prompt after the parts before it; the logits of its last token."""
        return self.catch_up(ids)[0]

    @torch.inference_mode()
    def catch_up(self, ids: Sequence[int], rows: int = 1) -> torch.Tensor:
        """The rows run as a forward's, the output head only for the last `rows`."""
        positions, mask = self._layout(ids, None, None)
        return self._run(ids, positions, mask, logits_to_keep=rows)

    @torch.inference_mode()
    def forward(
        self, ids: Sequence[int], positions: Sequence[int] | None = None, tree: TokenTree | None = None
    ) -> torch.Tensor:
        """With `tree`, `ids` are its last len(ids) nodes; its earlier nodes are the last cached positions.
        Each node then attends to the cache before the tree and to its own ancestors only."""
        positions, mask = self._layout(ids, positions, tree)
        return self._run(ids, positions, mask, logits_to_keep=0)

    def _layout(self, ids: Sequence[int], positions: Sequence[int] | None, tree: TokenTree | None
                ) -> tuple[Sequence[int], torch.Tensor | None]:
        """Positions of new tokens and their attention mask ([1, 1, n, cached + n]; None: causal). A model with
        a sliding window always gets a mask: each token sees the positions less than `window` before its own
        (transformers' rule, the one its full recomputation applies), cached or new; one whose layers mix windowed
        and global attention gets one of each, by layer type (transformers' mapping)."""
        n = len(ids)
        if tree is None:
            if positions is None:
                positions = range(self._len, self._len + n)
            if self.window is None:
                return positions, None
            allowed = torch.ones(n, self._len + n, dtype=torch.bool).tril(self._len)
            key_positions = torch.cat([torch.arange(self._len), torch.as_tensor(list(positions))])
        else:
            start = len(tree) - n  # first new node
            tree_begin = self._len - start  # cache position of the root
            if start < 0 or tree_begin < 0 or list(ids) != list(tree.tokens[start:]):
                raise ValueError("ids must be the last nodes of the tree, with the earlier ones cached")
            allowed = torch.ones(n, self._len + n, dtype=torch.bool)
            allowed[:, tree_begin:] = tree.ancestor_mask[start:]
            if positions is None:
                positions = tree.positions(tree_begin)[start:]
            key_positions = torch.cat([torch.arange(tree_begin), torch.as_tensor(tree.positions(tree_begin))])
        windowed = allowed
        if self.window is not None:
            query_positions = torch.as_tensor(list(positions))[:, None]
            windowed = allowed & (query_positions - key_positions[None, :] < self.window)
        if self.mixed:
            return positions, {"full_attention": self._additive(allowed), "sliding_attention": self._additive(windowed)}
        return positions, self._additive(windowed)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask [n, keys] as transformers' additive one [1, 1, n, keys] on the model's device."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None].to(self.device)

    def _run(self, ids: Sequence[int], positions: Sequence[int] | None, mask: torch.Tensor | None,
             logits_to_keep: int) -> torch.Tensor:
        input_ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        n = input_ids.shape[1]
        if positions is None:
            positions = range(self._len, self._len + n)
        position_ids = torch.as_tensor(list(positions), dtype=torch.long, device=self.device).view(1, -1)
        _running.check = self.interrupt
        try:
            with sdpa_kernel(CUDA_ATTENTION) if self.device.type == "cuda" else nullcontext():
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=mask,  # None: causal over the cache and the new tokens
                    position_ids=position_ids,
                    **{self._cache_argument: self._cache},
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                )
        except Interrupted:  # the layers before the cut cached the new tokens: drop them there
            for layer in self._cache.layers:
                if layer.is_initialized and (surplus := layer.get_seq_length() - self._len) > 0:
                    layer.crop(-surplus)
            raise
        finally:
            _running.check = None
        self._len += n
        logits = out.logits[0].float()  # [n or 1, vocab]
        hidden, _running.hidden = getattr(_running, "hidden", None), None
        # the logits' rows (a copy: not a view keeping a prompt's every row)
        self.last_hidden = hidden[0, -logits.shape[0]:].clone() if hidden is not None else None
        if self.device.type == "cuda":  # return once computed, so that a timer around a forward is honest
            torch.cuda.current_stream(self.device).synchronize()
        return logits

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot roll back to {n} cached positions: {self._len} are cached")
        if n == 0:
            self._cache = DynamicCache()
        elif n < self._len:
            self._cache.crop(n - self._len)
        self._len = n

    @property
    def prefix_block(self) -> int | None:
        """Any position of a prompt may be restored: every row of a prefill has its one-token forward's bits however
        the prompt is split (its exact kernels' rows); None for quantized kernels, whose rows are not tested so."""
        return None if self.kernel == "quantized" else 1

    def export_kv(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """A copy of the cached keys and values at positions [start, end), each layer's ([1, kv_heads, n, dim])."""
        if not 0 <= start <= end <= self._len:
            raise ValueError(f"cannot export positions [{start}, {end}): {self._len} are cached")
        return tuple(t[:, :, start:end].clone() for layer in self._cache.layers for t in (layer.keys, layer.values))

    def import_kv(self, pieces: Sequence[tuple[torch.Tensor, ...]]) -> None:
        """Make the cache hold `pieces` (`export_kv`'s, in order) from position 0, and nothing after them."""
        cache = DynamicCache()
        for layer in range(len(pieces[0]) // 2):
            cache.update(torch.cat([piece[2 * layer] for piece in pieces], 2),
                         torch.cat([piece[2 * layer + 1] for piece in pieces], 2), layer)
        self._cache, self._len = cache, sum(piece[0].shape[2] for piece in pieces)

    def keep(self, kept: int, path: Sequence[int]) -> None:
        path = checked_path(kept, path, self._len)
        index = torch.as_tensor(path, dtype=torch.long, device=self.device)
        end = kept + len(path)
        with torch.inference_mode():  # (the forwards' cache tensors: written in place only there)
            for layer in self._cache.layers:  # (the path written over the tree in place: the context is not copied)
                if layer.is_initialized:
                    layer.keys[..., kept:end, :] = layer.keys.index_select(-2, index)
                    layer.values[..., kept:end, :] = layer.values.index_select(-2, index)
                    layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        self._len = end


def attention_window(config: Any) -> tuple[int | None, bool]:
    """The sliding window of the model's windowed attention layers (None: none), and whether global layers mix
    with them (Gemma 2 and 3, Qwen2 with `max_window_layers`: their models take a mask per layer type). Windows of
    several sizes, or mixed in a model without layer types, are refused."""
    windows = layer_windows(config)
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ConfigError(f"{config.model_type} has sliding windows of several sizes ({sorted(sizes)}), which the "
                          "transformers backend does not run")
    mixed = bool(sizes) and None in windows
    if mixed and not getattr(config, "layer_types", None):
        raise ConfigError(f"{config.model_type} mixes sliding-window and global attention layers without layer "
                          "types, which the transformers backend does not run")
    return (sizes.pop() if sizes else None), mixed


# Architectures whose logits are the output embedding of the base model's last hidden state, nothing more:
# `forward_rows` runs their base model and head itself.
ROW_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox"})


def batches_rows(model: HFCausalLM) -> bool:
    """Whether `forward_rows` can run this model's rows in one forward (one mask per row: not windowed layers
    mixed with global ones)."""
    return model.model.config.model_type in ROW_ARCHITECTURES and model.kernel != "quantized" and not model.mixed


@torch.inference_mode()
def forward_rows(rows: Sequence[tuple[HFCausalLM, Call]]) -> list[torch.Tensor]:
    """One forward for several sequences on the same weights, each a (handle, call) row with a cache of its
    own; each row gets what its call would return alone (a prefill resets the row's cache, a prompt's later part
    follows the parts before it, and both return the last token's logits [vocab]; a forward one logits row per
    token [n, vocab]). The rows' tokens run as one input whose linear layers are
    row-invariant (`exact.py`) and whose attention takes each row's keys from its own cache
    (`invariant.Segment`), so every row's logits are bit for bit those of its own forward: batching
    never changes what a request generates."""
    from speculant.models.numerics.invariant import Segment

    model = rows[0][0].model
    if any(handle.model is not model for handle, _ in rows) or not batches_rows(rows[0][0]):
        raise ValueError("forward_rows needs handles on the same weights, of an architecture it batches")
    ids: list[int] = []
    positions: list[int] = []
    segments, picks = [], []
    for handle, call in rows:
        new = list(call.ids)
        if call.prefill:
            if not new:
                raise ValueError("prefill needs at least one token")
            if not call.resumes:
                handle.rollback(0)
        where, mask = handle._layout(new, call.positions, call.tree)
        segments.append(Segment(len(ids), len(new), handle._cache, mask))
        read = 1 if call.prefill else len(new) if call.rows is None else min(call.rows, len(new))
        picks.append(range(len(ids) + len(new) - read, len(ids) + len(new)))
        ids.extend(new)
        positions.extend(where)
    device = rows[0][0].device
    hidden = model.base_model(input_ids=torch.as_tensor(ids, device=device).view(1, -1),
                              position_ids=torch.as_tensor(positions, device=device).view(1, -1),
                              use_cache=False, segments=segments).last_hidden_state[0]
    index = torch.as_tensor([i for pick in picks for i in pick], device=device)
    picked, _running.hidden = hidden.index_select(0, index), None
    logits = model.get_output_embeddings()(picked).float()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    out, at = [], 0
    for (handle, call), pick in zip(rows, picks):
        handle._len += len(call.ids)
        out.append(logits[at] if call.prefill else logits[at : at + len(pick)])
        handle.last_hidden = picked[at : at + len(pick)]
        at += len(pick)
    return out


def hf_replica(model: Any, name: str, eos: frozenset[int], device: str) -> HFCausalLM:
    """A DSI server's own handle on a transformers model: weights shared on the model's device, a copy on
    another (`Module.to` moves in place, which would pull the weights away from the caller's model)."""
    same = _canonical(next(model.parameters()).device) == _canonical(torch.device(device))
    return HFCausalLM(model if same else deepcopy(model).to(device), None, name, eos)


def _canonical(device: torch.device) -> torch.device:
    """`cuda` names the current CUDA device: spell it with its index so that equal devices compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
