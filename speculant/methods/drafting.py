"""Options shared by the methods that draft with one drafter, and the helper that turns what an option
holds into a Drafter for one generation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from speculant.config import DEFAULT_DRAFTER, option
from speculant.drafters.spec import DrafterSpec, as_drafter
from speculant.errors import ConfigError

DRAFTER_DTYPES = ("bf16", "fp32")


def parse_drafters(text: str) -> tuple[DrafterSpec, ...]:
    """`a@int8,b,maxgram` -> their specs, in order."""
    return tuple(DrafterSpec.parse(name) for name in text.split(",") if name.strip())


@dataclass(frozen=True)
class DrafterOptions:
    drafter: Any = option(DEFAULT_DRAFTER, "drafter: a model NAME[@int8|@int4] (its tokenizer may differ from the "
                          "target's), self[@int8|@int4|@skip] (the target's own weights; @skip: with layers left "
                          "out, lean backend), maxgram (prompt lookup with a bigram fallback), suffix (suffix "
                          "decoding over the context and earlier generations), or a model or Drafter object",
                          parse=DrafterSpec.parse)
    drafter_dtype: str | None = option(None, "dtype of a model drafter (default: the target's)",
                                       choices=DRAFTER_DTYPES, operator=True)

    def __post_init__(self) -> None:
        if self.drafter is None:
            raise ConfigError("this method needs a drafter")
        object.__setattr__(self, "drafter", as_drafter(self.drafter))
        if self.drafter_dtype not in (None, *DRAFTER_DTYPES):
            raise ConfigError(f"drafter dtype must be one of {', '.join(DRAFTER_DTYPES)}, got {self.drafter_dtype}")


def with_drafters(options: Any, load: Callable[[Any], Any]) -> Any:
    """`options` with every drafter it holds (`drafter`, `drafters`) replaced by `load(drafter)`: how the
    CLI and the bench load drafters once, before generating."""
    names = {f.name for f in fields(options)}
    changes: dict[str, Any] = {}
    if "drafter" in names:
        changes["drafter"] = load(options.drafter)
    if "drafters" in names and options.drafters is not None:
        changes["drafters"] = tuple(load(d) for d in options.drafters)
    return replace(options, **changes) if changes else options


def as_keywords(options: Any) -> dict[str, Any]:
    """An options dataclass as the keyword arguments of `generate()`."""
    return {f.name: getattr(options, f.name) for f in fields(options)}
