"""The CausalLM contract: one model plus its KV cache for one sequence (docs/architecture.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch

from speculant.errors import ConfigError
from speculant.trees.tree import TokenTree


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model with a KV cache that can grow, roll back and be compacted.

    `cache_len` counts the positions whose keys and values are cached. The algorithms drive every
    backend through this protocol alone, and read what a backend can do beyond it from `capabilities`
    (`Capabilities`): nobody outside `models/` asks which backend a model is.
    """

    name: str
    tokenizer: Any | None  # a transformers tokenizer when one is known
    vocab_size: int  # width of a logits row
    eos_token_ids: frozenset[int]
    max_positions: int | None  # the most positions the model can attend over (None: no known limit)
    device: torch.device
    dtype: torch.dtype
    numerics: str  # the numeric path, e.g. "fp32": outputs are comparable only between equal numerics
    capabilities: Capabilities

    @property
    def cache_len(self) -> int: ...

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Reset the cache, run the prompt; return the logits of its last token, float32 [vocab]."""
        ...

    def forward(
        self, ids: Sequence[int], positions: Sequence[int] | None = None, tree: TokenTree | None = None
    ) -> torch.Tensor:
        """Run new tokens after the cached ones; return one float32 logits row per token [n, vocab],
        once computed (on CUDA too), so that a timer around a forward measures it.

        With `tree`, `ids` are the tree's last nodes (its earlier nodes being the last cached
        positions) and each node attends only to the cache before the tree and its ancestors."""
        ...

    def catch_up(self, ids: Sequence[int], rows: int = 1) -> torch.Tensor:
        """`forward(ids)`'s last `rows` logits rows [rows, vocab] (`Backend.catch_up`)."""
        ...

    def rollback(self, n: int) -> None:
        """Keep the first `n` cached positions, drop the rest."""
        ...

    def keep(self, kept: int, path: Sequence[int]) -> None:
        """Keep the first `kept` cached positions, then the positions `path` (ascending, from `kept` on): the
        accepted path of a tree after the context before it (`checked_path`). What it costs follows the path, not
        the context."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the CausalLM protocol, declared once per backend and read by callers.

    - `shares_weights`: `share()` opens a second cache on the same weights (self-drafting, a server's rows).
    - `batches_rows`: `weights_key` (equal for handles that share weights) and `rows_forward()` (a function of
      [(handle, Call)] -> each call's logits, or None where this handle's rows cannot batch) run several
      sequences' calls as one forward, each row bit for bit its own call: what a batching server uses.
    - `prefills_in_parts`: `prefill_parts(ids)` (the parts, in order) and `continue_prefill(part)` (a part after
      the earlier ones; the logits of its last token): a server runs a long prompt's parts in separate forwards,
      with the same bits as one `prefill`.
    - `interruptible`: `interrupt` (None, or a check called at every layer boundary; True raises `Interrupted`).
    - `skips_layers`: `skipping(layers)` drafts with the target's weights less some layers (`self@skip`).
    - `hidden_states`: `last_hidden`, the last layer's output at the rows the last call returned logits for
      ([rows, hidden]: a prefill's last token, a forward's every token; on the transformers backend after the
      final norm, as transformers gives it).
    - `gguf`: runs a GGUF file as it is, as llama.cpp's own tools do.
    - `replicates`: `replicas(servers, drafting)` makes DSI's target servers, replicas of this model.
    - `reuses_prefixes`: `prefix_block` (int, or None where this model cannot), `export_kv(start, end)` and
      `import_kv(pieces)`: a prompt's leading positions, in whole blocks, restored from another sequence's cache
      hold the bits its own prefill computes, and `continue_prefill` runs the rest (`speculant.prefixes`).
    - `fixed_cache`: each handle's KV cache is a fixed region a pointer moves over (a pool grows only when a handle
      is made), so a forward frees no tensor that another forward queued on another CUDA stream might still read: a
      drafter that has it drafts on a stream of its own during the target's verification (`trees.stage`).
    - `drafts_trees`: `draft_tree(root_logits, depth, width)` grows an equal-growth tree of `depth` levels of `width`
      nodes below the last cached token on the device, in one call (`trees.levels`; one compiled graph where the
      handle is compiled): (tokens, parents, path log-probabilities), the levels it ran left cached as
      `forward(tree=...)` caches them. Only the backend and `Metered` offer it: a wrapper that changes forwards
      (logits, batching, padded time) would be bypassed by it.
    - `tree_nodes`: the most drafted nodes one `forward(tree=...)` verifies (None: as many as its cache holds).
    - `quantizes_self`: `self_drafter` of `self@int8|int4` drafts with the target's weights quantized again.
    """

    shares_weights: bool = False
    batches_rows: bool = False
    prefills_in_parts: bool = False
    interruptible: bool = False
    skips_layers: bool = False
    hidden_states: bool = False
    gguf: bool = False
    replicates: bool = False
    reuses_prefixes: bool = False
    fixed_cache: bool = False
    drafts_trees: bool = False
    tree_nodes: int | None = None
    quantizes_self: bool = False


class Backend:
    """What every backend shares: its declared `capabilities` and the choices that depend on the backend, made
    here rather than by comparing backend names elsewhere. A backend overrides what differs."""

    capabilities = Capabilities()
    batch_load: Callable[[], int] | None = None  # a served request's handle: the rows its target's batches hold now
    draft_guide: Any = None  # structured output: what a drafter's rows may hold (`models.wrappers.constrained`)

    def catch_up(self, ids: Sequence[int], rows: int = 1) -> torch.Tensor:
        """`forward(ids)` returning only its last `rows` logits rows [rows, vocab]: a drafter catching up on a
        context needs the logits after its end alone, and a backend that skips the output head for the other rows
        (most of a small drafter's vocabulary projection) overrides this. A wrapper runs it through its own
        `forward`, so whatever it changes of forwards (logits, batching, padded time) holds for it too (`Metered`,
        which changes nothing, passes it to the model it counts). A backend that runs it as a forward may leave
        `last_hidden` at every row it ran."""
        return self.forward(ids)[max(len(ids) - rows, 0):]

    def prefill_parts(self, ids: Sequence[int]) -> list[list[int]]:
        """A backend that `prefills_in_parts`: the parts of a prompt (`prompt_parts`), each run after the ones
        before it by `continue_prefill`."""
        return prompt_parts(ids)

    def prefill_by_parts(self, ids: Sequence[int]) -> Any:
        """A prefill as its `prefill_parts` one after another: the bits a server that runs them apart computes."""
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self.rollback(0)
        for part in self.prefill_parts(ids):
            logits = self.continue_prefill(part)
        return logits

    def default_drafters(self) -> tuple[str, ...]:
        """The drafter specs `auto` tries for this target when none are named: its catalog drafter as this
        backend runs it best (`catalog_drafter_spec`), and Max-Gram."""
        from speculant.models.catalog import catalog_drafter

        drafter = catalog_drafter(self.name)
        return (self.catalog_drafter_spec(drafter), "maxgram") if drafter is not None else ("maxgram",)

    def catalog_drafter_spec(self, drafter: str) -> str:
        """The spec of a catalog drafter as this backend runs it best."""
        return drafter

    def draft_model(self, spec: Any, dtype: str | None) -> CausalLM:
        """The model a drafter spec names (not `self`), loaded to draft for this target: as `load_model` loads it
        (GGUF weights on the CPU go to the backend that runs them best), reading ids with the target's tokenizer where
        its own files are the same (`loading.drafter_tokenizer`)."""
        from speculant.models.loading import drafter_tokenizer, load_model

        return load_model(str(spec), dtype=dtype, tokenizer=drafter_tokenizer(self, spec.source))

    def self_drafter(self, spec: Any) -> CausalLM:
        """`self` (the target's weights with a cache of their own), `self@int8|int4` or `self@skip` for this target."""
        if spec.quant:  # (`quantizes_self` backends do)
            raise ConfigError(f"self@{spec.quant} quantizes transformers weights: load the target with --backend hf")
        if spec.skip:
            raise ConfigError("self@skip runs on the lean backend (--backend lean)")
        if not self.capabilities.shares_weights:
            raise ConfigError("self drafting needs a target that can open a second cache on its weights")
        return self.share()

    def beside(self, others: int) -> CausalLM:
        """This model as it should run beside `others` models busy on the same cores (DSI's drafter beside its
        target servers): itself, unless its backend keeps threads of its own."""
        return self

    def reserve(self, handles: int) -> None:
        """Make room now for `handles` more handles on these weights (`share`), made later: a server's full batch,
        taken at its start. Nothing, unless making a handle may cost more than its own cache (a compiled static
        pool's growth compiles its step again)."""

    def replicas(self, servers: int, drafting: bool) -> Callable[[str], CausalLM]:
        """A picklable factory of this model's replicas, `factory(device)`, for DSI's `servers` target servers
        (threads, processes or Ray actors), a model drafting beside them where `drafting`."""
        raise ConfigError("DSI's target servers are replicas of the target, which this target's backend does not "
                          "make: load the target with --backend hf or llamacpp")

    def describe(self) -> list[str]:
        """Lines about the kernels this model runs on, for `speculant profile`."""
        return []

    def compile_seconds(self) -> float | None:
        """What its first compiled step took, mostly compiling (None: it compiles none, or has run none yet)."""
        return None


class PointerCache:
    """What backends with a preallocated KV cache and a length pointer share (`lean`, `static`): the pointer is
    the cache's length, rolling back moves it, and a tree's path is compacted in the caches' own storage
    (`_keys`, `_values`: [layers, kv_heads, positions, head_dim])."""

    _len = 0
    _keys: torch.Tensor
    _values: torch.Tensor

    @property
    def cache_len(self) -> int:
        return self._len

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot roll back to {n} cached positions: {self._len} are cached")
        self._len = n

    def keep(self, kept: int, path: Sequence[int]) -> None:
        """Compact the cache in place to its first `kept` positions and `path` (`CausalLM.keep`): the storage is
        never reallocated, and only the positions that move are copied (after a tree, its kept path; the context
        before it stays where it is)."""
        path = checked_path(kept, path, self._len)
        moved = next((i for i, position in enumerate(path) if position != kept + i), len(path))  # those in place lead
        end = kept + len(path)
        if moved < len(path):
            where = torch.as_tensor(path[moved:], dtype=torch.long, device=self._keys.device)
            self._keys[:, :, kept + moved:end] = self._keys[:, :, where]
            self._values[:, :, kept + moved:end] = self._values[:, :, where]
        self._len = end

    def export_kv(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the cached keys and values at positions [start, end) (what a prefix cache keeps)."""
        if not 0 <= start <= end <= self._len:
            raise ValueError(f"cannot export positions [{start}, {end}): {self._len} are cached")
        return self._keys[:, :, start:end].clone(), self._values[:, :, start:end].clone()

    def import_kv(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make the cache hold `pieces` (`export_kv`'s, in order) from position 0, and nothing after them."""
        at = 0
        for keys, values in pieces:
            n = keys.shape[2]
            self._keys[:, :, at:at + n] = keys
            self._values[:, :, at:at + n] = values
            at += n
        self._len = at


class Interrupted(Exception):
    """A forward stopped at a layer boundary because its model's `interrupt` check returned True (DSI
    preemption, Timor et al. 2025, Algorithm 1: a thread on a rejected draft is terminated). The model's
    cache is as it was before that forward."""


@dataclass(frozen=True)
class Call:
    """One call of a CausalLM's `prefill` (then `positions` and `tree` are None) or `forward`, as data: what a
    batching server collects from many sequences and runs together."""

    ids: Sequence[int]
    prefill: bool = False
    positions: Sequence[int] | None = None
    tree: TokenTree | None = None
    continues: bool = False  # with prefill: a later part of a prompt (`prefill_parts`), after the earlier ones
    restored: bool = False  # with prefill: the first part run, after the prompt's prefix restored from a prefix cache
    rows: int | None = None  # with a forward: the logits of its last `rows` tokens only (`catch_up`)

    @property
    def resumes(self) -> bool:
        """A prefill's part that runs after positions already cached (`continue_prefill`)."""
        return self.continues or self.restored

    def run(self, model: CausalLM) -> torch.Tensor:
        if self.prefill:
            return model.continue_prefill(self.ids) if self.resumes else model.prefill(self.ids)
        if self.rows is not None:
            return model.catch_up(self.ids, self.rows)
        return model.forward(self.ids, self.positions, tree=self.tree)


def owner_of(model: Any) -> Any:
    """What per-model knowledge (machine profiles, measured costs, learned acceptance) is kept under: for a
    server's per-request handle the model it shares (`serve.batcher.Row.owner`), for a Wrapper the model it
    wraps, else the model itself."""
    return getattr(model, "owner", model)


@functools.cache
def _without_trees(capabilities: Capabilities) -> Capabilities:
    """`capabilities` less `drafts_trees` (made once per set: a step reads a wrapper's capabilities)."""
    return replace(capabilities, drafts_trees=False)


def _forwarded(name: str, doc: str = "") -> property:
    return property(lambda self: getattr(self.model, name), doc=doc or f"the wrapped model's `{name}`")


def adopted(model: CausalLM) -> CausalLM:
    """`model`, a CausalLM given loaded, where its class derives from `Backend`: the choices that depend on the
    backend (what `auto` tries, how self drafting and DSI's servers are made) are asked of it. A class that
    implements the protocol alone gets a ConfigError saying so, before a method asks it for one of them."""
    inner = model
    while isinstance(inner, Delegating):  # (a wrapper forwards those questions to the model it wraps)
        inner = inner.model
    if not isinstance(inner, Backend):
        raise ConfigError(f"a model of your own ({type(inner).__name__}) must derive from "
                          "speculant.models.base.Backend, whose defaults answer what auto, self drafting and DSI ask "
                          "of a backend (docs/architecture.md, 'A backend')")
    return model


class Delegating(Backend):
    """A CausalLM around another (`model`) that forwards, explicitly, every member of the contract (`catch_up` runs
    through its own `forward`, as `Backend`'s does), the declared capabilities and what they make available, and the
    backend's choices: whatever it wraps, a wrapper is a CausalLM with the same capabilities, in any order of
    wrapping. A subclass overrides the calls it changes (`Wrapper`s change logits, `models.wrappers.metered` counts
    forwards, a server's `Row` batches them, DSI's twin pads their time)."""

    def __init__(self, model: CausalLM):
        self.model = model

    @property
    def owner(self) -> Any:
        """The model what is learned of this one is kept under (`owner_of`)."""
        return owner_of(self.model)

    name = _forwarded("name")
    tokenizer = _forwarded("tokenizer")
    vocab_size = _forwarded("vocab_size")
    eos_token_ids = _forwarded("eos_token_ids")
    max_positions = _forwarded("max_positions")
    device = _forwarded("device")
    dtype = _forwarded("dtype")
    numerics = _forwarded("numerics")
    passes_trees = False  # whether `draft_tree` goes through this wrapper as its forwards do (`Metered`)

    @property
    def capabilities(self) -> Capabilities:
        """The wrapped model's, less `drafts_trees` unless this wrapper passes trees through."""
        capabilities = self.model.capabilities
        return capabilities if self.passes_trees else _without_trees(capabilities)

    identity = _forwarded("identity", "what the weights are when loaded by name (profiles persist per identity)")
    kernel = _forwarded("kernel", "the kernel its forwards run on")
    batch_load = _forwarded("batch_load")
    draft_guide = _forwarded("draft_guide")
    cache_len = _forwarded("cache_len")
    prefix_block = _forwarded("prefix_block")
    last_hidden = _forwarded("last_hidden")

    @property
    def interrupt(self) -> Callable[[], bool] | None:
        return self.model.interrupt

    @interrupt.setter
    def interrupt(self, check: Callable[[], bool] | None) -> None:
        self.model.interrupt = check

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return self.model.prefill(ids)

    def forward(self, ids: Sequence[int], positions: Sequence[int] | None = None,
                tree: TokenTree | None = None) -> torch.Tensor:
        return self.model.forward(ids, positions, tree=tree)

    def rollback(self, n: int) -> None:
        self.model.rollback(n)

    def keep(self, kept: int, path: Sequence[int]) -> None:
        self.model.keep(kept, path)

    def share(self) -> CausalLM:
        return self.model.share()

    def prefill_parts(self, ids: Sequence[int]) -> list[list[int]]:
        return self.model.prefill_parts(ids)

    def continue_prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return self.model.continue_prefill(ids)

    def export_kv(self, start: int, end: int) -> Any:
        return self.model.export_kv(start, end)

    def import_kv(self, pieces: Sequence[Any]) -> None:
        self.model.import_kv(pieces)

    @property
    def weights_key(self) -> int:
        return self.model.weights_key

    def rows_forward(self) -> Any:
        return self.model.rows_forward()

    def skipping(self, skipped: Sequence[int]) -> CausalLM:
        return self.model.skipping(skipped)

    def default_drafters(self) -> tuple[str, ...]:
        return self.model.default_drafters()

    def catalog_drafter_spec(self, drafter: str) -> str:
        return self.model.catalog_drafter_spec(drafter)

    def draft_model(self, spec: Any, dtype: str | None) -> CausalLM:
        return self.model.draft_model(spec, dtype)

    def self_drafter(self, spec: Any) -> CausalLM:
        return self.model.self_drafter(spec)

    def beside(self, others: int) -> CausalLM:
        inner = self.model.beside(others)
        return self if inner is self.model else inner  # (a handle of its own: the wrapper's calls are not its)

    def reserve(self, handles: int) -> None:
        self.model.reserve(handles)

    def replicas(self, servers: int, drafting: bool) -> Callable[[str], CausalLM]:
        return self.model.replicas(servers, drafting)

    def describe(self) -> list[str]:
        return self.model.describe()

    def compile_seconds(self) -> float | None:
        return self.model.compile_seconds()


class Wrapper(Delegating):
    """A CausalLM around another that changes its logits (`models.wrappers`: logprobs, biased, constrained)."""


def unwrapped(model: Any) -> Any:
    """The model under any Wrappers (what records, biases or masks its logits)."""
    while isinstance(model, Wrapper):
        model = model.model
    return model


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """How many leading items two sequences of one type (lists of ids, bytes) share: a binary search over prefix
    comparisons, each one C-speed slice equality, where a loop in Python would walk the whole context every time a
    drafter's lag is asked (each decode step: no check of the types here). Sequences whose slices never compare
    equal (a list's and a tuple's) would share 0."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi + 1] differs or hi is the shorter length
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
    return lo


def checked_path(kept: int, path: Sequence[int], cached: int) -> list[int]:
    """`path` as a list, where `keep(kept, path)` asks for what a cache of `cached` positions holds: `kept` of them
    leading, then later positions, ascending; else a ValueError."""
    path = list(path)
    if not (0 <= kept <= cached and all(a < b for a, b in zip([kept - 1, *path], [*path, cached]))):
        raise ValueError(f"keep {kept} leading positions and {path} after them: they must ascend within the "
                         f"{cached} cached")
    return path


PREFILL_PART = 512  # prompt tokens per part of a prefill (`prompt_parts`): a served prompt's parts run in separate
# forwards, so the running requests decode between them instead of waiting for the whole prompt


def prompt_parts(ids: Sequence[int], size: int | None = None) -> list[list[int]]:
    """A prompt in the parts of `size` tokens (default PREFILL_PART, read when called: tests and
    scripts/prefill_parts.py set it) that a backend with `prefill_parts` prefills it in."""
    size = size or PREFILL_PART
    return [list(ids[start:start + size]) for start in range(0, len(ids), size)]


PREFILL_AFTER = 8  # unmeasured: a catch-up this many times longer than the prefix it could keep runs as a prefill


def prefills(keep: int, lag: int) -> bool:
    """Whether a cache that shares `keep` leading positions with a context, and lacks `lag` more, catches up by
    prefilling the whole context rather than by a `catch_up` on the rest, where the model's costs on this machine
    are unknown: a new prompt beside a few shared tokens. Where they are known, `LatencyProfile.prefills` decides
    (docs/results/cpu.md, "A drafter's catch-up without the rows it throws away")."""
    return keep * PREFILL_AFTER < lag


def resync(model: CausalLM, cached: list[int], context: list[int], extra: Sequence[int] = (),
           rule: Callable[[int, int], bool] = prefills) -> torch.Tensor:
    """Bring `model`'s cache (holding `cached`) to `context` + `extra`, re-running only what differs (at
    least context[-1]; all of it where `rule`(kept, lacking) says a prefill is cheaper); return the logits after
    context[-1] and after each extra token, [1 + len(extra), vocab]."""
    keep = min(common_prefix_len(cached, context), len(context) - 1)
    if rule(keep, len(context) - keep):
        logits = model.prefill(context)[None]
        return torch.cat([logits, model.forward(list(extra))]) if extra else logits
    model.rollback(keep)
    return model.catch_up(context[keep:] + list(extra), 1 + len(extra))


class DraftCache:
    """A model and the ids its KV cache holds. Drafters that run on one model share one DraftCache (in
    `auto`, a chain, its cascade and its token trees), so each catches up from where the last one left the
    cache instead of prefilling a cache of its own (positions past `ids`, e.g. a tree's nodes, are dropped
    by the next `run`)."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.ids: list[int] = []
        self.prefills: Callable[[int, int], bool] = prefills  # its machine profile's rule where one is read (auto)

    def lag(self, context: list[int]) -> int:
        """Tokens of `context` the cache lacks: what the next `run` runs before the rest."""
        return len(context) - common_prefix_len(self.ids, context)

    def run(self, context: list[int], extra: Sequence[int] = ()) -> torch.Tensor:
        """`resync` to `context` + `extra`, then record that the cache holds them (failed, that it holds nothing
        known: the cache may have been rolled back or prefilled in part; `Interrupted`, what the model kept, the
        cache being as before that forward)."""
        cached, self.ids = self.ids, []
        try:
            logits = resync(self.model, cached, context, extra, self.prefills)
        except Interrupted:
            self.ids = (context + list(extra))[: self.model.cache_len]
            raise
        self.ids = context + list(extra)
        return logits

    def forget(self) -> None:
        """The model's cache was run apart from this DraftCache (a measurement): take it to hold nothing."""
        self.ids = []
