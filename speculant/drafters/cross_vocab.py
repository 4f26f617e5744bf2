"""A model with another tokenizer as drafter (Timor et al. 2025, "Accelerating LLM Inference with Lossless
Speculative Decoding Algorithms for Heterogeneous Vocabularies"), and `model_drafter`, which makes any model
draft for a target: a ModelDrafter when their ids mean the same tokens, else a CrossVocabDrafter.

Greedy drafts are exchanged as text (string-level exact match, Algorithm 2): the committed target tokens are
spelled out and re-tokenized by the drafter, which first heals its last token (where the target's tokens end
inside a word, the drafter's split of the context ends where its own drafts would not: it drafts from the context
without that token, choosing among the tokens that start with its text; docs/results/cross-vocab.md measures what
it buys). The drafter's greedy continuation is spelled out and re-tokenized by the target, cut before its last
pre-token (a word the target might merge with what follows) and before any cut multi-byte character. The target verifies those tokens as any draft; what it accepts reaches the drafter as
text again, so the drafter's cache keeps every token it still shares with the new text.

Sampled drafts use the token-level intersection (Algorithm 4): the drafter samples only tokens the target's
vocabulary has too, from its distribution renormalised over them; each such token is one target token, and q
mapped onto the target's ids is the exact distribution the draft came from, so speculative sampling stays
exact. What this costs is the drafter's mass outside the intersection (docs/results/cross-vocab.md).
"""

from __future__ import annotations

from typing import Any

import torch

from speculant.config import SamplingConfig
from speculant.drafters.base import Draft, Drafter
from speculant.drafters.model import ModelDrafter
from speculant.drafters.vocab import GrowingEncoding, same_vocabulary, vocab_pair
from speculant.models.base import CausalLM, DraftCache
from speculant.sampling import logits_to_probs


class CrossVocabDrafter(Drafter):
    """Drafts target tokens with a model of another vocabulary: string-level when greedy, on the shared tokens
    when sampling (see the module docstring). A context holding an id that spells nothing (a padded row), or
    ending inside a multi-byte character, gets an empty draft."""

    def __init__(self, model: CausalLM | DraftCache, target: CausalLM, sampling: SamplingConfig,
                 generator: torch.Generator | None, draft_confidence: float = 0.0, pairs: dict | None = None):
        """`model` may be a DraftCache on it (a `Session`'s), which its drafts go on from: the next turn of a
        conversation catches up only on its new text. `pairs`: where the two vocabularies' table is kept between
        drafters (a `Session`'s), else built anew."""
        base = model.model if isinstance(model, DraftCache) else model
        self.pair = vocab_pair(target, base, pairs if pairs is not None else {})
        self.greedy = sampling.greedy
        allowed = self.pair.spelled if self.greedy else self.pair.shared
        self.drafter = ModelDrafter(model, sampling, generator, draft_confidence=draft_confidence, allowed=allowed)
        self.cache = self.drafter.cache
        self.model = self.drafter.model  # metered: the cascade and the stats read its usage
        self.name = base.name
        self.width = target.vocab_size
        self._ahead: list[int] = []  # greedy: a context and the safe draft tokens that followed it last time
        self._encoding = GrowingEncoding(self.pair)  # the context's text in the drafter's tokens, kept as it grows
        self._full: int | None = None  # the shortest context after which its own tokens left it no position

    def propose(self, context: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        ahead = self._ahead
        if self.greedy and len(ahead) >= len(context) + k and ahead[: len(context)] == context:
            return Draft(ahead[len(context): len(context) + k])  # drafted last time, not yet used
        text = self.pair.text(context)
        if text is None:
            return Draft([])
        own = self._encoding.encode(text)
        if self.drafter.room(len(own)) <= 0:  # (its own tokens fill its positions)
            self._full = len(context) if self._full is None else min(self._full, len(context))
            return Draft([])
        return self._greedy(context, own, k) if self.greedy else self._sampled(own, k)

    def most(self, context: list[int]) -> int | None:
        """0 from the context length at which its own tokens filled its positions (a context, growing, holds at
        least as many); else None: how many target tokens its own tokens make is known once drafted (and the
        context's text, encoded, costs what a draft's start does)."""
        return 0 if self._full is not None and len(context) >= self._full else None

    def _heal(self, own: list[int]) -> tuple[list[int], list[int], int]:
        """Token healing: the context without its last drafter token, and the drafter's best token that starts
        with that token's bytes (its tokenization of the context may end where its own drafts would not)."""
        last = own[-1]
        if len(own) < 2 or last in self.pair.drafter_specials:
            return own, [], 0
        spelled = self.pair.drafter_bytes[last]
        candidates = self.pair.starting_with(spelled)
        logits = self.drafter.score(own[:-1], [])[0]
        best = candidates[int(logits[candidates].argmax())]
        return own[:-1], [best], len(spelled)

    def _greedy(self, context: list[int], own: list[int], k: int) -> Draft:
        """Drafter tokens until their text holds k target tokens that no further text can change (or the
        drafter stops); all safe tokens are kept for the next call."""
        before = self.drafter.model.usage
        own, tokens, skip = self._heal(own)
        safe: list[int] = []
        while len(tokens) < 2 * k + 4:  # drafter tokens are often shorter than the target's
            want = max(1, k - len(safe))
            draft = self.drafter.propose(own + tokens, want)
            tokens += draft.tokens
            text, end, ended = self.pair.draft_text(tokens, skip)
            safe = self.pair.safe_target_ids(text, ended) + ([end] if end is not None else [])
            if ended or len(safe) >= k or len(draft.tokens) < want:
                break
        self._ahead = context + safe
        return Draft(safe[:k], None, {self.name: self.drafter.model.usage - before})

    def _sampled(self, own: list[int], k: int) -> Draft:
        """k shared tokens sampled from the drafter's renormalised distribution, as target ids with q on the
        target's ids [n, target width]."""
        draft = self.drafter.propose(own, k)
        if not draft.tokens:
            return draft
        return Draft([int(self.pair.to_target[t]) for t in draft.tokens], self.pair.on_target(draft.probs, self.width),
                     draft.usage)

    def distribution(self, context: list[int]) -> tuple[torch.Tensor, float] | None:
        """What a sampled draft's first token after `context` is drawn from, on the target's ids [target width],
        and the drafter's own probability outside the shared tokens (what the restriction costs); None where
        it cannot draft."""
        text = self.pair.text(context)
        if text is None or self.drafter.room(len(own := self._encoding.encode(text))) <= 0:
            return None
        logits = self.drafter.score(own, [])[0]
        outside = 1 - float(logits_to_probs(logits, self.drafter.sampling)[self.pair.shared.to(logits.device)].sum())
        q = logits_to_probs(self.drafter.restricted(logits), self.drafter.sampling)
        return self.pair.on_target(q[None], self.width)[0], outside

    def observe(self, n_accepted: int) -> None:
        """Nothing to learn: the next proposal re-tokenizes the context's new text itself."""

    def lag(self, context: list[int]) -> int:
        """Tokens of its own for the text of `context` that the drafter's cache lacks: what its next proposal runs
        before drafting."""
        return self.cache.lag(self.own_ids(context))

    def own_ids(self, context: list[int]) -> list[int]:
        """The drafter's own tokens for the text of `context` (empty where it spells nothing): what to time or
        prefill the drafter model on."""
        text = self.pair.text(context)
        return self._encoding.encode(text) if text else []

    def tokens_per_target_token(self, ids: list[int]) -> float:
        """How many of its own tokens the drafter spends on one target token of the text of `ids` (at least 1):
        what a drafted target token costs in drafter forwards."""
        return max(1.0, len(self.own_ids(ids)) / len(ids))


def model_drafter(model: CausalLM | DraftCache, target: CausalLM, sampling: SamplingConfig,
                  generator: torch.Generator | None, keep_probs: bool = False, draft_confidence: float = 0.0,
                  pairs: dict | None = None) -> Any:
    """What drafts for `target` with `model` (or a DraftCache on it, whose cached ids the drafter goes on from): a
    ModelDrafter when their ids mean the same tokens (with its rows fitted to the target's logits width where the
    two differ), else a CrossVocabDrafter."""
    base = model.model if isinstance(model, DraftCache) else model
    if not same_vocabulary(target, base):
        return CrossVocabDrafter(model, target, sampling, generator, draft_confidence, pairs)
    guide = getattr(target, "draft_guide", None)  # structured output: drafts follow the target's grammar
    if base.vocab_size == target.vocab_size:
        return ModelDrafter(model, sampling, generator, keep_probs, draft_confidence, guide=guide)
    allowed = torch.arange(base.vocab_size) < target.vocab_size  # the drafter's padded rows the target lacks
    return ModelDrafter(model, sampling, generator, keep_probs, draft_confidence, allowed, target.vocab_size, guide)
