"""Speculative decoding and sampling (Leviathan et al. 2023; Chen et al. 2023).

Each iteration the drafter proposes up to k tokens, the target scores the last committed token plus
the draft in one forward pass, and the verifier keeps the accepted prefix plus one target token.
"""

from __future__ import annotations

import torch

from speculant.config import SamplingConfig
from speculant.decoding.run import Decoder, emit
from speculant.decoding.stats import GenerationStats
from speculant.drafters.base import Draft, Drafter
from speculant.models.base import CausalLM
from speculant.models.metered import metered
from speculant.sampling import logits_to_probs, next_token
from speculant.verify import verify_greedy, verify_sampling


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
        # Draft no more than can still be emitted: n accepted plus one target token.
        draft = until_eos(drafter.propose(prompt_ids + out, min(k, max_new_tokens - len(out) - 1)),
                          target.eos_token_ids)
        n, token = verify_draft(target, out[-1], draft, sampling, generator)
        drafter.observe(n)
        stats.record_draft(len(draft.tokens), n, draft.usage)
        pending = draft.tokens[:n] + [token]
    stats.new_tokens = len(out)
    stats.record_target(target.usage)
    return stats


def verify_draft(target: CausalLM, last: int, draft: Draft, sampling: SamplingConfig,
                 generator: torch.Generator | None) -> tuple[int, int]:
    """One target forward over the last committed token and the draft, then verification: (accepted count,
    the target's token after them). The target's cache keeps `last` and the accepted drafts."""
    drafted = torch.tensor(draft.tokens, dtype=torch.long, device=target.device)
    cached = target.cache_len
    target_logits = target.forward([last, *draft.tokens])  # [1 + len(draft), vocab]
    if sampling.greedy:
        n, token = verify_greedy(drafted, target_logits)
    else:
        q = draft.probs.to(target.device) if draft.probs is not None else None
        n, token = verify_sampling(drafted, logits_to_probs(target_logits, sampling), q, generator)
    target.rollback(cached + 1 + n)
    return n, token


def until_eos(draft: Draft, eos: frozenset[int]) -> Draft:
    """The draft up to its first end-of-sequence token: nothing after it could ever be committed."""
    stop = next((i for i, token in enumerate(draft.tokens) if token in eos), None)
    if stop is None or stop == len(draft.tokens) - 1:
        return draft
    probs = draft.probs[: stop + 1] if draft.probs is not None else None
    return Draft(draft.tokens[: stop + 1], probs, draft.usage)
