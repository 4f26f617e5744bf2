"""Plain autoregressive decoding: the reference every accelerated decoder must reproduce."""

from __future__ import annotations

import torch

from speculant.config import SamplingConfig
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.models.base import CausalLM
from speculant.models.wrappers.metered import metered
from speculant.sampling import next_token


def autoregressive(
    target: CausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Decoder:
    """One target forward per token. Yields each token as it is committed."""
    stats = GenerationStats(method="ar")
    out: list[int] = []
    target = metered(target)  # (its forwards counted and timed, as every method's)
    logits = target.prefill(prompt_ids)
    while True:
        token = next_token(logits, sampling, generator)
        if (yield from emit([token], out, max_new_tokens, target.eos_token_ids)):
            break
        logits = target.forward([token])[-1]
    stats.record_target(target.usage)
    stats.new_tokens = len(out)
    return stats
