"""The drafter registry: every drafter that is not a model (a model is named by its catalog name, Hugging Face id
or path) is registered by name, a factory that makes it for a target. A registered name then works wherever a
built-in one does: `generate(..., drafter=NAME)`, `auto`'s `drafters`, bench method specs, the CLI and the server.

    @speculant.register_drafter("mine")
    def mine(target):                      # -> a speculant.Drafter
        return MyDrafter(target.vocab_size)

The built-in kinds register in their own modules (`maxgram`, `suffix`), which load when their name is first
looked up; installed plugins name a module or factory in the `speculant.drafters` entry point group, loaded
likewise. Names are known without importing any of them (parsing a spec needs no torch).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from speculant.errors import ConfigError

log = logging.getLogger(__name__)

BUILTIN = {"maxgram": "speculant.drafters.maxgram", "suffix": "speculant.drafters.suffix"}  # name -> its module
ENTRY_POINTS = "speculant.drafters"
RESERVED = ("self", "none", "model", "default")  # the target's own weights; plain decoding; what names a model
# drafter; a method's drafter where none is named (drafters.spec.DEFAULT)


@dataclass(frozen=True)
class DrafterKind:
    name: str
    factory: Callable[..., Any]
    with_session: bool  # the factory takes (target, session): a built-in that keeps state in the session


DRAFTERS: dict[str, DrafterKind] = {}


def register_drafter(name: str, *, with_session: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that registers a drafter factory under `name`: `factory(target)` returns a `speculant.Drafter`
    for a loaded target (with `with_session`, `factory(target, session)`: state that outlives a generation
    belongs in the session)."""
    if not isinstance(name, str):
        raise ConfigError(f"register_drafter takes the drafter's name, @register_drafter(\"NAME\"), not "
                          f"{type(name).__name__}")
    check_drafter_name(name)

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        arguments = "target, session" if with_session else "target"
        try:
            inspect.signature(factory).bind(*arguments.split(", "))
        except TypeError:
            raise ConfigError(f"drafter '{name}': its factory must be called with ({arguments}), not "
                              f"{getattr(factory, '__name__', type(factory).__name__)}") from None
        except ValueError:
            pass  # (a callable whose signature Python cannot read)
        held = DRAFTERS.get(name)
        if held is not None and _origin(held.factory) != _origin(factory):
            raise ConfigError(f"drafter '{name}' is already registered by {_origin(held.factory)}")
        if held is None and name in BUILTIN and factory.__module__ != BUILTIN[name]:
            raise ConfigError(f"drafter '{name}' is built in ({BUILTIN[name]})")
        DRAFTERS[name] = DrafterKind(name, factory, with_session)
        return factory

    return wrap


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # (no '.', '/', '@', ',', ':', '=' or space: a model's path or id, a
# spec's suffix or a list's separator; the name is typed on command lines and read back from stats)


def check_drafter_name(name: str) -> None:
    """A drafter's name: letters, digits, '_' and '-', not reserved and no catalog model's (a ConfigError says why)."""
    from speculant.models.catalog import CATALOG

    if not NAME.fullmatch(name) or name in RESERVED or name in CATALOG:
        raise ConfigError(f"{name!r} cannot name a drafter: a name is letters, digits, '_' and '-', beginning with "
                          f"a letter or digit, neither reserved ({', '.join(RESERVED)}) nor a catalog model's")


def _origin(factory: Callable[..., Any]) -> str:
    return f"{factory.__module__}.{factory.__qualname__}"


@cache
def _plugins() -> dict[str, Any]:
    """The installed plugins' entry points by name, read once per process (specs are parsed on every request; a scan
    of every installed package's metadata is not free). One whose name cannot name a drafter is left out, with a
    warning: it would otherwise stand for a catalog model, a path or `self` wherever a spec names them."""
    plugins = {}
    for entry in entry_points(group=ENTRY_POINTS):
        try:
            check_drafter_name(entry.name)
        except ConfigError as refused:
            log.warning("plugin %s (entry point group %s) left out: %s", entry.value, ENTRY_POINTS, refused)
            continue
        plugins[entry.name] = entry
    return plugins


def is_registered(name: str) -> bool:
    """Whether `name` is a drafter kind: built in, registered, or an installed plugin's (nothing is imported)."""
    return name in DRAFTERS or name in BUILTIN or name in _plugins()


def names() -> list[str]:
    return sorted({*BUILTIN, *DRAFTERS, *_plugins()})


def kind(name: str) -> DrafterKind:
    """The registered kind `name`, importing the module that registers it where it has not been yet."""
    if name not in DRAFTERS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    elif name not in DRAFTERS and name in (plugins := _plugins()):
        try:
            loaded = plugins[name].load()  # a module that registers itself, or the factory
        except Exception as error:  # noqa: BLE001 - a plugin is another package's code: whatever its import raises
            raise ConfigError(f"plugin '{name}' ({plugins[name].value}) failed to load: {type(error).__name__}: "
                              f"{error}") from error
        if name not in DRAFTERS and callable(loaded):
            register_drafter(name)(loaded)
        elif name not in DRAFTERS:
            raise ConfigError(f"plugin '{name}' ({plugins[name].value}) registered no drafter named '{name}': an entry "
                              "point's name is its drafter's, so its module registers that name (or the entry point "
                              "names a factory, module:function)")
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter '{name}' (registered: {', '.join(names())})")
    return DRAFTERS[name]


def make_drafter(name: str, target: Any, session: Any) -> Any:
    """The registered drafter `name` for `target`, checked to be a Drafter."""
    from speculant.drafters.base import Drafter

    registered = kind(name)
    if registered.with_session and session is None:
        raise ConfigError(f"drafter '{name}' keeps state in a session: load it with Session(target).drafter('{name}')")
    drafter = registered.factory(target, session) if registered.with_session else registered.factory(target)
    if not isinstance(drafter, Drafter):
        raise ConfigError(f"drafter '{name}': its factory returned {type(drafter).__name__}, not a speculant.Drafter")
    return drafter
