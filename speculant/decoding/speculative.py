"""Speculative decoding and sampling (Leviathan et al. 2023; Chen et al. 2023).

Each iteration the drafter proposes up to k tokens, the target scores the last committed token plus
the draft in one forward pass, and the verifier keeps the accepted prefix plus one target token.
"""

from __future__ import annotations

import torch

from speculant.config import SamplingConfig
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.decoding.step import until_eos, verify_step
from speculant.drafters.base import Draft, Drafter
from speculant.models.base import CausalLM
from speculant.models.wrappers.metered import metered
from speculant.sampling import next_token


def speculative(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: list[int],
    k: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    method: str = "sd",
) -> Decoder:
    """Lossless speculative decoding: greedy output equals `autoregressive`, samples follow p.
    `method` names the run in its stats (a cascade drafter makes it "cascade")."""
    stats = GenerationStats(method=method)
    out: list[int] = []
    target = metered(target)
    logits = target.prefill(prompt_ids)
    pending = [next_token(logits, sampling, generator)]  # committed next, not yet run by the target
    while not (yield from emit(pending, out, max_new_tokens, target.eos_token_ids)):
        # Draft no more than can still be emitted: n accepted plus one target token (a drafter is asked for k >= 1).
        room = min(k, max_new_tokens - len(out) - 1)
        draft = until_eos(drafter.propose(prompt_ids + out, room), target.eos_token_ids) if room else Draft([])
        step = verify_step(target, out[-1], draft, sampling, generator)
        if room:  # (told of its own proposals only: the last step, with no room, proposed nothing)
            drafter.observe(len(step.accepted))
        stats.record_draft(step.drafted, len(step.accepted), draft.usage)
        pending = step.tokens
    stats.new_tokens = len(out)
    stats.record_target(target.usage)
    return stats
