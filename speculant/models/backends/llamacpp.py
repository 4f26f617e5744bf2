"""CausalLM backend over llama.cpp: a GGUF file run by ggml's CPU kernels through llama-cpp-python's
low-level API (`llama_decode` on batches, the memory API for rollback; not its `Llama` generate loop).

Exactness. ggml picks kernels by batch width: a KV cache in f16 sends one query down a split-KV flash
attention path and 64 or more down a tiled one, repacked K-quant weights use a 4-row gemm beside a 1-row
gemv, and the tiled K-quant matmul starts at 8 rows. A token's logits then depend on how many tokens
share its forward, which flips near-ties. The backend therefore keeps its KV cache in bf16 (flash
attention then takes one path for every width; as fast as f16 here) and measures, once per model and machine, the widest forward whose rows equal one-token
forwards bit for bit (`invariant_width`); longer forwards run in chunks of that width. Prompts prefill in
large batches: every method prefills a prompt the same way.

Which llama.cpp runs: the native build that `speculant peers build-llamacpp` made for this machine from the
installed version's sources (`models/backends/llamacpp_build.py`), where there is one, so that speculant and
llama.cpp's own tools run the same kernels; else llama-cpp-python's own library; `LLAMA_CPP_LIB_PATH`
overrides both. A library whose ggml has an AMX matmul is tried once per library, CPU and model in a child
process: if it faults (GCC 12 miscompiles its tile configuration), weights load without ggml's extra buffer
types (AMX, repacking) instead of crashing.

Token trees (Medusa/SpecInfer-style tree attention) map onto llama.cpp's sequences: a cached cell belongs
to a set of sequence ids and a token attends to the cells of its first sequence at earlier positions.
Each root-to-leaf path gets a sequence; a node carries the sequences of the leaves below it. Nodes are
sent in depth-first order, so the first chain of the tree sits in consecutive cells like any decoded
text; `keep` retains the accepted path's nodes that already sit where plain decoding would have put them
and re-runs the rest with the next forward (`_pending`), so the cache's cell order - which sets the
order of attention's sums - always matches plain decoding.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speculant.errors import ConfigError, ModelNotAvailable
from speculant.models.base import Backend, Capabilities, Interrupted, checked_path
from speculant.trees.tree import TokenTree

N_CTX = 8192  # positions per context (at most the model's training length)
N_BATCH = 512  # prompt tokens per llama_decode
UNWINDOWED = frozenset({"llama"})  # architectures whose GGUF sliding window llama.cpp ignores (tests/test_llamacpp.py)
N_SEQ = 64  # sequence ids per context: a draft tree may have up to N_SEQ - 1 leaves
KV_TYPE = 30  # GGML_TYPE_BF16, the KV cache's type (see the module docstring)
PROBE_WIDTH = 16  # the widest forward `invariant_width` tries
PROBE_CONTEXT = 600  # cached tokens before its forwards: ggml takes other attention paths past 512 (split KV)
log = logging.getLogger("speculant")
_log = deque(maxlen=8)  # llama.cpp's last log lines, quoted when a call fails
_buffers: list[str] = []  # the buffer types of the weights of the model loading now


def choose_library() -> None:
    """Point llama-cpp-python at the native build for this machine, where there is one and nothing else was
    chosen (`LLAMA_CPP_LIB_PATH`): it reads the variable when it is first imported."""
    if "LLAMA_CPP_LIB_PATH" not in os.environ and importlib.util.find_spec("llama_cpp") is not None:
        from speculant.models.backends.llamacpp_build import manifest

        built = manifest()
        if built is not None:
            os.environ["LLAMA_CPP_LIB_PATH"] = built["lib"]


NOT_BUILT = ("the llama.cpp backend runs on llama.cpp built for this machine: run `speculant peers build-llamacpp` "
             "once (about 7 minutes on 2 cores)")


def _import() -> Any:
    if not available():
        raise ModelNotAvailable(NOT_BUILT)
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as error:  # a libllama that does not load (FileNotFoundError: none)
        raise ModelNotAvailable(f"llama-cpp-python cannot load llama.cpp ({error}); {NOT_BUILT}") from None
    if not getattr(_import, "ready", False):
        llama_cpp.llama_backend_init()

        @llama_cpp.llama_log_callback
        def quiet(level: int, text: bytes, user_data: Any) -> None:
            line = text.decode(errors="replace")
            if "model buffer size" in line:  # e.g. "load_tensors:   CPU_REPACK model buffer size = 950 MiB"
                _buffers.append(line.split("model buffer size")[0].split(":")[-1].strip())
            if line.strip(". \n"):  # not a progress dot
                _log.append(line)

        _import.callback = quiet  # a C callback must outlive its registration
        llama_cpp.llama_log_set(quiet, None)
        _import.ready = True
    return llama_cpp


def available() -> bool:
    """Whether the llama.cpp backend can run here, without loading it: llama-cpp-python's bindings are installed
    and a libllama lies where they will load it from (`LLAMA_CPP_LIB_PATH`, which `choose_library` sets to this
    machine's native build, else their own `lib/`, empty where `speculant peers build-llamacpp` installed them)."""
    if "llama_cpp" in sys.modules:
        return True
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return False
    choose_library()
    folder = os.environ.get("LLAMA_CPP_LIB_PATH") or Path(next(iter(spec.submodule_search_locations))) / "lib"
    names = ("libllama.so", "libllama.dylib", "llama.dll", "libllama.dll")
    return any((Path(folder) / name).is_file() for name in names)


def library_path() -> Path:
    """The libllama file in use."""
    return Path(_import().llama_cpp._lib._name).resolve()


def system_info() -> dict[str, str]:
    """ggml's CPU build: `variant` (native, or the runtime-chosen variants of a GGML_BACKEND_DL build), the
    features it was compiled with, and the library's path."""
    lib = _import()
    features = []
    for part in lib.llama_print_system_info().decode().split("|"):  # "CPU : SSE3 = 1 | ... | AMX_INT8 = 1 |"
        name, _, value = part.split(":")[-1].partition("=")
        if value.strip() == "1":
            features.append(name.strip())
    folder = library_path().parent
    variants = sorted(p.name.removeprefix("libggml-cpu-").split(".")[0] for p in folder.glob("libggml-cpu-*.so"))
    return {"variant": "dynamic: " + ", ".join(variants) if variants else "native (one CPU backend)",
            "features": " ".join(features), "library": str(library_path())}


def _library_key() -> str:
    path = library_path()
    stat = path.stat()
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}"


def extra_buffers_fault(path: Path) -> bool:
    """Whether loading `path` with ggml's extra buffer types faults at its first forwards: tried where ggml has
    an AMX matmul (not in speculant's own build), in a child process, once per library, CPU and file (cached)."""
    from speculant.cache import remembered
    from speculant.machine import cpu_info

    from speculant.models.backends.llamacpp_build import manifest

    built = manifest()
    if "AMX_INT8" not in system_info()["features"].split() or (
            built is not None and built.get("amx_fix") and library_path().parent == Path(built["lib"]).resolve()):
        return False  # no AMX matmul, or speculant's own build, which carries the fix
    stat = path.stat()
    key = f"{_library_key()}|{cpu_info()[0]}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"

    def faults() -> bool:
        child = subprocess.run([sys.executable, "-c", f"from speculant.models.backends.llamacpp import try_forwards; "
                                f"try_forwards({str(path)!r})"], capture_output=True, timeout=600,
                               env={**os.environ, "LLAMA_CPP_LIB_PATH": str(library_path().parent)})
        return child.returncode < 0  # killed by a signal; other failures show up in this process

    return bool(remembered("llamacpp-faults.json", key, faults))


def try_forwards(path: str) -> None:
    """One context on `path` with every extra buffer type, a one-token and an eight-token forward (run in a
    child process by `extra_buffers_fault`)."""
    weights = GGUFWeights(path, extra_buffers=True)
    weights.width = 8  # no width measurement: just the forwards
    model = LlamaCppCausalLM(weights)
    model.prefill([1])
    model.forward([2] * 8)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def aborting_header(path: Path) -> str | None:
    """What in a GGUF file's header llama.cpp would end the process on (a failed GGML_ASSERT, where other faults are
    errors it returns): a block count below 1. None where there is none, or where speculant's reader cannot read the
    header (llama.cpp then says what it cannot read)."""
    from speculant.errors import SpeculantError
    from speculant.models import gguf_header

    def key(fields: dict[str, Any]) -> str:
        return f"{fields.get('general.architecture')}.block_count"

    try:  # (read up to that key: a tokenizer's bulk comes after the model's own keys)
        fields = gguf_header.GGUFFile(path, until=lambda fields: key(fields) in fields).fields
    except SpeculantError:
        return None
    count = fields.get(key(fields))
    if isinstance(count, (int, np.integer)) and not isinstance(count, bool) and count < 1:
        return f"its {key(fields)} is {count}: a model has at least one block"
    return None


class GGUFWeights:
    """One GGUF file mapped by llama.cpp; every context (LlamaCppCausalLM) on it shares the weights."""

    def __init__(self, path: str | Path, extra_buffers: bool | None = None):
        """`extra_buffers`: load with ggml's extra buffer types (AMX, repacked weights); None: unless they fault."""
        lib = _import()
        self.lib = lib
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotAvailable(f"no GGUF file at {self.path}")
        if fault := aborting_header(self.path):
            raise ConfigError(f"{self.path.name}: {fault}")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        if extra_buffers is None:
            extra_buffers = not extra_buffers_fault(self.path)
            if not extra_buffers:
                log.warning("this llama.cpp build faults in ggml's AMX matmul (GCC 12 miscompiles its tile "
                            "configuration): %s runs without AMX and repacked weights; `speculant peers "
                            "build-llamacpp` builds a fixed native llama.cpp", self.path.name)
        params.use_extra_bufts = extra_buffers
        _buffers.clear()
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        self.buffers = list(_buffers)  # where the weights live: AMX, CPU_REPACK, CPU_Mapped
        if not self.model:
            raise ModelNotAvailable(f"llama.cpp cannot load {self.path}: {''.join(_log).strip()[-300:]}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = min(N_CTX, lib.llama_model_n_ctx_train(self.model) or N_CTX)
        desc = ctypes.create_string_buffer(128)
        lib.llama_model_desc(self.model, desc, len(desc))
        self.description = desc.value.decode()
        self.width: int | None = None  # set by the first context: see invariant_width
        arch = self.metadata("general.architecture")
        window = self.metadata(f"{arch}.attention.sliding_window")
        if arch in UNWINDOWED and window is not None and int(window) < self.n_ctx:
            raise ConfigError(f"{self.path.name}: a {arch} GGUF with a sliding window of {window} positions, which "
                              "llama.cpp does not apply to this architecture: run it with --backend lean")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None where the file has none."""
        value = ctypes.create_string_buffer(256)
        if self.lib.llama_model_meta_val_str(self.model, key.encode(), value, len(value)) < 0:
            return None
        return value.value.decode()

    def __del__(self) -> None:
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None


_weights: dict[Path, weakref.ref] = {}
_loading = threading.Lock()  # one load at a time: llama.cpp's log callback fills one `_buffers` for the load it hears


def shared_weights(path: str | Path) -> GGUFWeights:
    """The GGUFWeights of a file, shared while any context on it lives (threads loading one file at once share one
    load)."""
    key = Path(path).resolve()
    with _loading:
        weights = _weights[key]() if key in _weights else None
        if weights is None:
            weights = GGUFWeights(key)
            _weights[key] = weakref.ref(weights)
    return weights


@dataclass
class _Entry:
    """One token of a llama.cpp batch."""

    token: int
    pos: int
    seqs: list[int]  # the first decides what it attends to; all of them own its cell
    logits: bool


@dataclass
class _Tree:
    """The draft tree in the cache, its root at position `begin` (the committed text before it holds
    positions 0 .. begin - 1 of sequence 0)."""

    begin: int
    tokens: list[int] = field(default_factory=list)  # cached nodes, in node order
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)  # per node: the sequence whose cells are its root path
    cell: list[int] = field(default_factory=list)  # per node: its cell, counted from `begin`
    tip: dict[int, int] = field(default_factory=dict)  # sequence -> its deepest node


def depth_first(tree: TokenTree) -> list[int]:
    """Nodes in depth-first preorder, children in node order: the first chain comes first."""
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(tree.child_lists[node]))
    return order


class LlamaCppCausalLM(Backend):
    """A llama.cpp context on GGUF weights: the KV cache of one sequence (see the module docstring)."""

    backend = "llamacpp"
    capabilities = Capabilities(shares_weights=True, prefills_in_parts=True, interruptible=True,
                                gguf=True, replicates=True, tree_nodes=N_SEQ - 1)  # (a sequence id per leaf)

    def catalog_drafter_spec(self, drafter: str) -> str:
        """Its GGUF on llama.cpp too."""
        return f"{drafter}@gguf"

    def beside(self, others: int) -> LlamaCppCausalLM:
        """A context on its share of the threads."""
        return self.share(max(1, self.threads // (others + 1)))

    def replicas(self, servers: int, drafting: bool) -> Callable[[str], LlamaCppCausalLM]:
        """Each server maps the GGUF file by path, with a context of its own and the machine's threads shared out
        between the servers and, where a model drafts beside them, the drafter."""
        return partial(gguf_replica, str(self.weights.path), self.name, self.eos_token_ids,
                       max(1, self.threads // (servers + drafting)))

    def describe(self) -> list[str]:
        info = system_info()
        return [f"llama.cpp: {info['library']}", f"  ggml CPU variant: {info['variant']}",
                f"  features: {info['features']}", f"{self.name}: weights in {' + '.join(self.weights.buffers)} "
                f"buffers, rows invariant up to {self.width} tokens per forward"]

    def __init__(self, weights: GGUFWeights, tokenizer: Any | None = None, name: str | None = None,
                 extra_eos: frozenset[int] = frozenset(), identity: str | None = None, threads: int | None = None):
        lib = self.lib = weights.lib
        self.weights = weights
        self.tokenizer = tokenizer
        self.name = name or weights.path.stem
        self.identity = identity
        self.threads = threads or default_threads()
        self.vocab_size = weights.n_vocab
        eos = {lib.llama_vocab_eos(weights.vocab)} | set(extra_eos)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(t for t in eos if 0 <= t < self.vocab_size)
        self.max_positions = weights.n_ctx
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # of the logits; the weights keep their GGUF types
        self.numerics = f"llama.cpp {weights.description}"
        # ggml's kernels follow the weights' buffers (e.g. "ggml AMX", "ggml CPU_REPACK"): part of the profile's key
        self.kernel = " ".join(["ggml", *[b for b in weights.buffers if b not in ("CPU", "CPU_Mapped")]])
        params = lib.llama_context_default_params()
        params.n_ctx = weights.n_ctx
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = N_SEQ
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True  # sequences share cells: a tree's paths share their common nodes
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.type_k = params.type_v = KV_TYPE  # one attention path for every width (see above)
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(weights.model, params)
        if not self.ctx:
            raise ModelNotAvailable(f"llama.cpp cannot create a context for {self.name}: {''.join(_log).strip()[-300:]}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(N_BATCH, 0, N_SEQ)
        self._physical = 0  # committed tokens in the cache: positions 0 .. _physical - 1 of sequence 0
        self._pending: list[int] = []  # committed tokens not yet in the cache, run first by the next forward
        self._tree: _Tree | None = None
        self._free_seqs = list(range(N_SEQ - 1, 0, -1))
        self.width = 1  # tokens per llama_decode after the prompt: measured next
        self.interrupt: Callable[[], bool] | None = None  # see CausalLM; llama.cpp asks before every graph node
        me = weakref.ref(self)  # the callback must not keep its context alive
        self._abort = lib.ggml_abort_callback(lambda _: bool((m := me()) is not None and m.interrupt and m.interrupt()))
        if weights.width is None:
            weights.width = invariant_width(self)
        self.width = weights.width

    def __repr__(self) -> str:
        return f"LlamaCppCausalLM({self.name!r}, {self.weights.description}, threads={self.threads})"

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def share(self, threads: int | None = None) -> LlamaCppCausalLM:
        """Another context on the same weights (a KV cache of its own), on `threads` threads (default: these)."""
        return LlamaCppCausalLM(self.weights, self.tokenizer, self.name, self.eos_token_ids, self.identity,
                                threads or self.threads)

    @property
    def cache_len(self) -> int:
        if self._tree is not None:
            return self._tree.begin + len(self._tree.tokens)
        return self._physical + len(self._pending)

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The prompt in its `prefill_parts`, one llama_decode each: what a server running them apart computes."""
        return self.prefill_by_parts(ids)

    def continue_prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """A part of a prompt after its earlier parts (`prefill_parts`); the logits of its last token. An interrupted
        part leaves the cache as the earlier parts left it."""
        return self._chain(ids, 1, N_BATCH)[0]

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        """With `tree`, `ids` are its last nodes, the earlier ones cached (see CausalLM.forward)."""
        if tree is not None:
            return self._forward_tree(list(ids), positions, tree)
        start = self.cache_len
        if positions is not None and list(positions) != list(range(start, start + len(ids))):
            raise ValueError("the llama.cpp backend runs new tokens at the next positions only")
        return self.catch_up(ids, len(ids))

    def catch_up(self, ids: Sequence[int], rows: int = 1) -> torch.Tensor:
        """The tokens at the next positions, logits asked of llama.cpp for the last `rows` only."""
        return self._chain(ids, rows, self.width)

    def _chain(self, ids: Sequence[int], rows: int, width: int) -> torch.Tensor:
        """The tokens at the next positions (after any waiting to be written), `width` per llama_decode; the logits
        of the last `rows`. Cut short or failed, it drops what it cached."""
        if self._tree is not None:
            raise ValueError("the cache holds a draft tree: keep() its accepted path or roll it back first")
        start, physical, pending = self.cache_len, self._physical, self._pending
        if start + len(ids) > self.max_positions:
            raise ValueError(f"{start + len(ids)} positions exceed the llama.cpp context of {self.max_positions}")
        entries = self._take_pending() + [_Entry(t, start + i, [0], i >= len(ids) - rows) for i, t in enumerate(ids)]
        try:
            logits = self._decode(entries, width)
        except Exception:  # cut short or failed: drop what it cached, so the cache is what it says
            self.lib.llama_memory_seq_rm(self.memory, 0, physical, -1)
            self._physical, self._pending = physical, pending
            raise
        self._physical = start + len(ids)
        return logits

    def _take_pending(self) -> list[_Entry]:
        entries = [_Entry(t, self._physical + i, [0], False) for i, t in enumerate(self._pending)]
        self._pending = []
        return entries

    def _forward_tree(self, ids: list[int], positions: Sequence[int] | None, tree: TokenTree) -> torch.Tensor:
        start = len(tree) - len(ids)  # the first new node
        state, skip, fresh = self._tree, 0, self._tree is None
        if fresh:  # (checked before the cache changes: a refused call leaves it as it was)
            if start > 1:
                raise ValueError("ids must be the last nodes of the tree, with the earlier ones cached")
            if start == 1 and self._pending:  # the root is committed but not yet in the cache: run it too
                ids, start, skip = [tree.tokens[0], *ids], 0, 1
            state = _Tree(self.cache_len - start - skip)
            if start == 1:  # the root sits in the cache as plain text: it becomes the tree's first cell
                state.tokens, state.parents, state.depths, state.seq, state.cell = [tree.tokens[0]], [-1], [0], [0], [0]
                state.tip[0] = 0
        if start != len(state.tokens) or ids != list(tree.tokens[start:]) or list(tree.parents[:start]) != state.parents:
            raise ValueError("ids must be the last nodes of the tree, with the earlier ones cached")
        if positions is not None and list(positions) != tree.positions(state.begin)[start + skip:]:
            raise ValueError("tree nodes run at their root's position plus their depth")
        if state.begin + len(tree) > self.max_positions:
            raise ValueError(f"a tree of {len(tree)} nodes after {state.begin} positions exceeds the llama.cpp "
                             f"context of {self.max_positions}")
        before = (self._physical, list(self._pending), list(self._free_seqs), len(state.tokens), dict(state.tip))
        try:
            return self._extend_tree(ids, tree, state, start, skip, fresh)
        except Exception:  # refused, cut short or failed: the cache and the tree as they were before the call
            self._undo_tree(state, fresh, *before)
            raise

    def _extend_tree(self, ids: list[int], tree: TokenTree, state: _Tree, start: int, skip: int,
                     fresh: bool) -> torch.Tensor:
        if fresh and skip:
            self._pending.pop()
        elif fresh and start == 1:
            self._physical -= 1
        boundary = self._physical  # committed cells before this batch: a new sequence copies them
        entries = self._take_pending()
        self._physical = state.begin
        in_batch: dict[int, int] = {}  # node -> its entry in this batch
        for node in range(start, len(tree)):
            state.tokens.append(tree.tokens[node])
            state.parents.append(tree.parents[node])
            state.depths.append(tree.depths[node])
            state.seq.append(-1)
            state.cell.append(-1)
        order = [n for n in depth_first(tree) if n >= start]
        for cell, node in enumerate(order, start):
            parent = tree.parents[node]
            if node == 0:
                seq = 0
            elif state.tip.get(state.seq[parent]) == parent:  # the parent's path goes on through its first child
                seq = state.seq[parent]
            else:
                seq = self._new_seq(state, parent, in_batch, entries, boundary)
            state.seq[node], state.cell[node], state.tip[seq] = seq, cell, node
            in_batch[node] = len(entries)
            entries.append(_Entry(tree.tokens[node], state.begin + tree.depths[node], [seq], True))
        self._tree = state
        rows = self._decode(entries, self.width)  # [new nodes in depth-first order, vocab]
        where = {node: i for i, node in enumerate(order)}
        return rows[[where[n] for n in range(start + skip, len(tree))]]

    def _undo_tree(self, state: _Tree, fresh: bool, physical: int, pending: list[int], free: list[int], nodes: int,
                   tip: dict[int, int]) -> None:
        """Drop what a tree forward cached: the sequences it began, and the cells past each earlier sequence's tip
        (past the committed cells where the tree was new)."""
        for seq in set(free) - set(self._free_seqs):
            self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        if fresh:
            self.lib.llama_memory_seq_rm(self.memory, 0, physical, -1)
            self._tree = None
        else:
            for seq, node in tip.items():
                self.lib.llama_memory_seq_rm(self.memory, seq, state.begin + state.depths[node] + 1, -1)
            for column in (state.tokens, state.parents, state.depths, state.seq, state.cell):
                del column[nodes:]
            state.tip.clear()
            state.tip.update(tip)
        self._physical, self._pending, self._free_seqs = physical, pending, free

    def _new_seq(self, state: _Tree, parent: int, in_batch: dict[int, int], entries: list[_Entry],
                 boundary: int) -> int:
        """A fresh sequence holding the path up to `parent`: added to the path's tokens in this batch and
        copied from the cells before them."""
        if not self._free_seqs:
            raise ValueError(f"the llama.cpp backend verifies trees of at most {N_SEQ - 1} leaves")
        seq = self._free_seqs.pop()
        node = parent
        while node in in_batch:
            entries[in_batch[node]].seqs.append(seq)
            if node == 0:  # past the root: the committed tokens sent with this batch, then the cache
                for entry in entries[: in_batch[0]]:
                    entry.seqs.append(seq)
                if boundary:
                    self.lib.llama_memory_seq_cp(self.memory, 0, seq, -1, boundary)
                return seq
            node = state.parents[node]
        self.lib.llama_memory_seq_cp(self.memory, state.seq[node], seq, -1, state.begin + state.depths[node] + 1)
        return seq

    def keep(self, kept: int, path: Sequence[int]) -> None:
        path = checked_path(kept, path, self.cache_len)
        state = self._tree
        if state is None:
            if path != list(range(kept, kept + len(path))):
                raise ValueError("without a tree in the cache, keep only a prefix")
            self.rollback(kept + len(path))
            return
        begin = state.begin
        path = [i - begin for i in [*range(begin, kept), *path]]  # the tree's nodes kept (0: its root)
        if kept < begin or not path or path[0] != 0 or any(
                not 0 <= n < len(state.parents) or state.parents[n] != p for p, n in zip(path, path[1:])):
            raise ValueError("keep the cache before the tree and one root-to-node path of the tree")
        in_place = 0  # the path's leading nodes that sit where plain decoding puts them
        while in_place < len(path) and state.cell[path[in_place]] == in_place:
            in_place += 1
        self._drop_tree(begin + in_place)
        self._physical, self._pending = begin + in_place, [state.tokens[n] for n in path[in_place:]]

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.cache_len:
            raise ValueError(f"cannot roll back to {n} cached positions: {self.cache_len} are cached")
        if n == self.cache_len:
            return
        state = self._tree
        if state is not None:
            if any(state.parents[i] != i - 1 or state.cell[i] != i for i in range(1, n - state.begin)):
                raise ValueError("roll a tree back to its root or a prefix of its first chain only")
            self._drop_tree(n)
            self._physical = n
            return
        if n == 0:
            self.lib.llama_memory_clear(self.memory, True)
            self._physical, self._pending = 0, []
        elif n >= self._physical:
            self._pending = self._pending[: n - self._physical]
        else:
            self.lib.llama_memory_seq_rm(self.memory, 0, n, -1)
            self._physical, self._pending = n, []

    def _drop_tree(self, keep: int) -> None:
        """Remove every tree sequence and sequence 0's cells from position `keep` on."""
        used = set(self._tree.seq) - {0} if self._tree else set()
        for seq in used:
            self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self._free_seqs = list(range(N_SEQ - 1, 0, -1))
        self.lib.llama_memory_seq_rm(self.memory, 0, keep, -1)
        self._tree = None

    def _decode(self, entries: list[_Entry], width: int) -> torch.Tensor:
        """Run entries in order, `width` per llama_decode; the logits of those that want them [n, vocab]."""
        lib, rows = self.lib, []
        interruptible = self.interrupt is not None
        if interruptible:  # a Python call per graph node: only for forwards that may be cut short
            lib.llama_set_abort_callback(self.ctx, self._abort, None)
        try:
            for begin in range(0, len(entries), width):
                rows += self._decode_chunk(entries[begin: begin + width])
        finally:
            if interruptible:
                lib.llama_set_abort_callback(self.ctx, lib.ggml_abort_callback(), None)
        return torch.cat(rows) if rows else torch.empty(0, self.vocab_size)

    def _decode_chunk(self, chunk: list[_Entry]) -> list[torch.Tensor]:
        """One llama_decode; the logits rows its entries want ([] or one [n, vocab] tensor)."""
        lib, batch = self.lib, self.batch
        batch.n_tokens = len(chunk)
        for i, entry in enumerate(chunk):
            batch.token[i] = entry.token
            batch.pos[i] = entry.pos
            batch.n_seq_id[i] = len(entry.seqs)
            for j, seq in enumerate(entry.seqs):
                batch.seq_id[i][j] = seq
            batch.logits[i] = entry.logits
        status = lib.llama_decode(self.ctx, batch)
        if status == 2:  # the abort callback said so
            raise Interrupted
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}): {''.join(_log).strip()[-400:]}")
        wanted = sum(e.logits for e in chunk)
        if not wanted:
            return []
        out = np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(wanted, self.vocab_size))
        return [torch.from_numpy(out.copy())]


def invariant_width(model: LlamaCppCausalLM) -> int:
    """The widest forward (up to PROBE_WIDTH tokens) whose every row equals, bit for bit, the logits of the
    same tokens run one at a time after PROBE_CONTEXT cached tokens (where the model has room): measured once
    per GGUF file, machine and llama.cpp build (cached)."""
    from speculant.cache import remembered
    from speculant.machine import cpu_info

    path = model.weights.path
    key = f"{path.resolve()}|{path.stat().st_size}|{path.stat().st_mtime_ns}|{cpu_info()[0]}|" \
          f"{' '.join(sorted(cpu_info()[1]))}|{_library_key()}|{'+'.join(model.weights.buffers)}|" \
          f"{model.threads} threads|up to {PROBE_WIDTH}|{KV_TYPE} KV|at {PROBE_CONTEXT}"

    def measure() -> int:
        vocab, context = model.vocab_size, max(min(PROBE_CONTEXT, model.max_positions - PROBE_WIDTH - 1), 1)
        tokens = [(i * 7919 + 13) % vocab for i in range(context + PROBE_WIDTH)]
        prompt, new = tokens[:context], tokens[context:]
        model.width = 1
        model.prefill(prompt)
        single = torch.cat([model.forward([t]) for t in new])
        width = 1
        for trial in range(2, PROBE_WIDTH + 1):
            model.rollback(len(prompt))
            model.width = trial
            if not torch.equal(model.forward(new[:trial]), single[:trial]):
                break
            width = trial
        model.rollback(0)
        return width

    return int(remembered("llamacpp-widths.json", key, measure))


def gguf_replica(path: str, name: str, eos: frozenset[int], threads: int, device: str) -> LlamaCppCausalLM:
    """A DSI server's own llama.cpp context on a GGUF file, mapped once per process and shared by its contexts."""
    if device != "cpu":
        raise ConfigError("speculant's llama.cpp backend runs on the CPU")
    return LlamaCppCausalLM(shared_weights(path), None, name, eos, threads=threads)
