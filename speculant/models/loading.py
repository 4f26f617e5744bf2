"""Model loading: catalog names, Hugging Face ids or paths, and already built transformers models.

A model object the caller passes in is never changed: speculant converts dtype or device in a copy,
and the backend rewires a private copy of the modules, so the caller's modules, dtype and attention
settings stay as they were.
"""

from __future__ import annotations

import hashlib
import logging
import os
from copy import deepcopy
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError

from speculant.cache import cache_root
from speculant.config import AUTO, BACKENDS, GGUF, LEAN, QUANTS, as_integer
from speculant.errors import ConfigError, ModelNotAvailable
from speculant.machine import native_bf16
from speculant.models.base import CausalLM, adopted
from speculant.models.catalog import (CATALOG, TOKENIZER_FILES, catalog_listing, check_cache, check_gguf,
                                      check_name, check_suffix, gguf_checkpoint, gguf_tokenizer, gguf_tokenizer_folder,
                                      gguf_tokenizer_sources, materialize, split_quant)
from speculant.models.backends import capabilities_of, llamacpp
from speculant.models.numerics.native import KERNELS

if TYPE_CHECKING:
    from speculant.models.backends.hf import HFCausalLM

log = logging.getLogger("speculant")

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (bf16, fp32) of a torch dtype that speculant loads models in."""
    names = {value: name for name, value in DTYPES.items()}
    if dtype not in names:
        raise ConfigError(f"unsupported dtype {dtype} (speculant runs {', '.join(DTYPES)})")
    return names[dtype]


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto`: bf16 where it is fast and exact: on CUDA, on CPUs that multiply bf16 natively (AMX,
    AVX512-BF16), and on CPUs that run speculant's AVX2 kernel (bf16 weights, fp32 arithmetic: half the
    memory traffic of fp32 for the same sums); fp32 elsewhere."""
    if dtype == AUTO:
        fast_bf16 = device.type == "cuda" or native_bf16() or KERNELS["avx2"].available(torch.bfloat16)
        return "bf16" if fast_bf16 else "fp32"
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (choose from auto, {', '.join(DTYPES)})")
    return dtype


def resolve_device(device: str) -> torch.device:
    """Parse `cpu`, `cuda` or `cuda:N`, failing clearly when that device is not there."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device '{device}' (use cpu, cuda or cuda:N)") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ModelNotAvailable(f"device '{device}' is not available: torch sees {count} CUDA device(s)")
    elif parsed.type != "cpu":
        raise ConfigError(f"unsupported device '{device}' (use cpu, cuda or cuda:N)")
    return parsed


def quantized_copy(model: HFCausalLM, quant: str, group_size: int | None = None) -> HFCausalLM:
    """A quantized copy of a loaded transformers model's weights, e.g. the target as its own drafter (`self@int8`);
    `group_size` is int4's (default 32)."""
    from speculant.models.backends.hf import HFCausalLM
    from speculant.models.numerics.quant import GROUP_SIZE, quantize

    if not isinstance(model, HFCausalLM):
        raise ConfigError(f"quantized_copy quantizes a model on the transformers backend (hf), not "
                          f"{type(model).__name__}")
    if quant not in QUANTS:
        raise ConfigError(f"unknown quantization {quant!r} (choose from {', '.join(QUANTS)})")
    check_group_size(group_size, quant)
    copy = quantize(deepcopy(model.model), quant, group_size or GROUP_SIZE)
    identity = f"{model.identity}@{quantized_as(quant, group_size)}" if model.identity else None
    return HFCausalLM(copy, model.tokenizer, f"{model.name}@{quant}", model.eos_token_ids, identity)


def quantized_as(quant: str, group_size: int | None) -> str:
    """A quantization as a model's identity names it: int4's group size with it (another group size, another model)."""
    from speculant.models.numerics.quant import GROUP_SIZE

    return f"{quant} group {group_size or GROUP_SIZE}" if quant == "int4" else quant


def weights_id(spec: str | Path) -> str:
    """What a model loaded from `spec` is known by where what is measured of it is kept (machine profiles, depth
    predictors): a catalog name or a hub id as it is (its package or revision pins the weights); a local file or
    folder by its resolved path and its files' sizes and times, so that one replaced in place, or spelled another
    way, is measured as what it is."""
    name, path = str(spec), Path(spec)
    if name in CATALOG or not path.exists():
        return name
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    stamp = hashlib.sha256("|".join(f"{f.relative_to(path) if f != path else f.name}:{f.stat().st_size}:"
                                    f"{f.stat().st_mtime_ns}" for f in files).encode()).hexdigest()[:16]
    return f"{path.resolve()} ({stamp})"


def tokenizer_folder(name: str) -> Path | None:
    """The folder a model's tokenizer loads from (under any `@` suffix): a local model folder, or one a catalog
    model's or a .gguf file's loads made (a catalog model's: its GGUF's or a de-quantized one's, each with the same
    tokenizer files; none is made here, so a drafter's first load may read its own); None for anything else."""
    base = split_quant(name)[0]
    if base in CATALOG:
        made = [cache_root() / "models" / f"{base}-{kind}" for kind in ("gguf", "bf16", "fp32")]
        return next((folder for folder in made if (folder / "tokenizer.json").is_file()), None)
    path = Path(base).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        folder = gguf_tokenizer_folder(path)
        return folder if check_cache(folder, gguf_tokenizer_sources(path)) is None else None
    return path if path.is_dir() else None


def drafter_tokenizer(target: CausalLM, source: str) -> Any | None:
    """The target's tokenizer where the drafter model named `source` loads its tokenizer from the same files (the same
    folder, or `TOKENIZER_FILES` the same byte for byte), else None (it loads its own). A drafter reads and writes
    the target's ids, so it needs no copy of its own, and parsing one is most of a catalog drafter's load time. (Its
    chat template, which may differ, is never applied: the target's templates every prompt.)"""
    if target.tokenizer is None:
        return None
    mine, theirs = tokenizer_folder(str(target.name)), tokenizer_folder(source)
    if mine is None or theirs is None:
        return None
    if mine.resolve() == theirs.resolve():
        return target.tokenizer
    files = [tokenizer_files(folder) for folder in (mine, theirs)]
    return target.tokenizer if files[0][0] is not None and files[0] == files[1] else None


def tokenizer_files(folder: Path) -> tuple[bytes | None, ...]:
    """The bytes of each of `TOKENIZER_FILES` in `folder` (None where it has none)."""
    return tuple((folder / name).read_bytes() if (folder / name).is_file() else None for name in TOKENIZER_FILES)


def transformers_drafter(target: Any, spec: Any, dtype: str | None, backend: str) -> CausalLM:
    """A drafter for a transformers-weights target (`backend` hf or static): on the target's device in `dtype`
    (default: the target's) and backend, compiled as the target is; GGUF weights (`@gguf`, `@lean`, a .gguf file) on
    the backend that runs them, as `load_model` routes them (the target verifies every token, whatever runs the
    drafts; a dtype given for them is refused there). It reads ids with the target's tokenizer where its own files
    are the same (`drafter_tokenizer`)."""
    tokenizer = drafter_tokenizer(target, spec.source)
    if spec.backend is not None or spec.source.endswith(".gguf"):
        return load_model(str(spec), dtype=dtype, tokenizer=tokenizer)
    return load_model(str(spec), dtype=dtype or dtype_name(target.dtype), device=str(target.device), backend=backend,
                      compile=backend == "static" and target.compiled, tokenizer=tokenizer)


def resolve_backend(backend: str | None, spec: Any, quant: str | None, device: str | None,
                    dtype: str | None = None) -> str:
    """`auto`: GGUF weights (a catalog name or a .gguf file) run as they are (no dtype, no quantization asked
    for) on the CPU go to the lean backend where the catalog says its kernels read them and they have a SIMD
    path on this CPU (docs/results/cpu.md: its verification of several tokens and its prefill are cheaper than
    ggml's on the Xeon and Zen4 measured, its one-token decode as fast or faster), else to llama.cpp where it is
    built (`speculant peers build-llamacpp`); transformers otherwise."""
    backend = backend or AUTO
    if backend not in (AUTO, *BACKENDS):
        raise ConfigError(f"unknown backend '{backend}' (choose from auto, {', '.join(BACKENDS)})")
    is_gguf = isinstance(spec, (str, Path)) and (str(spec) in CATALOG or str(spec).endswith(".gguf"))
    if quant == LEAN:
        backend = "lean" if backend == AUTO else backend
        if backend != "lean":
            raise ConfigError(f"@{LEAN} runs on the lean backend, not {backend}")
    elif quant == GGUF:
        backend = "llamacpp" if backend == AUTO else backend
        if backend != "llamacpp":
            raise ConfigError(f"@{GGUF} runs on the llama.cpp backend, not {backend}")
    if backend != AUTO and str(spec).endswith(".gguf") and not capabilities_of(backend).gguf:
        runs = " or ".join(name for name in BACKENDS if capabilities_of(name).gguf)
        raise ConfigError(f"{spec} is a GGUF file: it runs on the {runs} backend, not {backend}")
    if backend == AUTO:
        on_cpu = device is None or resolve_device(device).type == "cpu"
        as_they_are = quant is None and dtype in (None, AUTO)
        if str(spec).endswith(".gguf"):
            backend = _file_route(Path(spec).expanduser()) if as_they_are and on_cpu else "llamacpp"  # (checked below)
        elif not (is_gguf and as_they_are and on_cpu):
            return "hf"
        else:
            entry = CATALOG.get(str(spec))
            if entry is not None and entry.kernels and _simd_kernels():
                return "lean"
            return "llamacpp" if llamacpp.available() else "hf"
    if backend in ("llamacpp", "lean"):
        if not is_gguf:
            what = repr(str(spec)) if isinstance(spec, (str, Path)) else f"a {type(spec).__name__}"
            raise ConfigError(f"the {backend} backend runs GGUF weights: a catalog name or a .gguf file, not {what}")
        if quant not in (None, GGUF, LEAN):
            raise ConfigError(f"@{quant} quantizes transformers weights; the {backend} backend runs the GGUF as it is")
        if device is not None and resolve_device(device).type != "cpu":
            raise ConfigError(f"speculant's {backend} backend runs on the CPU")
    elif backend == "static" and quant is not None:
        raise ConfigError(f"@{quant}: the static backend runs bf16 or fp32 weights")
    return backend


@lru_cache(maxsize=16)
def _file_route(path: Path) -> str:
    """A user's .gguf file: the lean backend where it runs the file as it is (`lean.coverage`) and the kernels have
    a SIMD path here, else llama.cpp; which and why said once, in one line (before anything loads)."""
    from speculant.models.backends import lean

    if not path.is_file():
        raise ConfigError(f"no GGUF file at {path}")
    check_gguf(path)
    runs, why = lean.coverage(path)
    if not _simd_kernels():
        from speculant import kernels

        runs, why = False, ("speculant's kernels have no SIMD path on this CPU" if kernels.paths() else
                            "speculant's kernels did not build (no C compiler with OpenMP)")
    log.warning(f"speculant: {path.name} runs on {'the lean backend' if runs else 'llama.cpp'}: {why}")
    return "lean" if runs else "llamacpp"


def _simd_kernels() -> bool:
    """Whether speculant's kernels run here on a path faster than the scalar reference (none without a C compiler)."""
    from speculant import kernels

    found = kernels.paths()
    return bool(found) and found[0] != "scalar"


def gguf_file(spec: str | Path) -> Path:
    """The GGUF file of a catalog model (its packaged parts joined once, no de-quantization) or a .gguf path."""
    name = str(spec)
    if name in CATALOG:
        return gguf_checkpoint(CATALOG[name]) / "model.gguf"
    path = Path(name).expanduser()
    if not path.is_file():
        raise ModelNotAvailable(f"no GGUF file at {path} (catalog models: {catalog_listing()})")
    check_gguf(path)
    return path


def _gguf_source(spec: str | Path, tokenizer: Any | None) -> tuple[Path, str, Any | None, frozenset[int]]:
    """(file, name, tokenizer, extra end-of-sequence ids) of a catalog model's GGUF or a .gguf file."""
    path, name = gguf_file(spec), str(spec)
    entry = CATALOG.get(name)
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent) if entry else gguf_file_tokenizer(path)
        except Exception as error:  # noqa: BLE001 - a GGUF whose tokenizer transformers cannot read still runs on ids
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            log.warning(f"speculant: transformers cannot read {path.name}'s tokenizer ({reason}): it runs on token "
                        "ids only")
            tokenizer = None
    extra_eos = entry.extra_eos if entry else ()
    extra_ids = frozenset(tokenizer.convert_tokens_to_ids(t) for t in extra_eos) if tokenizer else frozenset()
    return path, name, tokenizer, extra_ids


def gguf_file_tokenizer(path: Path) -> Any:
    """A GGUF file's tokenizer as transformers converts it, from the cache's copy of the conversion
    (`catalog.gguf_tokenizer`), or converted from the file where the cache cannot keep one or its copy does not load."""
    from transformers import AutoTokenizer

    try:
        folder = gguf_tokenizer(path)
    except (OSError, ConfigError) as error:  # (the cache: read-only, full, a file; not the conversion)
        log.warning(f"speculant: {path}'s tokenizer is not kept in the cache ({error}); converted at every load")
    else:
        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception:  # noqa: BLE001 - a kept copy this transformers does not read: the conversion itself
            pass
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load_gguf(spec: str | Path, tokenizer: Any | None = None) -> CausalLM:
    """A catalog model's packaged GGUF or a .gguf file, on llama.cpp."""
    path, name, tokenizer, extra_ids = _gguf_source(spec, tokenizer)
    weights = llamacpp.shared_weights(path)
    return llamacpp.LlamaCppCausalLM(weights, tokenizer, name, extra_ids, f"{weights_id(spec)} gguf")


def load_lean(spec: str | Path, tokenizer: Any | None = None, draft: bool = False) -> CausalLM:
    """A catalog model's packaged GGUF or a .gguf file, on the lean model and speculant's kernels; with `draft`,
    as a drafter (`name@lean`): its head cut to the tokenizer's `lean.DRAFT_HEAD` most frequent tokens
    (FR-Spec) and matrices of types the kernels lack quantized again."""
    from speculant.corpus import frequent_tokens
    from speculant.models.backends import lean

    path, name, tokenizer, extra_ids = _gguf_source(spec, tokenizer)
    eos = set(extra_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    if not draft:
        return lean.LeanCausalLM(lean.shared_weights(path), tokenizer, name, frozenset(eos), f"{weights_id(spec)} lean")
    if tokenizer is None:
        raise ConfigError(f"{name}@{LEAN} ranks its head's tokens with the model's tokenizer, which did not load")
    head = tuple(int(i) for i in frequent_tokens(tokenizer, len(tokenizer), lean.DRAFT_HEAD))
    return lean.LeanCausalLM(lean.shared_weights(path, head), tokenizer, f"{name}@{LEAN}", frozenset(eos),
                             f"{weights_id(spec)} lean draft {len(head)}")


def check_gguf_dtype(spec: Any, backend: str, dtype: str | None) -> None:
    """Refuse a dtype where the backend runs a GGUF's own types (its `gguf` capability: llama.cpp, lean)."""
    if capabilities_of(backend).gguf and dtype not in (None, AUTO):
        raise ConfigError(f"{spec} runs its GGUF's own types (on the {backend} backend): give no dtype")


def check_group_size(group_size: Any, quant: str | None) -> None:
    """Refuse a `group_size` that is no positive integer, or given to a quantization other than int4's."""
    if group_size is None:
        return
    if as_integer(group_size) is None or group_size < 1:
        raise ConfigError(f"group_size must be a positive integer, got {group_size!r}")
    if quant != "int4":
        raise ConfigError("group_size applies to int4 quantization (quant='int4' or a name@int4)")


def load_model(spec: Any, dtype: str | None = None, device: str | None = None, tokenizer: Any | None = None,
               quant: str | None = None, group_size: int | None = None, backend: str | None = None,
               compile: bool = False) -> CausalLM:
    """Load a CausalLM from a catalog name, a Hugging Face id or local path, a .gguf file, or a transformers model.

    `backend` is auto (the default: see `resolve_backend`), hf (transformers), llamacpp (the GGUF as it is,
    also spelled `name@gguf`; `dtype` then does not apply), lean, or static (transformers weights on torch
    kernels with a static cache; `compile`: its step compiled, a CUDA graph on a GPU).

    `dtype` is auto (the default for names: see `resolve_dtype`), bf16 or fp32; a transformers model keeps
    its own dtype and device unless they are given, and is never modified (speculant works on a copy).
    Catalog models are de-quantized from their packaged GGUF once and cached as safetensors. `quant`
    ("int8", "int4"; or a `name@int8` suffix) quantizes every linear layer after loading; `group_size` is int4's
    (default 32). A CausalLM passes through unchanged, where it derives from `Backend` (`models.base.adopted`).
    """
    if isinstance(spec, CausalLM):
        if quant is not None:
            raise ConfigError("quantize a loaded model with quantized_copy()")
        given = [name for name, value in (("dtype", dtype), ("device", device), ("backend", backend),
                                          ("tokenizer", tokenizer), ("compile", compile or None),
                                          ("group_size", group_size)) if value not in (None, AUTO)]
        if given:
            raise ConfigError(f"a loaded model runs as it is: {', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} "
                              "when loading one (load it from its name)")
        return adopted(spec)
    if tokenizer is not None and not hasattr(tokenizer, "convert_tokens_to_ids"):
        raise ConfigError(f"tokenizer must be a loaded tokenizer (transformers' AutoTokenizer.from_pretrained), not "
                          f"{type(tokenizer).__name__}")
    if isinstance(spec, str):
        name, suffix = split_quant(spec)
        if suffix is not None and quant is not None:
            raise ConfigError(f"quantization given twice: '{spec}' and quant={quant}")
        spec, quant = os.path.expanduser(name), suffix or quant  # ('--target=~/m.gguf': no shell expands it)
    check_suffix(quant)
    check_group_size(group_size, quant)
    if isinstance(spec, (str, Path)):
        check_name(str(spec))
    if dtype not in (None, AUTO, *DTYPES):
        raise ConfigError(f"unknown dtype '{dtype}' (choose from {AUTO}, {', '.join(DTYPES)})")
    chosen = resolve_backend(backend, spec, quant, device, dtype)
    if compile and chosen != "static":
        raise ConfigError("compile applies to the static backend")
    check_gguf_dtype(spec, chosen, dtype)
    if chosen in ("llamacpp", "lean"):
        return load_gguf(spec, tokenizer) if chosen == "llamacpp" else load_lean(spec, tokenizer, quant == LEAN)
    from speculant.models.backends.hf import HFCausalLM, eos_ids, model_name  # (transformers' models: on their load)

    model, tokenizer, name, extra_eos = _load_transformers(spec, dtype, device, tokenizer)
    identity = f"{weights_id(spec)} {dtype_name(model.dtype)}" if isinstance(spec, (str, Path)) else None
    if chosen == "static":
        from speculant.models.backends.static import StaticCausalLM, StaticWeights

        eos = eos_ids(model, tokenizer) | extra_eos
        identity = identity and f"{identity} static{' compiled' if compile else ''}"
        return StaticCausalLM(StaticWeights(model), tokenizer, name, eos, identity, compiled=compile)
    if quant is not None:
        from speculant.models.numerics.quant import GROUP_SIZE, quantize

        if model is spec:
            model = deepcopy(spec)  # quantization rewrites the modules: never the caller's
        quantize(model, quant, group_size or GROUP_SIZE)
        name = f"{name or model_name(model)}@{quant}"
        identity = identity and f"{weights_id(spec)}@{quantized_as(quant, group_size)} {dtype_name(model.dtype)}"
    return HFCausalLM(model, tokenizer, name, extra_eos, identity)


def _load_transformers(spec: Any, dtype: str | None, device: str | None, tokenizer: Any | None
                       ) -> tuple[Any, Any, str | None, frozenset[int]]:
    """(transformers model, tokenizer, name, extra end-of-sequence ids); a model object comes back as
    it is unless it needs converting (then as a converted copy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(spec, PreTrainedModel):
        first = next(spec.parameters())
        if any(t.is_meta for t in (*spec.parameters(), *spec.buffers())):  # (built under `torch.device("meta")`)
            raise ConfigError("the model's weights are on the meta device, shapes without values (or offloaded, "
                              "device_map's disk or CPU offload): load them whole (from_pretrained without offload, "
                              "or to_empty() then load_state_dict()) before passing it in")
        torch_device = resolve_device(device) if device is not None else first.device
        torch_dtype = DTYPES[resolve_dtype(dtype, torch_device)] if dtype is not None else first.dtype
        dtype_name(torch_dtype)
        if (first.dtype, first.device) != (torch_dtype, torch_device):
            spec = deepcopy(spec).to(device=torch_device, dtype=torch_dtype)  # converted in a copy of its own
        return spec, tokenizer, None, frozenset()
    if not isinstance(spec, (str, Path)):
        raise ConfigError(f"cannot load a model from {type(spec).__name__}")
    torch_device = resolve_device(device or "cpu")
    dtype = resolve_dtype(dtype or AUTO, torch_device)
    name = str(spec)  # (a name `load_model` checked)
    extra_eos: tuple[str, ...] = ()
    path: str | Path = name
    if name in CATALOG:
        path = materialize(CATALOG[name], dtype)
        extra_eos = CATALOG[name].extra_eos
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(torch_device)
    except (OSError, ValueError, SafetensorError) as error:  # (the last: weights cut short or damaged)
        raise ModelNotAvailable(f"cannot load model '{name}': {str(error).splitlines()[0]}") from None
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):  # a model without a tokenizer still works on token ids
            tokenizer = None
    extra_ids = frozenset(tokenizer.convert_tokens_to_ids(t) for t in extra_eos) if tokenizer else frozenset()
    return model, tokenizer, name, extra_ids
