"""Options shared by the methods that draft with one drafter, and their checks: `default` resolved
(`with_default_drafter`), drafters checked against dtypes and the backends' capabilities, and loaded for a
generation (`with_drafters`, through `Session.drafter`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from speculant.config import BACKENDS, option
from speculant.drafters.spec import (DEFAULT, DRAFTER_DTYPES, SELF, DrafterSpec, as_drafter, check_dtype, model_free,
                                    resolved)
from speculant.errors import ConfigError, OptionError


def parse_drafters(text: str) -> tuple[DrafterSpec, ...]:
    """`a@int8,b,maxgram` -> their specs, in order (none for empty text); a name left empty is refused."""
    names = [name.strip() for name in text.split(",")] if text.strip() else []
    if not all(names):
        raise ConfigError(f"an empty drafter name in '{text}'")
    return tuple(DrafterSpec.parse(name) for name in names)


def as_drafters(value: Any) -> tuple[Any, ...] | None:
    """A `drafters` option as its options keep it: text parsed (`parse_drafters`), one drafter given alone as a
    tuple of one, each name a DrafterSpec (None stays None; `default`, a method's one drafter, refused)."""
    if value is None:
        return None
    drafters = parse_drafters(value) if isinstance(value, str) else \
        tuple(map(as_drafter, value if isinstance(value, (list, tuple)) else (value,)))
    if any(isinstance(d, DrafterSpec) and d.kind == DEFAULT for d in drafters):
        raise ConfigError(f"'{DEFAULT}' stands for a method's one drafter; a list of drafters names each")
    return drafters


def drafter_dtype_option() -> Any:
    """The `drafter_dtype` field of every method that loads model drafters by name (one help text for all)."""
    return option(None, "dtype of model drafters (default: the target's)", choices=DRAFTER_DTYPES, operator=True)


def draft_confidence_option(**flags: Any) -> Any:
    """The `draft_confidence` field of the methods whose model drafters' chains may end early (sd, auto);
    `check_draft_confidence` reads it."""
    return option(0.0, "a model drafter's draft ends after a token it gives a probability below this (0: drafts run "
                  "to the chosen length)", **flags)


def check_draft_confidence(value: float) -> None:
    """Refuse a `draft_confidence` outside [0, 1) (1 would end every draft after its first token)."""
    if not 0 <= value < 1:
        raise OptionError("draft_confidence", f"draft_confidence must lie in [0, 1), got {value}")


@dataclass(frozen=True)
class DrafterOptions:
    drafter: Any = option(DEFAULT, "drafter: default (the target's catalog drafter where the catalog pairs it one, "
                          "else maxgram), a model NAME[@int8|@int4|@gguf|@lean] (its tokenizer may differ "
                          "from the target's; @gguf: its GGUF on llama.cpp, @lean: on speculant's kernels), "
                          "self[@int8|@int4|@skip] (the target's own weights; @int8|@int4: quantized, transformers "
                          "backend; @skip: with layers left out, lean backend), maxgram (prompt lookup with a bigram "
                          "fallback), suffix (suffix decoding over the context and earlier generations), a "
                          "registered drafter's name (plugins: the "
                          "speculant.drafters entry points), or from Python a model or Drafter object",
                          parse=DrafterSpec.parse)
    drafter_dtype: str | None = drafter_dtype_option()
    # Who drafts only with a model (a refusal names them: "method 'tree'"); empty where a drafter that runs none
    # (Max-Gram, suffix, a registered one) is taken too.
    MODEL_ONLY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.drafter is None:
            raise ConfigError("this method needs a drafter")
        object.__setattr__(self, "drafter", as_drafter(self.drafter))
        if self.MODEL_ONLY and model_free(self.drafter):
            raise OptionError("drafter", f"{self.MODEL_ONLY} needs a model drafter (self or a model's name), not "
                              f"{self.drafter}")
        check_drafters(self)


def takes_model_free(options: Any) -> bool:
    """Whether `options` take a drafter that runs no model (`DrafterOptions.MODEL_ONLY`): a refusal of a drafter's
    name then names those drafters too."""
    return not (isinstance(options, DrafterOptions) and options.MODEL_ONLY)


def check_drafters(options: Any) -> None:
    """Each drafter `options` hold is a spec, a model (speculant's, or a torch module `load_model` wraps) or a Drafter
    (`drafters` a sequence of them), and their drafter dtype fits them (`check_dtype`)."""
    from torch import nn

    from speculant.drafters.base import Drafter
    from speculant.models.base import CausalLM

    for name, drafters in drafters_by_field(options).items():
        odd = [d for d in drafters if not isinstance(d, (DrafterSpec, CausalLM, Drafter, nn.Module))]
        if odd:  # (a list: None among the drafters is odd too)
            raise OptionError(name, f"{name} must be a drafter's name, a model or a Drafter, not "
                              f"{type(odd[0]).__name__}")
    check_dtype(options.drafter_dtype, held_drafters(options))


def drafters_by_field(options: Any) -> dict[str, list[Any]]:
    """The drafters `options` holds, by the field holding them: `drafter` (one), `drafters` (several, where given).
    A `drafter` that given `drafters` replace (an `EITHER` pair: DSI's) is not held: nothing loads it."""
    names = {f.name for f in fields(options)}
    several = "drafters" in names and options.drafters is not None
    replaced = several and ("drafter", "drafters") in getattr(options, "EITHER", ())
    held = {"drafter": [options.drafter]} if "drafter" in names and not replaced else {}
    if several:
        held["drafters"] = list(options.drafters)
    return held


def held_drafters(options: Any) -> list[Any]:
    """Every drafter `options` holds: its `drafter`, then its `drafters` (none for a method that drafts with none)."""
    return [drafter for drafters in drafters_by_field(options).values() for drafter in drafters]


def needs(options: Any) -> list[tuple[str, str, str]]:
    """The target capabilities `options` need, as (capability, what needs it, the option that asks for it): their
    own `target_needs`, `skips_layers` for a `self@skip` drafter, `quantizes_self` for `self@int8|int4`. The CLI
    checks them against the target's backend before it loads, `generate` and a server's requests against the loaded
    target's."""
    needed = list(getattr(options, "target_needs", ()))
    for name, drafters in drafters_by_field(options).items():
        if any(isinstance(d, DrafterSpec) and d.skip for d in drafters):
            needed.append(("skips_layers", "self@skip needs a target that drafts with some of its layers left out",
                           name))
        if quantized := next((d for d in drafters if isinstance(d, DrafterSpec) and d.kind == SELF and d.quant), None):
            needed.append(("quantizes_self", f"{quantized} quantizes the target's transformers weights", name))
    return needed


def unmet(options: Any, capabilities: Any) -> tuple[str, str, str] | None:
    """The first of `needs(options)` that `capabilities` (a backend's, `models.base.Capabilities`) lack, or None."""
    return next((need for need in needs(options) if not getattr(capabilities, need[0])), None)


def elsewhere(options: Any, advice: str) -> str:
    """Where what `options` need is offered: `advice` with the names of the backends that offer it all in its {}
    (or that none does)."""
    from speculant.models.backends import capabilities_of

    others = [backend for backend in BACKENDS if not unmet(options, capabilities_of(backend))]
    return advice.format(" or ".join(others)) if others else "no backend offers all of that"


def check_capabilities(options: Any, target: Any) -> None:
    """An OptionError naming the option that asks a loaded `target` for what its backend does not offer (`generate`,
    a server's own options and its requests; the CLI refuses it by the backend's name before loading)."""
    if need := unmet(options, target.capabilities):
        raise OptionError(need[2], f"{need[1]}: the target's backend does not offer that "
                                   f"({elsewhere(options, 'load it on the {} backend')})")


def with_default_drafter(options: Any, target: str) -> Any:
    """`options` with a `default` drafter replaced by the drafter it stands for with the target named `target`
    (`spec.resolved`; refused where only a model drafts and the catalog pairs none): what the CLI and a server load
    and name."""
    if "drafter" not in drafters_by_field(options):  # (none, or one that given `drafters` replace: DSI's)
        return options
    drafter = options.drafter
    try:
        stands_for = resolved(drafter, target, getattr(options, "MODEL_ONLY", ""))
    except ConfigError as error:
        raise OptionError("drafter", str(error)) from None
    if stands_for is drafter:
        return options
    try:
        return replace(options, drafter=stands_for)
    except ConfigError as error:  # (a drafter dtype, a draft confidence: what a model drafter takes)
        unpaired = f" (the catalog pairs no drafter with {target}: its default is {stands_for}; name a model drafter)"
        raise OptionError("drafter", f"{error}{unpaired if model_free(stands_for) else ''}") from None


def with_drafters(options: Any, load: Callable[[Any], Any]) -> Any:
    """`options` with every drafter it holds (`drafter`, `drafters`) replaced by `load(drafter)`: how the
    CLI and the bench load drafters once, before generating. Their `drafter_dtype`, which `load` applies, is cleared."""
    changes = {name: load(drafters[0]) if name == "drafter" else tuple(map(load, drafters))
               for name, drafters in drafters_by_field(options).items()}
    if changes and "drafter_dtype" in {f.name for f in fields(options)}:
        changes["drafter_dtype"] = None  # (applied: the loaded models are in it, and keep it)
    return replace(options, **changes) if changes else options


def as_keywords(options: Any) -> dict[str, Any]:
    """An options dataclass as the keyword arguments of `generate()`."""
    return {f.name: getattr(options, f.name) for f in fields(options)}
