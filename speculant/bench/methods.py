"""Method specs on the command line: `ar`, `ar:dtype=bf16`, `sd:drafter=qwen2.5-coder-0.5b,k=4`,
`sd:drafter=qwen2.5-coder-0.5b@int8,k=6,dtype=fp32,drafter_dtype=bf16`, `sd:drafter=maxgram,k=8`,
`sd:drafter=qwen2.5-coder-0.5b@int4,k=15,draft_confidence=0.5`,
`tree:drafter=qwen2.5-coder-0.5b@int8,depth=4,width=4,verify_width=8,profile=prof.json,dtype=fp32`
(each size may be `auto`),
`cascade:drafters=qwen2.5-coder-0.5b@int8,maxgram,k_matrix=4,2;0,6,leniency=2`,
`dsi:drafter=qwen2.5-coder-0.5b@int8,servers=2,lookahead=6,executor=process`
(values may hold commas: an option ends where the next `name=` begins), and the peers `hf-ar`, `hf-assisted[:k=N]`, `hf-pld[:k=N]`.

`dtype` is the target's dtype for this method (default: --dtype); `drafter_dtype` the drafter's
(default: the target's)."""

from __future__ import annotations

import re
from pathlib import Path
from dataclasses import dataclass

from speculant.config import DEFAULT_DRAFTER, DecodeConfig, count_or_auto
from speculant.drafters.cascade import parse_k_matrix
from speculant.errors import ConfigError

OPTIONS = {
    "ar": {"dtype"},
    "sd": {"drafter", "k", "draft_confidence", "dtype", "drafter_dtype"},
    "tree": {"drafter", "depth", "width", "verify_width", "profile", "dtype", "drafter_dtype"},
    "cascade": {"drafters", "k_matrix", "k", "leniency", "dtype", "drafter_dtype"},
    "dsi": {"drafter", "servers", "lookahead", "executor", "dtype", "drafter_dtype"},
    # Peers: transformers generate() plain, assisted (k = num_assistant_tokens), prompt lookup (k = n-gram draft).
    "hf-ar": {"dtype"},
    "hf-assisted": {"drafter", "k", "dtype", "drafter_dtype"},
    "hf-pld": {"k", "dtype"},
}
NEEDS_DRAFTER = {"sd", "tree", "dsi", "hf-assisted"}
DTYPES = (None, "bf16", "fp32")


@dataclass(frozen=True)
class MethodSpec:
    label: str  # the spec as written, used as the method's name in reports
    method: str
    drafter: str | None = None
    k: int | None = None  # None: the method's default (sd: 4; peers: transformers' defaults)
    draft_confidence: float = 0.0  # sd only: end a model drafter's draft after a token it doubts
    depth: int | str = 4  # tree only; "auto": the objective decides
    width: int | str = 4  # tree only
    verify_width: int | str | None = None  # tree only: None verifies every drafted node
    profile: str | None = None  # tree only: the target's profile JSON for the latency-aware objective
    target_dtype: str | None = None  # None: the run's default dtype
    drafter_dtype: str | None = None  # None: the target's dtype
    drafters: tuple[str, ...] = ()  # cascade only: largest first, maxgram last
    k_matrix: str | None = None  # cascade only: "4,2;0,6"; None: the default for k
    leniency: float = 1.0  # cascade only
    servers: int = 1  # dsi only
    lookahead: int | None = None  # dsi only: None plans it from one measured forward per generation
    executor: str = "thread"  # dsi only

    @property
    def sources(self) -> tuple[str, ...]:
        """Every drafter this method loads."""
        return self.drafters or ((self.drafter,) if self.drafter else ())


def parse_method(spec: str) -> MethodSpec:
    name, _, rest = spec.strip().partition(":")
    if name not in OPTIONS:
        raise ConfigError(f"unknown method '{name}' in '{spec}' (choose from {', '.join(OPTIONS)})")
    options: dict[str, str] = {}
    for item in filter(None, re.split(r",(?=\w+=)", rest)):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS[name]:
            allowed = ", ".join(sorted(OPTIONS[name])) or "none"
            raise ConfigError(f"bad option '{item}' for method '{name}' (options: {allowed})")
        options[key] = value
    try:
        k = int(options["k"]) if "k" in options else (4 if name in ("sd", "cascade") else None)
        depth, width = count_or_auto(options.get("depth", "4")), count_or_auto(options.get("width", "4"))
        verify_width = count_or_auto(options["verify_width"]) if "verify_width" in options else None
        leniency = float(options.get("leniency", 1))
        draft_confidence = float(options.get("draft_confidence", 0))
        servers = int(options.get("servers", 1))
        lookahead = int(options["lookahead"]) if "lookahead" in options else None
    except ValueError:
        raise ConfigError(f"k, servers and lookahead must be integers, depth, width and verify_width integers or "
                          f"auto, and leniency and draft_confidence numbers in '{spec}'") from None
    executor = options.get("executor", "thread")
    DecodeConfig(method=name if name == "dsi" else "sd", k=1 if k is None else k, draft_confidence=draft_confidence,
                 depth=depth, width=width, verify_width=verify_width, leniency=leniency, servers=servers,
                 lookahead=lookahead, executor=executor)  # validates
    drafters = tuple(filter(None, options.get("drafters", "").split(",")))
    if name == "cascade" and not drafters:
        raise ConfigError(f"method 'cascade' needs drafters=..., e.g. 'cascade:drafters={DEFAULT_DRAFTER},maxgram'")
    k_matrix = options.get("k_matrix")
    if k_matrix is not None:
        parse_k_matrix(k_matrix, len(drafters))  # validates its form; the levels check it in full
    target_dtype, drafter_dtype = options.get("dtype"), options.get("drafter_dtype")
    if target_dtype not in DTYPES or drafter_dtype not in DTYPES:
        raise ConfigError(f"dtypes must be bf16 or fp32 in '{spec}'")
    drafter = options.get("drafter", DEFAULT_DRAFTER) if name in NEEDS_DRAFTER else None
    profile = options.get("profile")
    if profile is not None and not Path(profile).is_file():
        raise ConfigError(f"profile not found: {profile} (make one with `speculant profile --out`)")
    if draft_confidence and drafter == "maxgram":
        raise ConfigError(f"draft_confidence needs a model drafter in '{spec}'")
    return MethodSpec(spec.strip(), name, drafter, k, draft_confidence, depth, width, verify_width, profile,
                      target_dtype, drafter_dtype, drafters, k_matrix, leniency, servers, lookahead, executor)
