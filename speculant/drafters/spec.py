"""Drafter specs, parsed in one place: `maxgram`, `suffix`, `self`, `self@int8`, `self@skip`, `NAME`, `NAME@int4`,
`NAME@gguf`, `NAME@lean` (a catalog name, Hugging Face id or path; @gguf: its GGUF on llama.cpp; @lean: its GGUF on
speculant's kernels with FR-Spec's head); and `load_drafter`, which turns a spec (or a model, or a Drafter) into
what drafts for a given target. Parsing needs no torch (the CLI reads specs before anything loads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speculant.errors import ConfigError, IncompatibleModels

MAXGRAM = "maxgram"  # prompt lookup with a bigram fallback, no model
SUFFIX = "suffix"  # suffix decoding over the context and this process's earlier generations, no model
SELF = "self"  # the target's own weights (quantized with @int8 / @int4, else shared)
QUANTS = ("int8", "int4")
GGUF = "gguf"  # the model's packaged GGUF weights as they are, on the llama.cpp backend
LEAN = "lean"  # the model's GGUF on the lean backend, as a drafter (models/lean.py: head cut, types re-quantized)
SKIP = "skip"  # self@skip: a lean target's own weights with some layers left out (models/layer_skip.py)


@dataclass(frozen=True)
class DrafterSpec:
    source: str  # "maxgram", "suffix", "self", or a model: catalog name, Hugging Face id or path
    quant: str | None = None  # "int8"/"int4": quantize the drafter's linear layers at load; "gguf", "lean"; "skip"

    @property
    def kind(self) -> str:
        return self.source if self.source in (MAXGRAM, SUFFIX, SELF) else "model"

    def __str__(self) -> str:
        return self.source + (f"@{self.quant}" if self.quant else "")

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        source, at, quant = text.strip().rpartition("@")
        if not at:
            source, quant = text.strip(), None
        if not source:
            raise ConfigError(f"empty drafter name in '{text}'")
        if quant is not None and quant not in (*QUANTS, GGUF, LEAN, SKIP):
            raise ConfigError(f"unknown quantization '{quant}' in drafter '{text}' (choose from {', '.join(QUANTS)}, "
                              f"{GGUF} for llama.cpp, {LEAN} for speculant's kernels, or self@{SKIP})")
        if quant == SKIP and source != SELF:
            raise ConfigError(f"@{SKIP} leaves layers of the target out: write self@{SKIP}, not '{text}'")
        if source in (MAXGRAM, SUFFIX) and quant:
            raise ConfigError(f"{source} runs no model; it takes no quantization")
        if source == SELF and quant in (GGUF, LEAN):
            raise ConfigError(f"self@{quant} is the target itself: run the target on that backend and draft with 'self'")
        if source == "none":
            raise ConfigError("'none' is not a drafter (it means plain autoregressive decoding: method 'ar')")
        return cls(source, quant)


def as_drafter(value: Any) -> Any:
    """What an option holding a drafter keeps: text becomes a DrafterSpec; models and Drafters stay."""
    return DrafterSpec.parse(value) if isinstance(value, str) else value


def check_compatible(target: Any, drafter: Any) -> None:
    """A model drafter's ids must mean the target's tokens, or both must have tokenizers (then it drafts across
    vocabularies: `drafters.cross_vocab`)."""
    from speculant.drafters.vocab import same_vocabulary

    if not same_vocabulary(target, drafter) and (target.tokenizer is None or drafter.tokenizer is None):
        raise IncompatibleModels(
            f"drafter '{drafter.name}' and target '{target.name}' have different vocabularies and one has no "
            "tokenizer: drafting across vocabularies needs both tokenizers"
        )


def load_drafter(drafter: Any, target: Any, dtype: str | None = None) -> Any:
    """What drafts for `target` (a CausalLM): a Drafter as given; `maxgram` (prompt lookup with the bigram
    table of the target's tokenizer); `suffix` (suffix decoding over the context and the target's earlier
    generations in this process); `self` (the target's weights with a cache of their own), `self@int8` /
    `self@int4` (a quantized copy) or `self@skip` (a lean target without the layers `models.layer_skip` picks);
    a loaded model as given; or any model `load_model` accepts, on the target's backend: for a transformers
    target, on its device in `dtype` (default: the target's); for a llama.cpp or lean target, GGUF models on
    llama.cpp and others through transformers."""
    from speculant.drafters.base import Drafter
    from speculant.models import CausalLM, HFCausalLM, dtype_name, load_model, quantized_copy

    from speculant.models.base import Wrapper

    drafter = as_drafter(drafter)
    if isinstance(drafter, Drafter):
        return drafter
    while isinstance(target, Wrapper):  # drafters stand on the model, not on what records or biases its logits
        target = target.model
    if isinstance(drafter, DrafterSpec) and drafter.kind == MAXGRAM:
        from speculant.drafters.maxgram import MaxGramDrafter, load_bigram

        tokenizer = target.tokenizer
        return MaxGramDrafter(load_bigram(tokenizer, target.vocab_size) if tokenizer is not None else None)
    if isinstance(drafter, DrafterSpec) and drafter.kind == SUFFIX:
        from speculant.drafters.suffix import SuffixDrafter, history_of
        from speculant.models.base import profiled_as

        return SuffixDrafter(history_of(profiled_as(target)))
    if isinstance(drafter, DrafterSpec) and drafter.kind == SELF and drafter.quant == SKIP:
        if getattr(target, "backend", None) != "lean":
            raise ConfigError("self@skip runs on the lean backend (--backend lean)")
        from speculant.models.layer_skip import skipped_layers

        return target.skipping(skipped_layers(target))
    if isinstance(drafter, DrafterSpec) and drafter.kind == SELF:
        if drafter.quant and not isinstance(target, HFCausalLM):
            raise ConfigError(f"self@{drafter.quant} quantizes transformers weights; this target runs on llama.cpp")
        if not hasattr(target, "share"):
            raise ConfigError("self drafting needs a target that can open a second cache on its weights")
        return quantized_copy(target, drafter.quant) if drafter.quant else target.share()
    if drafter is target:  # a model drafting for itself needs a KV cache of its own
        if not hasattr(target, "share"):
            raise ConfigError("pass a separate model instance as drafter for this backend")
        return target.share()
    if isinstance(drafter, CausalLM):
        model = drafter
    elif getattr(target, "backend", "hf") in ("llamacpp", "lean"):  # GGUF drafters on llama.cpp (or @lean)
        model = load_model(str(drafter), dtype=dtype)
    else:  # transformers weights: on the target's device and backend (a static target's compiled or not)
        gguf = isinstance(drafter, DrafterSpec) and drafter.quant == GGUF
        static = getattr(target, "backend", "hf") == "static" and not gguf
        model = load_model(str(drafter), dtype=None if gguf else dtype or dtype_name(target.dtype),
                           device=None if gguf else str(target.device), backend=None if gguf else
                           "static" if static else "hf", compile=static and target.compiled)
    check_compatible(target, model)
    return model
