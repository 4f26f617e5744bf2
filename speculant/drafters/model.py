"""A small language model as drafter, with its own KV cache kept in step with the context."""

from __future__ import annotations

from collections.abc import Callable

import torch

from speculant.config import SamplingConfig
from speculant.drafters.base import Draft, Drafter
from speculant.models.base import CausalLM, DraftCache
from speculant.models.wrappers.metered import metered
from speculant.sampling import logits_to_probs, next_token, sample


class ModelDrafter(Drafter):
    """Drafts k tokens autoregressively with a CausalLM (Leviathan et al. 2023, the approximation M_q).

    Its DraftCache remembers which tokens the cache holds; on each proposal it rolls back to the longest
    prefix shared with the new context and runs only the tokens it has not seen, so rejected drafts
    cost no recomputation beyond the corrected suffix. `model` may be another drafter's DraftCache. `score` runs a whole draft through the model
    in one forward: how a cascade level reviews the draft of the level below.

    Greedy drafts carry no distribution unless `keep_probs` (a lenient review needs q(x)).

    With `draft_confidence` c > 0 a draft ends early, after the first token the drafter itself gives a
    probability below c: the forwards that would follow a likely rejection are skipped (the dynamic draft
    length of HF assisted generation's confidence threshold). The stopping rule looks only at the draft,
    so verification stays lossless.

    `allowed` [vocab] (bool) restricts drafting to some ids: q is the drafter's distribution renormalised over
    them (the token-level intersection of another vocabulary; a logits row wider than the target's); `guide`
    (the target's `draft_guide` under structured output) restricts each row to what a grammar allows after it. `width`
    pads (zeros) or cuts each row of q to the target's logits width.
    """

    def __init__(self, model: CausalLM | DraftCache, sampling: SamplingConfig, generator: torch.Generator | None,
                 keep_probs: bool = False, draft_confidence: float = 0.0, allowed: torch.Tensor | None = None,
                 width: int | None = None, guide: Callable[[list[int]], torch.Tensor | None] | None = None):
        self.cache = model if isinstance(model, DraftCache) else DraftCache(metered(model))
        self.model = self.cache.model
        self.draft_confidence = draft_confidence
        self.name = self.model.name
        self.sampling = sampling
        self.generator = generator
        self.keep_probs = keep_probs or not sampling.greedy
        self.banned = ~allowed.to(self.model.device) if allowed is not None else None
        self.width = width
        self.guide = guide

    def propose(self, context: list[int], k: int) -> Draft:
        """Up to k tokens; a draft ends at an end-of-sequence token and within the drafter's positions: m tokens
        after L take L + m - 1 of them (the last token drafted is never run), so one more than its `room` (`most`)."""
        k = min(k, self.most(context))
        if k <= 0:
            return Draft([], None)
        before = self.model.usage
        logits = self.score(context, [])[0]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        ran = 0  # drafted tokens the model's cache holds (the last one drafted is never run, unless the grammar ends
        for i in range(k):  # the draft after it)
            logits = self.restricted(logits)
            if self.guide is not None and (logits := guided(self.guide, logits, context + tokens)) is None:
                break  # the grammar allows nothing after this prefix: the draft ends
            q = logits_to_probs(logits, self.sampling) if not self.sampling.greedy else None
            tokens.append(next_token(logits, self.sampling, None) if q is None else sample(q, self.generator))
            if self.keep_probs or self.draft_confidence > 0:
                probs.append(q if q is not None else torch.softmax(logits, -1))
            if i == k - 1 or tokens[-1] in self.model.eos_token_ids or (
                    probs and probs[-1][tokens[-1]] < self.draft_confidence):
                break
            logits = self.model.forward(tokens[-1:])[-1]
            ran = len(tokens)
        self.cache.ids = context + tokens[:ran]
        kept = torch.stack(probs) if self.keep_probs and probs else None  # a guided draft may end empty
        if kept is not None and self.width is not None and self.width != kept.shape[-1]:
            kept = torch.nn.functional.pad(kept, (0, self.width - kept.shape[-1]))  # negative: cut
        return Draft(tokens, kept, {self.name: self.model.usage - before})

    def room(self, length: int) -> int:
        """The drafter's positions left after `length` tokens (1 << 30 where its model sets none): the most tokens a
        review runs on top of them (a draft may hold one more, its last never run)."""
        limit = self.model.max_positions
        return 1 << 30 if limit is None else limit - length

    def most(self, context: list[int]) -> int:
        """One more than its `room` after `context` (0 where that is full, or the context holds an id it has no row
        for): what `propose` drafts at most."""
        return max(self.room(len(context)) + 1, 0) if self.readable(context) == len(context) else 0

    def own_ids(self, context: list[int]) -> list[int]:
        """The ids its model can run for `context`: up to the first it has no row for (`readable`)."""
        return context[: self.readable(context)]

    def readable(self, ids: list[int]) -> int:
        """How many leading `ids` the drafter has rows for: all, unless it has fewer than the target (an id past
        them, which a client's prompt or logit_bias may put in the context, has no embedding to run; the drafter
        drafts nothing from there)."""
        rows = self.model.vocab_size
        if self.width is None or self.width <= rows or max(ids, default=0) < rows:
            return len(ids)
        return next(i for i, token in enumerate(ids) if token >= rows)

    def restricted(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [..., vocab] with the ids it may not draft at -inf."""
        return logits if self.banned is None else logits.masked_fill(self.banned, float("-inf"))

    def as_target_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [..., vocab] restricted and fitted to the target's logits width (padded at -inf, or cut): how a
        review's rows are read beside the target's."""
        logits = self.restricted(logits)
        if self.width is None or self.width == logits.shape[-1]:
            return logits
        return torch.nn.functional.pad(logits, (0, self.width - logits.shape[-1]), value=float("-inf"))

    def guided_rows(self, logits: torch.Tensor, context: list[int], tokens: list[int]) -> torch.Tensor:
        """`score`'s rows (after `context`, then after each of `tokens`) with what the guide forbids after each prefix
        at -inf, as the drafter's own tokens would be drawn (a row after which the grammar allows nothing stays as
        it is: the target rejects what follows)."""
        if self.guide is None:
            return logits
        return torch.stack([row if (kept := guided(self.guide, row, context + tokens[:i])) is None else kept
                            for i, row in enumerate(logits)])

    def score(self, context: list[int], draft: list[int]) -> torch.Tensor:
        """Logits after context[-1] and after each draft token, [1 + len(draft), vocab], in one forward."""
        return self.cache.run(context, draft)

    def lag(self, context: list[int]) -> int:
        """Tokens of `context` the drafter's cache lacks: what its next proposal runs before drafting."""
        return self.cache.lag(context)

    def observe(self, n_accepted: int) -> None:
        """Nothing to do: the next proposal re-synchronises the cache from the context itself."""


def guided(guide: Callable[[list[int]], torch.Tensor | None], logits: torch.Tensor, prefix: list[int]
           ) -> torch.Tensor | None:
    """`logits` (a row) with what `guide` (the target's `draft_guide` under structured output) forbids after `prefix`
    at -inf: a draft token the target's grammar would reject at once is not worth its forwards. None where the
    grammar allows nothing after `prefix` that the drafter gives a chance (its row all -inf: no distribution, and a
    NaN q would pass any token); `logits` as they are where `prefix` has left the grammar."""
    allowed = guide(prefix)
    if allowed is None:  # the context has left the grammar: draft as usual, the target rejects
        return logits
    n = min(len(allowed), logits.shape[-1])
    row = torch.full_like(logits, float("-inf"))
    row[..., :n] = logits[..., :n].masked_fill(~allowed[:n].to(logits.device), float("-inf"))
    return row if bool(torch.isfinite(row).any()) else None
