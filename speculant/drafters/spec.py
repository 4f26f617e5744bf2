"""Drafter specs, parsed in one place: `default` (the target's catalog drafter, else
maxgram: `resolved`), a registered drafter (`maxgram`,
`suffix`, a user's), `self`, `self@int8`,
`self@skip`, `NAME`, `NAME@int4`, `NAME@gguf`, `NAME@lean` (a catalog name, Hugging Face id or path; @gguf: its
GGUF on llama.cpp; @lean: its GGUF on speculant's kernels with FR-Spec's head); and `load_drafter`, which turns a
spec (or a model, or a Drafter) into what drafts for a given target. Parsing needs no torch (the CLI reads specs
before anything loads)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculant.config import GGUF, LEAN, QUANTS, SUFFIXES, split_quant
from speculant.errors import ConfigError, IncompatibleModels, OptionError

MAXGRAM = "maxgram"  # prompt lookup with a bigram fallback, no model (drafters.maxgram)
SELF = "self"  # the target's own weights (quantized with @int8 / @int4, else shared)
SKIP = "skip"  # self@skip: a lean target's own weights with some layers left out (models/backends/layer_skip.py)
MODEL = "model"  # the kind of a spec naming a model to load (a catalog name, Hugging Face id or path)
DEFAULT = "default"  # the target's catalog drafter where the catalog pairs it one, else maxgram (`resolved`)
DRAFTER_DTYPES = ("bf16", "fp32")  # what a model drafter named by its catalog name, HF id or path may load in


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter as text names it, in fields: `source` (a registered drafter, `self`, or a model: a catalog name,
    Hugging Face id or path) and, for models, one of `quant` (int8/int4: its linear layers quantized at load),
    `backend` (gguf: its GGUF on llama.cpp; lean: its GGUF on speculant's kernels) or `skip` (self@skip)."""

    source: str
    quant: str | None = None
    backend: str | None = None
    skip: bool = False

    @property
    def kind(self) -> str:
        """`default`, `self`, a registered drafter's name, or `model`."""
        from speculant.drafters.registry import is_registered

        return self.source if self.source in (DEFAULT, SELF) or is_registered(self.source) else MODEL

    def __str__(self) -> str:
        suffix = self.quant or self.backend or (SKIP if self.skip else None)
        return self.source + (f"@{suffix}" if suffix else "")

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        from speculant.drafters.registry import is_registered

        source, suffix = split_quant(text.strip())
        if "/" in source:  # a path written two ways (`d/`, `./d`, `a//d`) names one drafter: loaded once, given once
            source = spelled_path(source)
        if not source:
            raise ConfigError(f"empty drafter name in '{text}'")
        if "@" in source and not Path(source).expanduser().exists():  # (a folder's name may hold one)
            raise ConfigError(f"drafter '{text}' has more than one @ suffix")
        if source == "none":
            raise ConfigError("'none' is not a drafter (it means plain autoregressive decoding: method 'ar')")
        if suffix is not None and suffix not in (*SUFFIXES, SKIP):
            raise ConfigError(f"unknown quantization '{suffix}' in drafter '{text}' (choose from {', '.join(QUANTS)}, "
                              f"{GGUF} for llama.cpp, {LEAN} for speculant's kernels, or self@{SKIP})")
        if suffix == SKIP and source != SELF:
            raise ConfigError(f"@{SKIP} leaves layers of the target out: write self@{SKIP}, not '{text}'")
        if suffix and is_registered(source):
            raise ConfigError(f"{source} runs no model; it takes no quantization")
        if suffix and source == DEFAULT:
            raise ConfigError(f"{DEFAULT} stands for the target's catalog drafter, else maxgram; it takes no suffix: "
                              "name the drafter to give one")
        if source == SELF and suffix in (GGUF, LEAN):
            raise ConfigError(f"self@{suffix} is the target itself: run the target on that backend and draft with "
                              "'self'")
        return cls(source, suffix if suffix in QUANTS else None, suffix if suffix in (GGUF, LEAN) else None,
                   suffix == SKIP)


def spelled_path(source: str) -> str:
    """`source`, a text holding a `/`, in one spelling: without empty and `.` parts (`..` kept: what it leaves depends
    on links), and still a path (`./maxgram`, a folder, stays one and never becomes the registered `maxgram`)."""
    parts = [part for part in source.split("/") if part not in ("", ".")]
    spelled = ("/" if source.startswith("/") else "") + "/".join(parts)
    return spelled if "/" in spelled else f"./{spelled}"


def model_free(drafter: Any) -> bool:
    """Whether `drafter` is the spec of a registered drafter that runs no model (Max-Gram, suffix): neither `self`
    nor a model to load (nor `default`, which may be one)."""
    return isinstance(drafter, DrafterSpec) and drafter.kind not in (DEFAULT, SELF, MODEL)


def resolved(drafter: Any, target: str, model_only: str = "") -> Any:
    """`drafter`, or for `default` the drafter it stands for with the target named `target`: the catalog's drafter for
    a target loaded under its catalog name (as the method loads a model it names), else Max-Gram, which every target
    can run (a model of the catalog's would draft across vocabularies for any other target: loaded, rarely paying).
    Where only a model drafts (`model_only` names who: "method 'tree'"), a target the catalog pairs none with is
    refused."""
    from speculant.models.catalog import catalog_drafter

    if not (isinstance(drafter, DrafterSpec) and drafter.kind == DEFAULT):
        return drafter
    if (named := catalog_drafter(target)) is None and model_only:
        raise ConfigError(f"{model_only} needs a model drafter, and the catalog pairs none with {target}: name one "
                          "(self, or a model's name)")
    return DrafterSpec.parse(named or MAXGRAM)


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


def checked(drafter: Any, target: Any, registered: str | None = None) -> Any:
    """A drafter from outside speculant (a user's object or registered factory's), its drafts checked
    (`drafters.base.Checked`); speculant's own as they are. A registered one whose class names it nothing of its own
    goes by the name it was registered under."""
    from speculant.drafters.base import Checked, Drafter

    module = getattr(drafter.propose, "__module__", None) or ""  # (a function made by exec has None)
    own = module.startswith("speculant.")  # (a subclass of one of speculant's drafters that keeps its propose is
    # speculant's, as cascade's levels recognise it; one given a propose of its own is not)
    if own or isinstance(drafter, Checked):
        return drafter
    return Checked(drafter, target.vocab_size, registered if getattr(drafter, "name", None) == Drafter.name else None)


def takes_dtype(drafter: Any) -> bool:
    """Whether `drafter` is the spec of a model that loads in a drafter dtype: not a GGUF run as stored (`@gguf`,
    `@lean`, a .gguf file), not `self` (the target's weights) nor a drafter that runs no model. `default` may stand
    for one (where it stands for none, `with_default_drafter` and `Session.drafter` refuse the dtype)."""
    if not isinstance(drafter, DrafterSpec):
        return False
    return drafter.kind == DEFAULT or (drafter.kind == MODEL and drafter.backend is None
                                       and not drafter.source.endswith(".gguf"))


def check_dtype_of(dtype: str | None, drafter: Any = None) -> None:
    """A drafter dtype given with `drafter` (one of a method's drafters: the dtype goes to those that load in one) is
    refused where it is none of DRAFTER_DTYPES, or where `drafter` names a GGUF that runs its own types."""
    if dtype is None:
        return
    if dtype not in DRAFTER_DTYPES:
        raise OptionError("drafter_dtype", f"drafter dtype must be one of {', '.join(DRAFTER_DTYPES)}, got {dtype!r}")
    if isinstance(drafter, DrafterSpec) and drafter.kind == MODEL and not takes_dtype(drafter):
        raise ConfigError(f"drafter dtype {dtype}: {drafter} runs its GGUF's own types; give no drafter dtype")


def check_dtype(dtype: str | None, drafters: Sequence[Any]) -> None:
    """A drafter dtype is refused, before anything loads, where `check_dtype_of` refuses it for one of `drafters`, or
    where none of them loads in it (Max-Gram, suffix and `self` load none; a given model keeps its own): never
    silently ignored."""
    if dtype is None:
        return
    for drafter in (None, *drafters):  # (None: the dtype's name checked where no drafter is given)
        check_dtype_of(dtype, drafter)
    if not any(map(takes_dtype, drafters)):
        raise ConfigError(f"drafter dtype {dtype} applies to a model drafter named by its catalog name, Hugging Face "
                          f"id or path; {', '.join(map(named, drafters))} loads none")


def named(drafter: Any) -> str:
    """A drafter as a message names it: its spec, or a given object's name or type (not a module's whole repr)."""
    if isinstance(drafter, (str, DrafterSpec)):
        return str(drafter)
    return str(getattr(drafter, "name", None) or type(drafter).__name__)


def load_drafter(drafter: Any, target: Any, dtype: str | None = None, session: Any = None) -> Any:
    """What drafts for `target` (a CausalLM): a Drafter as given; a registered drafter's (`drafters.registry`:
    maxgram, suffix, a user's), made by its factory (with `session`, where it keeps state there); `self` and its
    variants, as the target's backend makes them (`Backend.self_drafter`); a loaded model as given (a transformers
    model as `load_model` wraps it); or a model named as `load_model` takes it, as the target's backend loads a
    drafter (`Backend.draft_model`: in `dtype`, default the target's)."""
    from speculant.drafters.base import Drafter
    from speculant.drafters.registry import make_drafter
    from speculant.models import CausalLM, load_model
    from speculant.models.base import adopted, unwrapped

    drafter = as_drafter(drafter)  # (`default` resolved by its caller, `Session.drafter`)
    if isinstance(drafter, Drafter):
        return checked(drafter, target)
    target = unwrapped(target)  # drafters stand on the model, not on what records or biases its logits
    if model_free(drafter):
        return checked(make_drafter(drafter.source, target, session), target, drafter.source)
    if isinstance(drafter, DrafterSpec) and drafter.kind == SELF:
        return target.self_drafter(drafter)
    if drafter is target:  # a model drafting for itself needs a KV cache of its own
        if not target.capabilities.shares_weights:
            raise ConfigError("pass a separate model instance as drafter for this backend")
        return target.share()
    if isinstance(drafter, DrafterSpec):
        model = target.draft_model(drafter, dtype)
    elif isinstance(drafter, CausalLM):  # a loaded model as given (a drafter dtype is for the models named beside it)
        model = adopted(drafter)
    else:  # a transformers model, wrapped as one (in `dtype` where given)
        model = load_model(drafter, dtype=dtype)
    check_compatible(target, model)
    return model
