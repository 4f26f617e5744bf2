"""The lean model: one file for the RMSNorm-RoPE-GQA-SwiGLU decoders of the GGUFs people use (Llama, with Llama 3's
rope scaling; Mistral, a Llama with a sliding window; Qwen2; Qwen3, its q and k normed per head; Phi-3, its q, k, v
and its gate and up each one fused matrix, split when repacked; Gemma 2 and 3: sliding-window layers between global
ones, GeGLU, the embeddings scaled, norms after attention and the MLP too, logits soft-capped (Gemma 2), q and k
normed and a rope of their own for the windowed layers (Gemma 3)), read straight from a GGUF file of any type in
`formats.KIND_OF`, on speculant's exact kernels (`speculant.kernels`) and a preallocated KV cache with a length
pointer (gpt-fast's shape). `coverage` says, from a file's header, whether it runs here and if not why.

Every computation acts on one token row at a time or in a fixed order per row: a layer is one C call
(`kernels/layer.h`: the linears are the kernels, row r of a W-row call equals the 1-row call bit for bit;
attention runs one query token at a time over exactly the keys it may see; norms, rotary embeddings and
activations act per row). So verifying W tokens in one forward gives the logits of W one-token forwards,
and greedy speculation on it equals greedy decoding token for token. A prompt's prefill (the same for the
same prompt) runs its layers in torch with attention as one causal block (in windowed layers, each row's window
of it). Rollback moves the length; a tree's accepted path is compacted in place. A server's requests, each with a
cache of its own, run their calls as one forward (`forward_rows`): the same per-row computation, so each gets what
it gets alone.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from speculant import kernels
from speculant.cache import cache_root, mark_used, unused
from speculant.kernels import formats
from speculant.errors import ConfigError
from speculant.models.base import Backend, Call, Capabilities, Interrupted, PointerCache, prompt_parts
from speculant.models import gguf_header
from speculant.trees.tree import TokenTree

ARCHITECTURES = {"qwen2": "neox", "llama": "norm", "qwen3": "neox", "phi3": "neox", "gemma2": "neox",
                 "gemma3": "neox"}  # rotary layout as llama.cpp lays out each one's weights
GEMMA = {"gemma2": 2, "gemma3": 6}  # every n-th layer global, the rest windowed (llama.cpp's set_swa_pattern)
GEMMA_27B = {"gemma2": 46, "gemma3": 62}  # layers of the 27B models, whose queries llama.cpp scales by hidden / heads
DRAFT_HEAD = 49152  # a drafter's head rows (FR-Spec keeps 32k of Llama-3's 128k; Qwen2's vocabulary is 152k, and
# its coder's drafter serves code and prose; docs/results/cpu.md measures the share of the target's tokens it covers)
PREFILL_BLOCK = 64  # prompt rows one block of a prefill computes (`LeanCausalLM.continue_prefill`)
SERVED_PART = 2 * PREFILL_BLOCK  # a served prompt's part (`prefill_parts`): its blocks cost what they cost in one
# call, so a long prompt holds each step of the running requests for 128 tokens' prefill (scripts/prefill_parts.py)
DEFAULT_POSITIONS = 4096  # cache capacity when the model allows more
STALE_TEMPORARY_DAYS = 1  # a repack's temporary directory untouched this long was left by a process that died
CACHE_LAYOUT = 1  # of the repacked files and layout.json: a change here re-packs every cached model (as an edit
# of formats.py or of _repack does)


@dataclass(frozen=True)
class LeanConfig:
    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    context: int
    window: int | None  # sliding-window attention: each query sees at most this many positions
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before RoPE
    rope_scale: float = 1.0  # linear rope scaling: positions divided by this (Gemma 3: its global layers')
    sliding: tuple[bool, ...] = ()  # per layer, whether the window applies (empty: every layer)
    local_theta: float | None = None  # Gemma 3: the rope base of its windowed layers (unscaled)
    attn_scale: float | None = None  # scores' scale (None: head_dim ** -0.5)
    gelu: bool = False  # GeGLU (tanh GELU) where SwiGLU has SiLU
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    attn_softcap: float = 0.0  # Gemma 2: scores become cap * tanh(score / cap) (0: none)
    final_softcap: float = 0.0  # Gemma 2: logits alike

    def windowed(self, layer: int) -> bool:
        """Whether the sliding window applies to `layer`."""
        return self.window is not None and (not self.sliding or self.sliding[layer])


@dataclass(frozen=True)
class Layer:
    attn_norm: torch.Tensor
    q: kernels.QuantWeight
    k: kernels.QuantWeight
    v: kernels.QuantWeight
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor | None
    post_ffn_norm: torch.Tensor | None
    o: kernels.QuantWeight
    ffn_norm: torch.Tensor
    gate: kernels.QuantWeight
    up: kernels.QuantWeight
    down: kernels.QuantWeight


MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Every tensor the lean model computes with; a file holding another (a bias of the output projection or the MLP, an
# expert's weights) computes something else, and runs on llama.cpp
TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"})
LAYER_TENSORS = frozenset({*(f"{part}.weight" for part in MATRICES), "attn_qkv.weight", "attn_q.bias", "attn_k.bias",
                           "attn_v.bias", "attn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                           "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight"})
GEMMA2_DEFAULTS = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# (what llama.cpp assumes where a Gemma 2 file predates these keys)


class LeanWeights:
    """A GGUF file's weights in the kernels' layout, shared by every handle on them. The first load reads the
    file's header (`gguf_header.GGUFFile`) and repacks its matrices into the speculant cache (once per file and layout
    version); later loads map them copy-on-write, as llama.cpp maps the GGUF.

    With `head` (token ids, ascending), the weights of a drafter: the output head keeps only those tokens'
    rows (FR-Spec, Zhao et al. 2025: a quarter of a 0.5B model's multiply-adds are its 151k-row head), and
    matrices of types the kernels do not read are quantized again (`formats.requantize`). Its guesses
    change, never what the target it drafts for emits."""

    def __init__(self, path: Path, head: tuple[int, ...] | None = None) -> None:
        self.path = path
        directory = self.directory = _cache_directory(path, head)  # where its repacked matrices lie
        if not directory.is_dir():
            _repack(path, directory, head)
            _remove_unused(directory.parent)
        layout = json.loads((directory / "layout.json").read_text())
        mark_used(directory / "layout.json")  # (its last use: `_remove_unused` reads it)
        self.head = None if head is None else torch.tensor(head, dtype=torch.long)
        self.config = LeanConfig(**{**layout["config"], "sliding": tuple(layout["config"]["sliding"])})
        self.types = layout["types"]  # the file's matrices' GGUF types
        self.eos_token_ids = frozenset(layout["eos"])
        file = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = layout["tensors"]  # the rest, where they lie in the file: {name: [type, shape, offset, bytes]}

        def vector(name: str) -> torch.Tensor | None:
            if name not in tensors:
                return None
            _, _, offset, size = tensors[name]
            return torch.from_numpy(file[offset:offset + size].view(np.float32).copy())

        def matrix(name: str) -> kernels.QuantWeight:
            kind, (inputs, outputs) = layout["matrices"][name]  # inputs padded to 128
            packed = np.load(directory / f"{name}.npy", mmap_mode="c")
            return kernels.QuantWeight(kind, outputs, inputs, torch.from_numpy(packed))

        self.layers = [Layer(vector(f"blk.{i}.attn_norm.weight"), matrix(f"blk.{i}.attn_q.weight"),
                             matrix(f"blk.{i}.attn_k.weight"), matrix(f"blk.{i}.attn_v.weight"),
                             vector(f"blk.{i}.attn_q.bias"), vector(f"blk.{i}.attn_k.bias"),
                             vector(f"blk.{i}.attn_v.bias"), vector(f"blk.{i}.attn_q_norm.weight"),
                             vector(f"blk.{i}.attn_k_norm.weight"), vector(f"blk.{i}.post_attention_norm.weight"),
                             vector(f"blk.{i}.post_ffw_norm.weight"), matrix(f"blk.{i}.attn_output.weight"),
                             vector(f"blk.{i}.ffn_norm.weight"), matrix(f"blk.{i}.ffn_gate.weight"),
                             matrix(f"blk.{i}.ffn_up.weight"), matrix(f"blk.{i}.ffn_down.weight"))
                       for i in range(self.config.layers)]
        self.structs = [kernels.layer_struct((layer.attn_norm, layer.ffn_norm, layer.q_norm, layer.k_norm,
                                              layer.post_attn_norm, layer.post_ffn_norm),
                                             (layer.q_bias, layer.k_bias, layer.v_bias),
                                             (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down))
                        for layer in self.layers]  # the C view of each layer: it points into the tensors above
        self.output_norm = vector("output_norm.weight")
        self.output = matrix(layout["output"])
        self._embedding_type, (hidden, self.vocab_size), offset, size = tensors["token_embd.weight"]
        self._embedding = file[offset:offset + size].reshape(self.vocab_size, -1)
        config = self.config
        self.rope = _rope(config, config.rope_theta, config.rope_scale, vector("rope_freqs.weight"))  # (cos, sin)
        self.local_rope = self.rope if config.local_theta is None else _rope(config, config.local_theta, 1.0, None)

    def rope_of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables [context, head_dim / 2] of `layer`'s rotations."""
        return self.local_rope if self.config.windowed(layer) else self.rope

    def matrices(self) -> list[kernels.QuantWeight]:
        """Every matrix the kernels multiply: the output head, then each layer's projections."""
        return [self.output] + [m for layer in self.layers for m in
                                (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)]

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = self._embedding[np.asarray(ids, dtype=np.int64)]
        if self._embedding_type == "F32":
            x = torch.from_numpy(rows.view(np.float32).copy())
        else:
            x = torch.from_numpy(dequantize(rows, GGMLQuantizationType[self._embedding_type]).astype(np.float32))
        return x if self.config.embed_scale == 1.0 else x * self.config.embed_scale


def _rope(config: LeanConfig, theta: float, scale: float, factors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """RoPE's (cos, sin) [context, head_dim / 2] for base `theta`, positions divided by `scale` (linear scaling)
    and frequencies by `factors` (Llama 3's rope scaling, as llama.cpp applies it: theta / factor)."""
    half = config.head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    if factors is not None:
        inv_freq = inv_freq / factors.double()
    angles = torch.outer(torch.arange(config.context, dtype=torch.float64) / scale, inv_freq)
    return angles.cos().float(), angles.sin().float()


def _cache_directory(path: Path, head: tuple[int, ...] | None) -> Path:
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    # what writes the cache: the layouts (formats.py), the file's reader (gguf_header.py) and the writer (_repack's
    # source), so that an edit to any repacks rather than reading files of another layout
    digest.update(Path(formats.__file__).read_bytes() + Path(gguf_header.__file__).read_bytes() +
                  inspect.getsource(_repack).encode() + inspect.getsource(_read).encode())
    digest.update(f"layout {CACHE_LAYOUT}".encode())
    if head is not None:
        digest.update(np.asarray(head, dtype=np.int64).tobytes())
    return cache_root() / "lean" / f"{path.stem}{'' if head is None else '-draft'}-{digest.hexdigest()[:16]}"


def _repack(path: Path, directory: Path, head: tuple[int, ...] | None) -> None:
    """Read the file's configuration, repack its matrices (a drafter's: see LeanWeights) and write them with a
    layout.json into `directory` (through a temporary sibling of this call's own, renamed into place: readers see all
    of it or nothing, and a repack that stops part-way removes it)."""
    reader = gguf_header.GGUFFile(path)
    config, tensors, matrices = _read(reader)
    if head is None and (untyped := _untyped(matrices)):
        raise ConfigError(f"{untyped} (a drafter's weights may be quantized again: `name@lean`)")
    output, names = matrices[0][0], {name for name, *_ in matrices}

    def packed(name: str, ggml_type: str, raw: np.ndarray, width: int) -> tuple[str, np.ndarray, int, int]:
        """(kind, bytes in the kernels' layout, inputs, outputs) of a matrix, a drafter's head restricted to its
        rows; a drafter's matrices of types other than Q4_K and Q6_K quantized again (faster, and its guesses
        change, never what the target emits)."""
        inputs = formats.inputs_of(width)
        if head is not None and name == output:
            raw = raw[np.asarray(head)]
        if ggml_type in formats.KIND_OF and (head is None or ggml_type in ("Q4_K", "Q6_K")):
            return *formats.pack_type(ggml_type, raw, inputs), inputs, len(raw)
        kind = "q6_k" if name == output else "q4_k"  # the head keeps more bits: it ranks every guess
        return kind, formats.pack(kind, formats.requantize(kind, raw, ggml_type), inputs), inputs, len(raw)

    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    layout = {"config": vars(config), "eos": [] if eos is None else [int(eos)], "output": output, "matrices": {},
              "types": _types(matrices),
              "tensors": {name: [t.tensor_type.name, [int(n) for n in t.shape], int(t.data_offset), t.data.nbytes]
                          for name, t in tensors.items() if name not in names or name == "token_embd.weight"}}
    tmp = directory.with_name(f".tmp-{directory.name}-{uuid.uuid4().hex[:12]}")  # (unique: threads share a pid)
    tmp.mkdir(parents=True)
    try:
        for name, ggml_type, raw, width in matrices:
            kind, data, inputs, outputs = packed(name, ggml_type, raw, width)
            layout["matrices"][name] = [kind, [inputs, outputs]]
            np.save(tmp / f"{name}.npy", data)
        (tmp / "layout.json").write_text(json.dumps(layout))
    except BaseException:  # an error, a full disk, Ctrl-C
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(directory)
    except OSError:  # another process or thread cached it first
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_unused(root: Path) -> None:
    """Remove the repacks not loaded for `cache.UNUSED_DAYS`: those of an earlier layout or writer (an upgrade writes
    the file's matrices again beside them) and of files that moved or changed; and the temporary directories of
    repacks that stopped part-way untouched for STALE_TEMPORARY_DAYS (a process killed before it could remove its
    own). The cache is only a cache: a removed repack is written again at its next load."""
    for directory in root.iterdir():
        if (unused(directory, STALE_TEMPORARY_DAYS) if directory.name.startswith(".tmp-")
                else unused(directory / "layout.json")):  # (not a repack, or removed by another process: False)
            shutil.rmtree(directory, ignore_errors=True)


def _read(reader: gguf_header.GGUFFile) -> tuple[LeanConfig, dict[str, Any],
                                                 list[tuple[str, str, np.ndarray, int]]]:
    """A GGUF file's configuration, its tensors by name, and the matrices the kernels multiply: (name, GGUF type,
    data [outputs, bytes or values], inputs), the output head first, then each layer's MATRICES (Phi-3's fused
    attn_qkv and ffn_up split by rows: q, k, v; gate, up). ConfigError where the lean model does not compute what
    the file's architecture does."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"the lean backend runs {', '.join(ARCHITECTURES)}, not {arch}")
    if int(_number(reader, "split.count", 1)) > 1:
        raise ConfigError("the GGUF file is one part of a split model: the lean backend reads whole files")
    if int(_number(reader, f"{arch}.expert_count", 0)) > 0:
        raise ConfigError(f"{arch} with experts: the lean backend computes dense layers")
    defaults = GEMMA2_DEFAULTS if arch == "gemma2" else {}
    heads = _count(reader, f"{arch}.attention.head_count")
    hidden = _count(reader, f"{arch}.embedding_length")
    head_dim = _count(reader, f"{arch}.attention.key_length", hidden // heads)
    window = _number(reader, f"{arch}.attention.sliding_window", defaults.get("attention.sliding_window"))
    # as llama.cpp reads them: linear unless named, its factor under either key (0: none)
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "linear"))
    if scaling not in ("none", "linear"):
        raise ConfigError(f"{arch} with {scaling} rope scaling: the lean backend computes none, linear and Llama 3's")
    factor = float(_number(reader, f"{arch}.rope.scaling.factor", _number(reader, f"{arch}.rope.scale_linear", 0.0)))
    if int(_number(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ConfigError(f"{arch} rotates part of each head: the lean backend rotates whole heads")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:
        raise ConfigError(f"{arch} with LongRoPE factors: the lean backend computes none, linear and Llama 3's")
    if other := next((name for name in tensors if name not in TENSORS and not (
            name.startswith("blk.") and name.split(".", 2)[-1] in LAYER_TENSORS)), None):
        raise ConfigError(f"the GGUF file holds {other}, which the lean backend does not compute")
    if bad := next((t.name for t in tensors.values() if len(t.shape) == 1 and t.tensor_type.name != "F32"), None):
        raise ConfigError(f"{bad} is {tensors[bad].tensor_type.name}: the lean backend reads vectors in F32")
    if bad := next((t.name for t in tensors.values() if len(t.shape) > 2), None):
        raise ConfigError(f"{bad} has {len(tensors[bad].shape)} dimensions: the lean backend reads vectors and "
                          "matrices")
    layers = _count(reader, f"{arch}.block_count")
    gemma = {}
    if arch in GEMMA:  # as llama.cpp's llama-model.cpp builds them
        every = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA[arch])
        sliding = [bool(s) for s in every] if isinstance(every, list) else [i % every < every - 1 for i in range(layers)]
        queries = hidden // heads if layers == GEMMA_27B[arch] else head_dim
        local_theta = float(_number(reader, f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None
        gemma = dict(sliding=tuple(sliding), local_theta=local_theta,
                     attn_scale=queries ** -0.5, gelu=True, embed_scale=float(np.float32(hidden ** 0.5)),
                     attn_softcap=float(_number(reader, f"{arch}.attn_logit_softcapping",
                                                defaults.get("attn_logit_softcapping", 0.0))),
                     final_softcap=float(_number(reader, f"{arch}.final_logit_softcapping",
                                                 defaults.get("final_logit_softcapping", 0.0))))
    config = LeanConfig(
        arch, layers, hidden, heads, _count(reader, f"{arch}.attention.head_count_kv", heads), head_dim,
        float(_number(reader, f"{arch}.rope.freq_base", 10000.0)),
        float(_number(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        _count(reader, f"{arch}.context_length"), int(window) if window else None,
        "blk.0.attn_q_norm.weight" in tensors, factor if scaling == "linear" and factor else 1.0, **gemma)
    output = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied embeddings

    def rows(name: str, start: int = 0, stop: int | None = None) -> tuple[str, np.ndarray, int]:
        if name not in tensors:
            raise ConfigError(f"the GGUF file has no {name}")
        tensor = tensors[name]
        return tensor.tensor_type.name, np.asarray(tensor.data)[start:stop], int(tensor.shape[0])

    if heads % config.kv_heads:
        raise ConfigError(f"the GGUF file's {heads} attention heads do not share its {config.kv_heads} key-value "
                          "heads evenly")
    q_rows, kv_rows = heads * head_dim, config.kv_heads * head_dim
    matrices = [(output, *rows(output))]
    for i in range(config.layers):
        for part in MATRICES:
            name = f"blk.{i}.{part}.weight"
            if f"blk.{i}.attn_qkv.weight" in tensors and part in ("attn_q", "attn_k", "attn_v"):
                start = {"attn_q": 0, "attn_k": q_rows, "attn_v": q_rows + kv_rows}[part]
                size = q_rows if part == "attn_q" else kv_rows
                matrices.append((name, *rows(f"blk.{i}.attn_qkv.weight", start, start + size)))
            elif arch == "phi3" and part in ("ffn_gate", "ffn_up"):  # gate first, as llama.cpp's swiglu splits it
                ggml_type, fused, width = rows(f"blk.{i}.ffn_up.weight")
                half = len(fused) // 2
                matrices.append((name, ggml_type, fused[:half] if part == "ffn_gate" else fused[half:], width))
            else:
                matrices.append((name, *rows(name)))
            wanted, held = {"attn_q": q_rows, "attn_k": kv_rows, "attn_v": kv_rows}.get(part), len(matrices[-1][2])
            if wanted is not None and held != wanted:
                raise ConfigError(f"the GGUF file's {name} has {held} rows where its heads make {wanted}")
    return config, tensors, matrices


def _untyped(matrices: Sequence[tuple[str, str, Any, int]]) -> str | None:
    """Why the kernels cannot multiply a matrix of the file as it is (its type), or None."""
    for name, ggml_type, _, _ in matrices:
        if ggml_type not in formats.KIND_OF:
            return f"{name} is {ggml_type}: the lean backend's kernels read {', '.join(formats.KIND_OF)}"
    return None


def coverage(path: Path) -> tuple[bool, str]:
    """Whether the lean backend runs the GGUF file at `path` exactly as it is, and why: what it runs (the
    architecture and its matrices' types), or what it lacks (the architecture, its rope scaling or a matrix's type).
    Read from the header, before anything is repacked; a damaged header is refused (`DamagedGGUF`: no backend reads
    it), and what the header reader alone does not know (a tensor type newer than the gguf package) is left to
    llama.cpp."""
    try:
        config, _, matrices = _read(gguf_header.GGUFFile(path))
    except gguf_header.DamagedGGUF:
        raise
    except ConfigError as error:
        return False, str(error)
    if untyped := _untyped(matrices):
        return False, untyped
    return True, f"{config.architecture}, {_types(matrices)} matrices"


def _types(matrices: Sequence[tuple[str, str, Any, int]]) -> str:
    return "/".join(sorted({ggml_type for _, ggml_type, _, _ in matrices}))


_loading = threading.Lock()  # one first load at a time: threads that load one file at once share one repack


def shared_weights(path: Path, head: tuple[int, ...] | None = None) -> LeanWeights:
    """The weights of a GGUF file, repacked once per process and shared by every model handle on them."""
    with _loading:
        return _weights(path, head)


@lru_cache(maxsize=4)
def _weights(path: Path, head: tuple[int, ...] | None) -> LeanWeights:
    return LeanWeights(path, head)


def _field(reader: gguf_header.GGUFFile, key: str, default: Any = ConfigError) -> Any:
    if key not in reader.fields:
        if default is ConfigError:
            raise ConfigError(f"the GGUF file has no {key}")
        return default
    return reader.fields[key]


def _number(reader: gguf_header.GGUFFile, key: str, default: Any = ConfigError) -> Any:
    """A field that must be one number (a per-layer list, as some files give head counts, is a ConfigError)."""
    value = _field(reader, key, default)
    if value is not None and (isinstance(value, (bool, str, list)) or not np.isscalar(value)):
        raise ConfigError(f"the GGUF file's {key} is {type(value).__name__}: the lean backend reads one number")
    return value


def _count(reader: gguf_header.GGUFFile, key: str, default: Any = ConfigError) -> int:
    """A field that must be a whole number >= 1 (a count of heads, layers, positions or widths)."""
    value = _number(reader, key, default)
    if not (np.isfinite(value) and value >= 1 and value == int(value)):
        raise ConfigError(f"the GGUF file's {key} is {value}: the lean backend reads a whole number >= 1")
    return int(value)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """RoPE (Su et al. 2021, eq. 34) on x [n, heads, head_dim]; cos, sin [n, 1, head_dim / 2]. `neox` pairs
    dimension i with i + head_dim/2, `norm` pairs 2i with 2i + 1."""
    if layout == "neox":
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


class LeanCausalLM(PointerCache, Backend):
    """A CausalLM (see models/base.py) on LeanWeights, with a KV cache of its own."""

    backend = "lean"
    capabilities = Capabilities(shares_weights=True, batches_rows=True, prefills_in_parts=True, interruptible=True,
                                fixed_cache=True,
                                skips_layers=True, gguf=True,
                                reuses_prefixes=True, hidden_states=True)
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, weights: LeanWeights, tokenizer: Any | None = None, name: str | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), identity: str | None = None,
                 positions: int | None = None, layers: tuple[int, ...] | None = None) -> None:
        config = self.config = weights.config
        self.weights, self.tokenizer, self.name = weights, tokenizer, name or weights.path.stem
        self.identity, self.vocab_size = identity, weights.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids | weights.eos_token_ids)
        self.max_positions = min(positions or DEFAULT_POSITIONS, config.context)
        self.kernel = kernels.build()  # a new build of the kernels or layers is profiled anew
        self.numerics = "lean: GGUF blocks x int8 rows"  # the same bits on every ISA path
        self.interrupt = None
        self.layers = tuple(range(config.layers)) if layers is None else layers  # the layers it runs, ascending
        shape = (len(self.layers), config.kv_heads, self.max_positions, config.head_dim)
        self._keys, self._values = torch.empty(shape), torch.empty(shape)  # only written positions are read
        self._len = 0
        self.last_hidden: torch.Tensor | None = None  # the last call's rows of the last layer (`hidden_states`)

    @property
    def weights_key(self) -> int:
        return hash((id(self.weights), self.layers))

    def rows_forward(self) -> Any:
        """`forward_rows` (see CausalLM)."""
        return forward_rows

    def share(self) -> LeanCausalLM:
        """Another handle on the same weights with a cache of its own."""
        return LeanCausalLM(self.weights, self.tokenizer, self.name, self.eos_token_ids, self.identity,
                            self.max_positions, self.layers)

    def describe(self) -> list[str]:
        kinds = sorted({m.kind for m in self.weights.matrices()})
        return [f"{self.name}: lean backend, {self.config.architecture} with {self.weights.types} matrices on "
                f"speculant's {'/'.join(kinds)} kernels ({self.kernel})"]

    def catalog_drafter_spec(self, drafter: str) -> str:
        """Its GGUF on the same kernels, behind FR-Spec's frequency-ranked head."""
        return f"{drafter}@lean"

    def self_drafter(self, spec: Any) -> Any:
        if spec.skip:
            from speculant.models.backends.layer_skip import skipped_layers

            return self.skipping(skipped_layers(self))
        return super().self_drafter(spec)

    def skipping(self, skipped: Sequence[int]) -> LeanCausalLM:
        """A handle on the same weights that leaves the `skipped` layers out, with a cache of its own: the model
        as its own drafter (`models.backends.layer_skip`)."""
        left_out = set(skipped)
        layers = tuple(i for i in self.layers if i not in left_out)
        return LeanCausalLM(self.weights, self.tokenizer, f"{self.name} skipping {len(self.layers) - len(layers)}",
                            self.eos_token_ids, self.identity and f"{self.identity} layers {layers}",
                            self.max_positions, layers)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self._len = 0
        for part in prompt_parts(ids):
            logits = self.continue_prefill(part)
        return logits

    def prefill_parts(self, ids: Sequence[int]) -> list[list[int]]:
        """The parts a batching server runs a prompt in, in separate forwards (`continue_prefill` runs each after
        the first), so that the running requests decode between them: SERVED_PART tokens, whole blocks, which hold
        the bits `prefill` gives them whatever the split."""
        return prompt_parts(ids, SERVED_PART)

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        """With `tree`, `ids` are its last len(ids) nodes, its earlier nodes the last cached positions; each
        node attends to the cache before the tree and its own ancestors."""
        return _run_rows([self._place(ids, positions, tree)])[0]

    @torch.inference_mode()
    def catch_up(self, ids: Sequence[int], rows: int = 1) -> torch.Tensor:
        """The rows run as a forward's, the output head only for the last `rows`."""
        return _run_rows([self._place(ids, read=rows)])[0]

    def _place(self, ids: Sequence[int], positions: Sequence[int] | None = None, tree: TokenTree | None = None,
               read: int | None = None) -> _Rows:
        """A call's rows: written after the cached positions, each seeing the cache up to itself, or up to the
        call's end where its mask row allows (a tree's ancestors), and in windowed layers only the keys within
        the window."""
        config, n, start, mask = self.config, len(ids), self._len, None
        end = start + n
        if end > self.max_positions:
            raise ValueError(f"{end} positions exceed the lean model's cache of {self.max_positions}")
        if tree is not None:
            first = len(tree) - n  # first new node
            root = start - first  # cache position of the root
            if first < 0 or root < 0 or list(ids) != list(tree.tokens[first:]):
                raise ValueError("ids must be the last nodes of the tree, with the earlier ones cached")
            mask = torch.ones(n, end, dtype=torch.bool)
            mask[:, root:] = tree.ancestor_mask[first:]
            if positions is None:
                positions = tree.positions(root)[first:]
        where = torch.as_tensor(list(positions if positions is not None else range(start, end)), dtype=torch.long)
        windowed = mask
        if config.window is not None and end > config.window:  # keys within the window of each query's position
            slots = torch.arange(end)  # each key's position is its slot's, but a tree node's is its depth's
            keys = slots if tree is None else torch.cat([slots[:root], torch.as_tensor(tree.positions(root))])
            near = keys[None, :] > where[:, None] - config.window
            windowed = near & (slots[None, :] <= torch.arange(start, end)[:, None] if mask is None else mask)
        return _Rows(self, list(ids), where, mask, windowed, read)

    @torch.inference_mode()
    def continue_prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """A part of a prompt without a mask (`prefill_parts`), after the cached positions (the prompt's earlier
        parts); the logits of its last token. Its rows run in blocks of PREFILL_BLOCK positions aligned to the
        cache's start, each block's layers in torch and its attention as one causal block: a whole block is the
        same computation whichever part or call runs it, so the positions of a prompt's whole blocks hold the same
        bits however the prompt was split, or restored by a server's prefix cache (`speculant.prefixes`). An
        interrupted part leaves the cache as the earlier parts left it, its finished blocks dropped too."""
        start, end = self._len, self._len + len(ids)
        if end > self.max_positions:
            raise ValueError(f"{end} positions exceed the lean model's cache of {self.max_positions}")
        bounds = [start, *range((start // PREFILL_BLOCK + 1) * PREFILL_BLOCK, end, PREFILL_BLOCK), end]
        try:
            for lo, hi in zip(bounds, bounds[1:]):
                x = self._prefill_block(ids[lo - start:hi - start])
        except Interrupted:
            self._len = start
            raise
        self.last_hidden = x[-1:]
        return _head(self.weights, x[-1:])[0]

    @property
    def prefix_block(self) -> int:
        """Positions a prefix cache may restore come in whole PREFILL_BLOCKs (see `continue_prefill`)."""
        return PREFILL_BLOCK

    def _prefill_block(self, ids: Sequence[int]) -> torch.Tensor:
        """One block of `continue_prefill`: its rows' last hidden states [n, hidden]."""
        config, weights, n, start = self.config, self.weights, len(ids), self._len
        end = start + n
        layout, scale = ARCHITECTURES[config.architecture], config.attn_scale or config.head_dim ** -0.5
        where = torch.arange(start, end)
        causal = None if start == 0 else torch.ones(n, end, dtype=torch.bool).tril(start)  # row i sees start + i
        near = causal  # windowed layers: only the keys within the window of each row's position
        if config.window is not None and end > config.window:
            keys = torch.arange(end)[None, :]
            near = (keys <= where[:, None]) & (keys > where[:, None] - config.window)
        x = weights.embed(ids).contiguous()  # [n, hidden]
        for slot, index in enumerate(self.layers):
            layer = weights.layers[index]
            cos, sin = (table[where][:, None] for table in weights.rope_of(index))
            if self.interrupt is not None and self.interrupt():
                raise Interrupted()
            h = kernels.quantize_rows(_rms_norm(x, layer.attn_norm, config.eps))
            q, k, v = (_bias(kernels.matmul(h, w), b) for w, b in
                       ((layer.q, layer.q_bias), (layer.k, layer.k_bias), (layer.v, layer.v_bias)))
            q, k = q.view(n, config.heads, config.head_dim), k.view(n, config.kv_heads, config.head_dim)
            if config.qk_norm:
                q, k = _rms_norm(q, layer.q_norm, config.eps), _rms_norm(k, layer.k_norm, config.eps)
            q, k = _rotate(q, cos, sin, layout), _rotate(k, cos, sin, layout)
            self._keys[slot, :, start:end] = k.transpose(0, 1)
            self._values[slot, :, start:end] = v.view(n, config.kv_heads, config.head_dim).transpose(0, 1)
            attended = _attention(q.transpose(0, 1), self._keys[slot, :, :end], self._values[slot, :, :end],
                                  near if config.windowed(index) else causal, scale,
                                  config.attn_softcap).transpose(0, 1).reshape(n, -1)
            x = x + _norm(kernels.matmul(kernels.quantize_rows(attended), layer.o), layer.post_attn_norm, config.eps)
            h = kernels.quantize_rows(_rms_norm(x, layer.ffn_norm, config.eps))
            gate = kernels.matmul(h, layer.gate)
            gate = F.gelu(gate, approximate="tanh") if config.gelu else F.silu(gate)  # GeGLU or SwiGLU
            down = kernels.matmul(kernels.quantize_rows(gate * kernels.matmul(h, layer.up)), layer.down)
            x = x + _norm(down, layer.post_ffn_norm, config.eps)
        self._len = end
        return x


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: torch.Tensor | None, scale: float,
               softcap: float) -> torch.Tensor:
    """A prompt part's attention: q [heads, n, d] over the cached k, v [kv_heads, end, d], row i seeing the cache
    up to its own position (`causal` [n, end], None: the part is the whole cache); scores soft-capped where
    `softcap` (which torch's fused attention does not do)."""
    if not softcap:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal, is_causal=causal is None,
                                              scale=scale, enable_gqa=True)[0]
    n, end, group = q.shape[1], k.shape[1], q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = _softcap(q @ k.transpose(1, 2) * scale, softcap)
    visible = causal if causal is not None else torch.ones(n, end, dtype=torch.bool).tril(end - n)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def _bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm where the layer has the weight (Gemma's norms after attention and the MLP), else x."""
    return x if weight is None else _rms_norm(x, weight, eps)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft-capping (Gemma Team 2024, sec. 2): cap * tanh(x / cap)."""
    return torch.tanh(x / cap) * cap


def _head(weights: LeanWeights, x: torch.Tensor) -> torch.Tensor:
    """Logits of the rows of x (the last layer's output)."""
    logits = kernels.matmul(kernels.quantize_rows(_rms_norm(x, weights.output_norm, weights.config.eps)), weights.output)
    if weights.config.final_softcap:
        logits = _softcap(logits, weights.config.final_softcap)
    if weights.head is None:
        return logits
    full = torch.full((logits.shape[0], weights.vocab_size), float("-inf"))
    full[:, weights.head] = logits[:, :len(weights.head)]
    return full


@dataclass
class _Rows:
    """One call's rows, placed in its handle's cache (`LeanCausalLM._place`); the logits of its last `read` rows are
    computed (a prompt's: its last row's), of every row where `read` is None."""
    handle: LeanCausalLM
    ids: list[int]
    positions: torch.Tensor
    mask: torch.Tensor | None  # [n, end] bool; None: each row sees the cache up to itself
    windowed: torch.Tensor | None  # the same in windowed layers
    read: int | None = None


def _run_rows(calls: Sequence[_Rows]) -> list[torch.Tensor]:
    """The calls' rows as one input, one C call per layer (kernels/layer.h), each row attending to its own
    handle's cache: row-invariant, so each call gets the logits it gets alone, bit for bit."""
    handles = [call.handle for call in calls]
    weights, config = handles[0].weights, handles[0].config
    places = {windowed: _places(calls, windowed) for windowed in {config.windowed(i) for i in handles[0].layers}}
    x = weights.embed([t for call in calls for t in call.ids]).contiguous()  # [rows, hidden]
    neox = ARCHITECTURES[config.architecture] == "neox"
    for slot, index in enumerate(handles[0].layers):  # the layer's keys and values lie at `slot` of each cache
        if any(h.interrupt is not None and h.interrupt() for h in handles):
            raise Interrupted()  # nothing past the cache lengths was committed
        kernels.layer(config, weights.structs[index], slot, x, places[config.windowed(index)], *weights.rope_of(index),
                      neox)
    picks, sizes, at = [], [], 0  # the rows whose logits are read: each call's last `read`, or all of them
    for call in calls:
        n = len(call.ids)
        sizes.append(min(call.read or n, n))
        picks += range(at + n - sizes[-1], at + n)
        call.handle._len += n
        at += n
    rows = x[picks]
    for call, hidden in zip(calls, rows.split(sizes)):
        call.handle.last_hidden = hidden
    return list(_head(weights, rows).split(sizes))


def _places(calls: Sequence[_Rows], windowed: bool) -> kernels.Places:
    """Where the calls' rows sit, for the C layers (`kernels.Places`): their masks in windowed layers or in the
    others."""
    slots, seen, masks, keys, values, held = [], [], [], [], [], []
    for call in calls:
        handle, n, start = call.handle, len(call.ids), call.handle._len
        mask = call.windowed if windowed else call.mask
        slots += range(start, start + n)
        if mask is None:
            seen += range(start + 1, start + n + 1)
            masks += [0] * n
        else:
            rows = mask.to(torch.uint8).contiguous()
            held.append(rows)
            seen += [start + n] * n
            masks += range(rows.data_ptr(), rows.data_ptr() + n * rows.stride(0), rows.stride(0))
        keys += [handle._keys.data_ptr()] * n
        values += [handle._values.data_ptr()] * n
    long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return kernels.Places(torch.cat([call.positions for call in calls]), long(slots), long(seen), long(masks),
                          long(keys), long(values), calls[0].handle.max_positions, tuple(held))


@torch.inference_mode()
def forward_rows(rows: Sequence[tuple[LeanCausalLM, Call]]) -> list[torch.Tensor]:
    """One forward for several sequences on the same weights, each a (handle, call) row with a cache of its
    own; each gets what its call returns alone (a prefill: its last token's logits [vocab]; a forward: one
    row per token [n, vocab]), bit for bit, so batching never changes what a request generates. Prefills run
    on their own, as `prefill` runs them."""
    first = rows[0][0]
    if any((handle.weights, handle.layers, handle.max_positions) != (first.weights, first.layers, first.max_positions)
           for handle, _ in rows):
        raise ValueError("forward_rows needs handles on the same weights and layers, and cache capacity")
    if len({id(handle) for handle, _ in rows}) < len(rows):
        raise ValueError("forward_rows takes one call per handle")
    out: dict[int, torch.Tensor] = {}
    together = []
    for i, (handle, call) in enumerate(rows):
        if call.prefill:
            out[i] = call.run(handle)
        else:
            together.append((i, handle._place(call.ids, call.positions, call.tree, read=call.rows)))
    if together:
        for (i, placed), logits in zip(together, _run_rows([placed for _, placed in together])):
            out[i] = logits
    return [out[i] for i in range(len(rows))]
