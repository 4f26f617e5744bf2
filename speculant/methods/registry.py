"""The method registry: each method is one module that declares a frozen options dataclass and a
decoder factory and registers them here. `generate()`, the CLI's flags, bench method specs and server
request options all read this registry, so a new option is one field in one dataclass.

Method modules import their decoders inside the factory: reading every method's options (the CLI
parser, `speculant simulate`) must not need torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import Field, dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from speculant.config import REQUEST_ITEMS, ModelConfig, RunConfig, SamplingConfig, parse_value, typed
from speculant.errors import ConfigError, OptionError

if TYPE_CHECKING:
    import torch

    from speculant.decoding.run import Decoder
    from speculant.models.base import CausalLM
    from speculant.session import Session


@dataclass(frozen=True)
class Request:
    """What every method's factory gets besides its own options."""

    target: CausalLM
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    generator: torch.Generator
    session: Session  # what loaded drafters and learned state the generation uses (and adds to)
    seed: int | None = None


@dataclass(frozen=True)
class Method:
    name: str
    options: type  # a frozen dataclass; its __post_init__ validates and normalises
    build: Callable[[Request, Any], Decoder]
    help: str
    bounds: Callable[[Any, Collection[str]], None] | None = None  # refuses sizes too large together (`register`)
    chains: bool = False  # its sampled draft chains are verified as `SamplingConfig.verifier` says
    loaded: Callable[[Any, Any], None] | None = None  # refuses loaded drafters it cannot draft with (`register`)

    def check_verifier(self, given: Collection[str], spell: Callable[[str], str] = str) -> None:
        """Refuse a `verifier` given (`given` names the sampling settings set) to a method that verifies no chain:
        it would do nothing."""
        if "verifier" in given and not self.chains:
            raise OptionError("verifier", f"{spell('verifier')} applies to {chain_methods()}, not '{self.name}'")

    def check_request(self, options: Any, names: Collection[str]) -> None:
        """Refuse what a server's client may not ask of this method with the options it `names`: one beyond its
        field's `most` or with more than REQUEST_ITEMS items (`check_most`), or sizes too large together (`bounds`)."""
        check_most(options, names)
        if self.bounds is not None:
            self.bounds(options, names)

    def make_options(self, given: Mapping[str, Any]) -> Any:
        """The options dataclass from keyword values; an unknown or misplaced name is one clear error."""
        return make_options(self.options, self.name, given)

    def parse_options(self, given: Mapping[str, str]) -> Any:
        """The options dataclass from text values (bench specs, CLI flags), each parsed by its field."""
        return make_options(self.options, self.name, given, text=True)

    def parse_values(self, given: Mapping[str, str]) -> dict[str, Any]:
        """Text values, each parsed by its field (`parse_values`)."""
        return parse_values(self.options, self.name, given)


METHODS: dict[str, Method] = {}


# What a method's option may not be called: `generate()`'s own keywords and the run's settings, which `generate()`,
# the CLI's flags and bench specs take for themselves (an option of that name could never be set, or clash as a flag)
RESERVED = frozenset({"target", "prompt", "prompt_ids", "method", "stream", "chat", "logprobs", "logit_bias",
                      "response_format", "session", *(f.name for c in (SamplingConfig, RunConfig, ModelConfig)
                                                       for f in fields(c))})


def register(name: str, options: type, help: str, bounds: Callable[[Any, Collection[str]], None] | None = None,
             chains: bool = False, loaded: Callable[[Any, Any], None] | None = None,
             ) -> Callable[[Callable[[Request, Any], Decoder]], Method]:
    """Decorator for a method's decoder factory: `@register("sd", SDOptions, "...")`; `bounds(options, names)` raises
    an OptionError, naming one of `names`, where a server's client that set those options asks too much of them
    together (`Method.check_request`); `chains`: its sampled draft chains are verified as `verifier` says;
    `loaded(options, target)`, with the drafters in `options` loaded, raises a ConfigError where they cannot draft for
    `target` as the method would (a server checks its own options so at its start, not in every request)."""

    if not (isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9_-]*", name)):  # (`--method NAME`, `NAME:k=4`)
        raise ConfigError(f"{name!r} cannot name a method: a name is lowercase letters, digits, '_' and '-', "
                          "beginning with a letter")
    if not (isinstance(options, type) and is_dataclass(options) and options.__dataclass_params__.frozen):
        raise ConfigError(f"method '{name}': its options are a frozen dataclass (the CLI's flags, bench specs and "
                          f"request options are read from its fields), not {options!r}")
    if taken := sorted({f.name for f in fields(options)} & RESERVED):
        raise ConfigError(f"method '{name}': an option may not be called {taken[0]!r}, a setting of every run's "
                          f"(taken: {', '.join(sorted(RESERVED))})")

    def wrap(build: Callable[[Request, Any], Decoder]) -> Method:
        if name in METHODS:
            raise ConfigError(f"method '{name}' is already registered ({METHODS[name].build.__module__})")
        METHODS[name] = Method(name, options, build, help, bounds, chains, loaded)
        return METHODS[name]

    return wrap


def chain_methods() -> str:
    """The methods whose sampled draft chains follow `verifier`, as a refusal of one names them."""
    return f"methods that verify sampled draft chains ({', '.join(m.name for m in METHODS.values() if m.chains)})"


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}' (choose from {', '.join(METHODS)})")
    return METHODS[name]


def owners(option: str) -> list[str]:
    """The methods that take an option."""
    return [m.name for m in METHODS.values() if any(f.name == option for f in fields(m.options))]


def make_options(options: type, method: str, given: Mapping[str, Any], text: bool = False) -> Any:
    """`options(**given)` for `method`, values parsed by their fields when `text`; an unknown or misplaced
    name is one clear error naming the methods it belongs to and what `method` takes."""
    if text:
        given = parse_values(options, method, given)
    else:
        check_names(options, method, given)
        given = typed(options, dict(given))
    return options(**given)


def parse_values(options: type, method: str, given: Mapping[str, str]) -> dict[str, Any]:
    """Text values parsed by their fields of `options`; an unknown name or a bad value is an OptionError naming it,
    and so are both names of a pair of which the options take one or the other (their `EITHER` pairs: a flag, a
    bench spec or a request that gives both would have one ignored)."""
    by_name = {f.name: f for f in fields(options)}
    check_names(options, method, given)
    check_pairs(options, method, given)
    return {name: parse_value(by_name[name], value) for name, value in given.items()}  # (an OptionError names it)


def check_pairs(options: type, method: str, given: Iterable[str]) -> None:
    """Both names of a pair of which `options` take one or the other (their `EITHER` pairs) is an OptionError: one
    would be ignored."""
    for one, other in getattr(options, "EITHER", ()):
        if one in given and other in given:
            raise pair_error(one, other, method)


def check_given_pairs(built: Any, method: str, given: Mapping[str, Any]) -> None:
    """`check_pairs` for values given from Python (`built`: the options made of them), where a caller may pass every
    field (`as_keywords`): a pair counts as given where each of its values changes the options from what they are
    without it."""
    options = type(built)
    for one, other in getattr(options, "EITHER", ()):
        if one in given and other in given:
            without = [make_options(options, method, {k: v for k, v in given.items() if k != name})
                       for name in (one, other)]
            if all(getattr(built, name) != getattr(less, name) for name, less in zip((one, other), without)):
                raise pair_error(one, other, method)


def pair_error(one: str, other: str, method: str) -> OptionError:
    return OptionError(other, f"give '{one}' or '{other}', not both: '{method}' would use '{other}' only")


def check_names(options: type, method: str, given: Iterable[str], offered: Sequence[str] | None = None) -> None:
    """An unknown or misplaced name is an OptionError naming the methods it belongs to and what `method` takes (of
    its options, those `offered` where given: a server's client is offered `request_options`)."""
    names = [f.name for f in fields(options)]
    for name in given:
        if name not in names:
            takes = ", ".join(names if offered is None else offered) or "no options of its own"
            if where := owners(name):
                raise OptionError(name, f"option '{name}' does not apply to method '{method}' (it belongs to "
                                  f"{', '.join(where)}; '{method}' takes: {takes})")
            raise OptionError(name, f"unknown option '{name}' for method '{method}' ('{method}' takes: {takes})")


def request_options(method: str) -> list[str]:
    """The options a server's client may set per request for `method`: every option but the operator's (fields
    marked `operator`, which name files, devices, executors, addresses or server resources)."""
    return [f.name for f in fields(get_method(method).options) if not f.metadata.get("operator")]


def check_most(options: Any, names: Iterable[str]) -> None:
    """Refuse a named option whose value, or any number within it (a list of widths, a K matrix), is beyond its
    field's `most`, or whose list, or any list within it, has more than REQUEST_ITEMS items: checked on the parsed
    options, whatever type the client spelled the value in."""
    by_name = {f.name: f for f in fields(options)}
    for name in names:
        if name not in by_name:
            continue
        value, most = getattr(options, name), by_name[name].metadata.get("most")
        if most is not None and any(number > most for number in numbers(value)):
            raise OptionError(name, f"{name} is at most {most} per request")
        if longest(value) > REQUEST_ITEMS:
            raise OptionError(name, f"{name} has at most {REQUEST_ITEMS} items per request")


def numbers(value: Any) -> list[float]:
    """The numbers in an option's value: itself, or those of a (nested) list or tuple; none in text or a model."""
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in numbers(item)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def longest(value: Any) -> int:
    """The most items of a list or tuple in an option's value, itself or nested (0: none)."""
    if isinstance(value, (list, tuple)):
        return max([len(value), *map(longest, value)])
    return 0


def all_options() -> dict[str, Field]:
    """Every option of every method, once per name (one name means one meaning across methods)."""
    union: dict[str, Field] = {}
    for method in METHODS.values():
        for f in fields(method.options):
            union.setdefault(f.name, f)
    return union
