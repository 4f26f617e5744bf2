"""Method specs on the command line: `NAME[:option=value,...]` where NAME is a registered method (`auto`,
`ar`, `sd`, `tree`, `cascade`, `dsi`) or a peer (`hf-*`, `llamacpp-*`, `llamacpp-cli-*`: `bench.peers`) and the
options are that method's own (`speculant.methods`; a value may hold commas: it ends where the next `name=` begins),
plus `dtype` and `backend`, the target's dtype and backend for this method (default: the run's --dtype and
--backend; the llamacpp-* peers run on llama.cpp), and any sampling setting, this method's in place of the run's
(`auto:verifier=token`, `ar:temperature=1`). Examples:
`sd:drafter=qwen2.5-coder-0.5b@int8,k=6,dtype=fp32,drafter_dtype=bf16`, `sd:drafter=maxgram,k=8`,
`tree:depth=auto,width=auto,verify_width=auto`, `cascade:drafters=qwen2.5-coder-0.5b@int8,maxgram,k_matrix=4,2;0,6`,
`dsi:servers=2,lookahead=6,executor=process`, `hf-assisted:k=5`, `ar:backend=hf`, `llamacpp-pld:k=8`."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

from speculant.bench.peers import LLAMACPP_PEERS, PEERS
from speculant.config import AUTO, BACKENDS, DTYPES, SamplingConfig
from speculant.errors import ConfigError
from speculant.methods import METHODS, get_method
from speculant.methods.registry import make_options


@dataclass(frozen=True)
class MethodSpec:
    label: str  # the spec as written, used as the method's name in reports
    method: str
    options: Any  # the method's (or peer's) options dataclass (None where reported again, not run)
    dtype: str | None = None  # the target's dtype for this method; None: the run's
    backend: str | None = None  # the target's backend for this method; None: the run's
    sampling: tuple[tuple[str, Any], ...] = ()  # sampling settings of this method in place of the run's

    @property
    def peer(self) -> bool:
        return self.method in PEERS

    def runs(self, dtype: str, backend: str, sampling: SamplingConfig) -> tuple[Any, ...]:
        """What it runs in a run of `dtype`, `backend` and `sampling`, however it was written (`sd:k=04` and `sd:k=4`
        alike, `ar:temperature=0` and `ar` in a greedy run; as written where not built)."""
        if self.options is None:
            return (self.label,)
        return self.method, self.options, self.dtype or dtype, self.backend or backend, self.sampled(sampling)

    def sets(self, name: str) -> bool:
        """Whether it sets `name` (a sampling setting, dtype or backend) itself, in place of the run's."""
        return name in dict(self.sampling) or (name == "dtype" and self.dtype is not None) or \
            (name == "backend" and self.backend is not None)

    @property
    def chains(self) -> bool:
        """Whether its sampled draft chains follow `verifier` (a peer's never do)."""
        return not self.peer and get_method(self.method).chains

    def sampled(self, sampling: SamplingConfig) -> SamplingConfig:
        """The run's sampling with this method's own settings; the run's verifier reaches only methods whose sampled
        chains follow it (the others refuse one: a run's --verifier is for those that take it)."""
        own = dict(self.sampling)
        if "verifier" not in own and not self.chains:
            own["verifier"] = SamplingConfig().verifier
        return replace(sampling, **own)


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """A bench method spec, `name:key=value,...`, as its name and its options' text (a method's or a peer's)."""
    name, colon, rest = spec.strip().partition(":")
    if colon and not rest:
        raise ConfigError(f"'{spec}' ends with ':' but gives no option (name=value after it, or no ':')")
    if name not in METHODS and name not in PEERS:
        raise ConfigError(f"unknown method '{name}' in '{spec}' (choose from {', '.join([*METHODS, *PEERS])})")
    given: dict[str, str] = {}
    for item in re.split(r",(?=\w+=)", rest) if rest else []:
        key, eq, value = item.partition("=")
        if not item:
            raise ConfigError(f"an empty option in '{spec}' (options are name=value, separated by ',')")
        if not eq:
            raise ConfigError(f"bad option '{item}' in '{spec}' (options are name=value)")
        if key in given:
            raise ConfigError(f"option '{key}' given twice in '{spec}'")
        given[key] = value
    return name, given


def parse_method(spec: str, build: bool = True) -> MethodSpec:
    """A bench method spec, `name:key=value,...`, its options built and checked; `build=False`: a finished run's spec
    reported again (`--report-from`), whose options are left unbuilt, none of them run (the files they name may be
    gone since)."""
    name, given = split_spec(spec)
    dtype = given.pop("dtype", None)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} in '{spec}'")
    backend = given.pop("backend", "llamacpp" if name in LLAMACPP_PEERS else None)
    if backend is not None and backend not in (AUTO, *BACKENDS):
        raise ConfigError(f"backend must be one of auto, {', '.join(BACKENDS)} in '{spec}'")
    if name in LLAMACPP_PEERS and backend != "llamacpp":
        raise ConfigError(f"{name} runs on llama.cpp: backend={backend} does not apply in '{spec}' (leave it out)")
    own = {key: given.pop(key) for key in [f.name for f in fields(SamplingConfig)] if key in given}
    try:
        options = None if not build else make_options(PEERS[name], name, given, text=True) if name in PEERS else \
            get_method(name).parse_options(given)
        sampling = make_options(SamplingConfig, name, own, text=True)
        if name in PEERS and "verifier" in own:
            raise ConfigError(f"verifier applies to speculant's methods, not the peer '{name}'")
        if name in METHODS:
            get_method(name).check_verifier(own)
    except ConfigError as error:
        raise ConfigError(f"{error} in '{spec}'") from None
    return MethodSpec(spec.strip(), name, options, dtype, backend, tuple((key, getattr(sampling, key)) for key in own))
