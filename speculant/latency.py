"""Latency profiles of a model (needs torch and the model): TTFT, TPOT and the forward cost T(W) of W
new tokens at a given context length, saved as JSON that simulators, planners and tree drafters read."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from speculant.errors import ConfigError


@dataclass
class LatencyProfile:
    model: str
    dtype: str
    device: str
    context_len: int
    ttft_s: float  # median prefill time over the prompts
    tpot_s: float  # median one-token decode time
    forward_s: dict[int, float] = field(default_factory=dict)  # W -> median time of W new tokens

    def cost(self, width: int) -> float:
        """T(W), interpolated linearly between measured widths."""
        widths = sorted(self.forward_s)
        return float(np.interp(width, widths, [self.forward_s[w] for w in widths]))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> LatencyProfile:
        try:
            data = json.loads(Path(path).read_text())
            data["forward_s"] = {int(w): float(t) for w, t in data["forward_s"].items()}
            return cls(**data)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"cannot read latency profile {path}: {error}") from None


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def profile_model(model, prompts: list[list[int]], widths: list[int], context_len: int, decode_steps: int = 4,
                  repeats: int = 3, dtype: str = "", warmup: bool = True) -> LatencyProfile:
    """Measure a CausalLM: median TTFT over `prompts`, median TPOT over `decode_steps` per prompt, and
    the median T(W) over `repeats` at `context_len` cached tokens (after one warm-up forward)."""
    if not prompts or not widths or context_len < 1:
        raise ConfigError("profiling needs prompts, widths and a positive context length")
    if warmup:
        model.prefill(prompts[0][:8])
        model.forward(prompts[0][:2])
    ttfts, tpots = [], []
    for ids in prompts:
        ttfts.append(_timed(lambda: model.prefill(ids)))
        for step in range(decode_steps):
            tpots.append(_timed(lambda: model.forward([ids[step % len(ids)]])))
    context = (sum(prompts, []) * (context_len // max(1, sum(map(len, prompts))) + 1))[:context_len]
    return LatencyProfile(model.name, dtype, str(model.device), context_len, statistics.median(ttfts),
                          statistics.median(tpots), forward_costs(model, context, widths, repeats))


def forward_costs(model, context: list[int], widths: Sequence[int], repeats: int = 3) -> dict[int, float]:
    """T(W): the median seconds of a forward of W new tokens after `context` is cached, for each W."""
    model.prefill(context)
    costs = {}
    for width in widths:
        new = (context * (width // len(context) + 1))[:width]
        samples = []
        for _ in range(repeats):
            samples.append(_timed(lambda: model.forward(new)))
            model.rollback(len(context))
        costs[width] = statistics.median(samples)
    return costs
