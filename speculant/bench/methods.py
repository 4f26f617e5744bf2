"""Method specs on the command line: `ar`, `sd:drafter=qwen2.5-coder-0.5b,k=4,dtype=bf16`."""

from __future__ import annotations

from dataclasses import dataclass

from speculant.config import METHODS, DecodeConfig
from speculant.errors import ConfigError

OPTIONS = {"ar": set(), "sd": {"drafter", "k", "dtype"}}
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class MethodSpec:
    label: str  # the spec as written, used as the method's name in reports
    method: str
    drafter: str | None = None
    k: int = 4
    drafter_dtype: str | None = None  # None: the target's dtype


def parse_method(spec: str) -> MethodSpec:
    name, _, rest = spec.strip().partition(":")
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}' in '{spec}' (choose from {', '.join(METHODS)})")
    options: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS[name]:
            allowed = ", ".join(sorted(OPTIONS[name])) or "none"
            raise ConfigError(f"bad option '{item}' for method '{name}' (options: {allowed})")
        options[key] = value
    try:
        k = int(options.get("k", 4))
    except ValueError:
        raise ConfigError(f"k must be an integer in '{spec}'") from None
    DecodeConfig(method=name, k=k)  # validates
    dtype = options.get("dtype")
    if dtype not in (None, "bf16", "fp32"):
        raise ConfigError(f"dtype must be bf16 or fp32 in '{spec}'")
    drafter = options.get("drafter", DEFAULT_DRAFTER) if name == "sd" else None
    return MethodSpec(spec.strip(), name, drafter, k, dtype)
