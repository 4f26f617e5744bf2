"""A Session owns everything generations on one target load or learn: the drafters loaded for it and their KV
caches, what `auto` learned of their acceptance, forward times and the lengths of generations, the machine
profiles in use, the tree methods' measured costs, suffix decoding's history, cross-vocabulary tables and a server's
prefix cache (`speculant.prefixes`).

A generation's speed depends on this state, so it lives in one object a caller can see, pass and drop:
`generate(target, ..., session=s)`; without one, `generate` uses the target's default session (`Session.of`),
which lives as long as the target does. The CLI, the server and the bench each make their own. Nothing in
`methods/`, `decoding/`, `drafters/`, `trees/` or `latency.py` keeps module-level state a generation's speed depends on
(registries of names, memos of pure functions and DSI's id counters aside): they are handed what they need from here.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any
from weakref import WeakKeyDictionary

from speculant.decoding.adaptive import Acceptance, Scale, Timings
from speculant.drafters.suffix import History
from speculant.errors import ConfigError
from speculant import latency
from speculant.latency import LatencyProfile
from speculant.models.base import CausalLM, DraftCache, adopted, owner_of
from speculant.prefixes import PrefixCache

LENGTHS_KEPT = 32  # the generations whose lengths `auto` weighs a drafter's catch-up against


class Session:
    """What generations on `target` share (see the module docstring). Keys are by the model that holds the
    weights (`owner_of`): a server's per-request handles and a wrapped target share their model's session."""

    def __init__(self, target: CausalLM, prefixes: PrefixCache | None = None):
        if not isinstance(owner_of(target), CausalLM):
            raise ConfigError(f"a Session is for a loaded model (what load_model returns), not "
                              f"{type(target).__name__}")
        adopted(target)
        self._target = weakref.ref(owner_of(target))  # (the target's default session lives on it: no cycle)
        self.drafters: dict[tuple[str, str | None], Any] = {}  # (spec, dtype) -> the loaded drafter
        self.made_by: dict[tuple[str, str | None], Any] = {}  # (spec, dtype) -> the registered kind that made it
        self.caches: dict[int, DraftCache] = {}  # id of a drafter model it loaded -> the DraftCache on its KV cache
        self.acceptance: dict[str, dict[int, Acceptance]] = {}  # candidate name -> estimates by match bucket
        self.scales: dict[str, Scale] = {}  # drafter name -> its forwards' time over its profile's
        self.named: dict[str, list[Any]] = {}  # a drafter name -> (weak) references to its drafters, numbered
        self.timings = Timings()  # the target's forwards' time over its profile's
        self.lengths: deque[float] = deque(maxlen=LENGTHS_KEPT)  # the last generations' lengths
        self.history = History()  # suffix decoding's earlier generations
        self.vocab_pairs: dict[tuple[int, int, int, int], Any] = {}  # cross-vocabulary tables (`drafters.vocab`)
        self.measured: WeakKeyDictionary = WeakKeyDictionary()  # the tree methods' T(W), coverage, depth predictors
        self._profiles: WeakKeyDictionary = WeakKeyDictionary()  # model -> (its machine key, its profile)
        self.said: set[str] = set()  # warnings about a setting, given once per session, not per generation
        self.prefixes = prefixes or PrefixCache(0)  # prompts' KV kept across a server's requests (default: off)

    @property
    def target(self) -> CausalLM:
        target = self._target()
        if target is None:
            raise ConfigError("the session's target was dropped (a Session holds its target weakly: keep the loaded "
                              "model it was made for)")
        return target

    @classmethod
    def of(cls, target: CausalLM) -> Session:
        """The target's default session: made on first use, kept on the model object, dropped with it."""
        model = owner_of(target)
        session = getattr(model, "__dict__", {}).get("default_session")
        if session is None:
            session = model.__dict__["default_session"] = cls(model)  # (not a model: refused there)
        return session

    def drafter(self, spec: Any, dtype: str | None = None) -> Any:
        """The drafter `spec` names for this session's target (`drafters.spec.load_drafter`), loaded once: a
        model drafter keeps its weights and, through `cache`, its KV cache across generations. A model or a
        Drafter object passed in is the caller's to keep and is returned as loaded for this call only. A name
        registered again since (a notebook's cell run again) loads afresh, from its new factory."""
        from speculant.drafters.registry import DRAFTERS
        from speculant.drafters.spec import DrafterSpec, as_drafter, check_dtype_of, load_drafter, model_free, resolved

        given = as_drafter(spec)
        check_dtype_of(dtype, given)  # (where it loads none, a dtype meant for a method's other drafters passes it by)
        spec = resolved(given, self.target.name)  # (`default`: loaded once, under what it stands for)
        if spec is not given and dtype is not None and model_free(spec):
            raise ConfigError(f"drafter dtype {dtype} applies to a model drafter, and the catalog pairs none with "
                              f"{self.target.name} (its default drafter is {spec}): name one")
        if not isinstance(spec, DrafterSpec):
            return load_drafter(spec, self.target, dtype, self)
        key = (str(spec), dtype)
        if key not in self.drafters or self.made_by[key] is not DRAFTERS.get(spec.source):
            self.drafters[key] = load_drafter(spec, self.target, dtype, self)
            self.made_by[key] = DRAFTERS.get(spec.source)  # (after loading: a plugin registers as it is imported)
        return self.drafters[key]

    def cache(self, model: CausalLM) -> DraftCache:
        """The DraftCache a drafter model drafts from. For a model this session loaded, the one kept across
        generations: every method drafts through it, so what it says the cache holds stays true, and the next
        turn of a conversation catches up only on what is new. For a model the caller passed in (a server's
        per-request handle), one for this generation: the caller keeps the model, and the session keeps nothing of
        it."""
        from speculant.models.wrappers.metered import metered

        check_model(model, "cache")
        if not any(model is loaded for loaded in self.drafters.values()):
            return DraftCache(metered(model))
        if id(model) not in self.caches:  # (its models live as long as the session: their ids stay theirs)
            self.caches[id(model)] = DraftCache(metered(model))
        return self.caches[id(model)]

    def profile(self, model: CausalLM) -> LatencyProfile:
        """`model`'s machine profile (`latency.machine_profile`), read or measured once per session. A measurement
        runs the model's own cache (`ran_apart`)."""
        check_model(model, "profile")
        model = owner_of(model)
        key = latency.profile_key(model)
        held = self._profiles.get(model)
        if held is None or held[0] != key:
            held = self._profiles[model] = key, latency.machine_profile(model)
            self.ran_apart(model)
        return held[1]

    def ran_apart(self, model: CausalLM) -> None:
        """A measurement ran `model`'s own cache: the session's DraftCaches over it are told (`DraftCache.forget`)."""
        model = owner_of(model)
        for cache in self.caches.values():
            if owner_of(cache.model) is model:
                cache.forget()

    def own_name(self, drafter: Any) -> str:
        """`drafter`'s name for what `auto` learns of it: its own, and where another drafter of its name came
        first (two user Drafters left unnamed, two models of one class), its own numbered ("drafter #2"). The number
        stays the drafter's for as long as it lives, whatever order later requests give them in; a number whose
        drafter was dropped goes to the next new one of its name, so a caller that makes its drafter afresh per
        request keeps what was learned of it."""
        own = getattr(drafter, "inner", drafter)  # (a user's Drafter as given, not its check; a server's per-request
        own = owner_of(own) if isinstance(own, CausalLM) else own  # handle: the model it shares)
        held = self.named.setdefault(drafter.name, [])
        n = next((i for i, ref in enumerate(held) if ref() is own), None)
        if n is None:
            n = next((i for i, ref in enumerate(held) if ref() is None), len(held))
            held[n:n + 1] = [weakref.ref(own)]  # (drafters and models take weak references: no __slots__)
        return drafter.name if n == 0 else f"{drafter.name} #{n + 1}"

    def estimates(self, name: str) -> dict[int, Acceptance]:
        return self.acceptance.setdefault(name, {})

    def scale(self, name: str) -> Scale:
        return self.scales.setdefault(name, Scale())


def check_model(model: Any, what: str) -> None:
    """A ConfigError unless `model` is a loaded CausalLM (`what`: the Session method given it)."""
    if not isinstance(model, CausalLM):
        raise ConfigError(f"Session.{what} takes a loaded model (a CausalLM: speculant.load_model), not "
                          f"{type(model).__name__}")
