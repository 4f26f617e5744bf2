"""Frozen dataclasses for every knob. Validation lives here; CLI options are derived from the fields."""

from __future__ import annotations

import argparse
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from speculant.errors import ConfigError

T = TypeVar("T")
AUTO = "auto"  # a tree size the latency-aware objective chooses


def count_or_auto(text: str) -> int | str:
    """Parse a count, or `auto`."""
    return AUTO if text == AUTO else int(text)


def option(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that also describes its command-line option."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = option(0.0, "sampling temperature; 0 means greedy (argmax)")
    top_k: int | None = option(None, "sample only among the k most likely tokens")
    top_p: float | None = option(None, "sample only from the smallest set of tokens with this total probability")

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


METHODS = ("ar", "sd", "tree", "cascade", "dsi")
EXECUTORS = ("thread", "process", "ray")  # where DSI's target servers run
DEFAULT_TARGET = "qwen2.5-coder-1.5b"  # catalog names (speculant.models.catalog)
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class DecodeConfig:
    method: str = option("sd", "decoding method: ar (autoregressive), sd (speculative), tree (token tree), "
                         "cascade (cascade speculative drafting), dsi (distributed speculative inference)",
                         choices=METHODS)
    k: int = option(4, "draft tokens per speculation step (sd; cascade: per level when no K matrix is given)")
    draft_confidence: float = option(0.0, "sd: end a draft early after a token its model drafter gives a "
                                     "probability below this (0: always draft k)")
    depth: int | str = option(4, "draft tree depth: drafting steps per tree, or auto (tree)", parse=count_or_auto)
    width: int | str = option(4, "nodes added per drafting step, or auto (tree)", parse=count_or_auto)
    verify_width: int | str | None = option(None, "tree: verify at most this many drafted nodes, the subtree "
                                            "chosen by dynamic programming, or auto (default: all)",
                                            parse=count_or_auto)
    leniency: float = option(1.0, "cascade: leniency l >= 1 of the inner reviews (the target's stays exact)")
    servers: int = option(1, "dsi: target servers verifying in parallel (the speculation-parallelism degree)")
    lookahead: int | None = option(None, "dsi: drafts per verification job (default: the smallest the servers "
                                   "keep up with, planned from the latencies)")
    executor: str = option("thread", "dsi: where target servers run", choices=EXECUTORS)
    max_new_tokens: int = option(128, "stop after this many new tokens")
    seed: int | None = option(None, "seed of the one random generator (sampling only)")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
        if self.k < 1:
            raise ConfigError(f"k must be >= 1, got {self.k}")
        if not 0 <= self.draft_confidence < 1:
            raise ConfigError(f"draft-confidence must lie in [0, 1), got {self.draft_confidence}")
        if self.draft_confidence and self.method != "sd":
            raise ConfigError("draft-confidence applies to method 'sd' only")
        for name in ("depth", "width", "verify_width"):
            value = getattr(self, name)
            if value not in (None, AUTO) and not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{name.replace('_', '-')} must be an integer >= 1 or auto, got {value!r}")
        if self.servers < 1:
            raise ConfigError(f"servers must be >= 1, got {self.servers}")
        if self.lookahead is not None and self.lookahead < 1:
            raise ConfigError(f"lookahead must be >= 1, got {self.lookahead}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"unknown executor '{self.executor}' (choose from {', '.join(EXECUTORS)})")
        if self.method != "dsi" and (self.servers != 1 or self.lookahead is not None or self.executor != "thread"):
            raise ConfigError("servers, lookahead and executor apply to method 'dsi' only")
        if not self.leniency >= 1:
            raise ConfigError(f"leniency must be >= 1, got {self.leniency}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class ModelConfig:
    dtype: str = option("bf16", "weight and activation dtype", choices=("bf16", "fp32"))
    device: str = option("cpu", "cpu, cuda or cuda:N")


def _scalar_type(annotation: Any) -> type:
    """`int | None` -> int; `float` -> float (annotations are strings under postponed evaluation)."""
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307
    if isinstance(hint, types.UnionType):
        hint = next(arg for arg in hint.__args__ if arg is not type(None))
    return hint


def add_options(parser: argparse.ArgumentParser, config: type, **overrides: Any) -> None:
    """Add one `--flag` per field of a config dataclass; `overrides` replace defaults."""
    for f in fields(config):
        default = overrides.get(f.name, f.default if f.default is not MISSING else None)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=f.metadata.get("parse") or _scalar_type(f.type),
            default=default,
            choices=f.metadata.get("choices"),
            help=f"{f.metadata.get('help', '')} (default: {default})",
        )


def from_args(config: type[T], args: argparse.Namespace) -> T:
    """Build a config dataclass from parsed options (validation happens in the dataclass)."""
    return config(**{f.name: getattr(args, f.name) for f in fields(config)})
