"""The Drafter protocol: every draft source (model, n-gram, suffix, cascade, tree, a user's) proposes through it.

A generation runs a drafter's lifecycle as llama.cpp's `common_speculative` and vLLM's proposers do: `begin` once
per prompt (the drafter for this generation: itself, or a copy holding per-generation state), then per step
`propose(context, k)` and `observe(n_accepted)`, and `end` once the generation stops (finished or not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from speculant.config import as_integer
from speculant.errors import ConfigError, DraftFault
from speculant.models.wrappers.metered import Usage

if TYPE_CHECKING:
    from speculant.trees.tree import TokenTree


@dataclass
class Draft:
    """New tokens proposed after a context, with the drafter's distribution for each, or a token tree.

    `probs` [len(tokens), vocab] is q, or None for a deterministic drafter (q is then one-hot).
    `tree`: a token tree rooted at the context's last token (`tokens` is then empty) with `path_probs`, each
    node's product of draft probabilities from the root (the root's: 1).
    `usage` holds the model forwards spent on this draft (and their time), per drafter name.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    usage: dict[str, Usage] = field(default_factory=dict)
    tree: TokenTree | None = None
    path_probs: list[float] | None = None


class Drafter:
    """What proposes drafts. Subclass it and implement `propose`; the rest has defaults. A drafter that runs no
    model forwards and can say, before drafting, how much of the context its draft follows (a lookup, as
    Max-Gram's suffix match) also implements `match_length`: `auto` then judges its draft by the acceptance
    it observed after matches of that length, and tries it first."""

    name: str = "drafter"

    def begin(self, prompt_ids: list[int]) -> Drafter:
        """The drafter for one generation of `prompt_ids`: itself, unless it keeps per-generation state."""
        return self

    def propose(self, context: list[int], k: int) -> Draft:
        """Propose up to k tokens to follow `context` (prompt plus everything committed so far); k >= 1."""
        raise ConfigError(f"drafter '{self.name}' ({type(self).__name__}) implements no propose(context, k)")

    def observe(self, n_accepted: int) -> None:
        """Learn how many of the last proposal's tokens the target accepted."""

    def lag(self, context: list[int]) -> int:
        """Tokens of `context` its model's cache lacks: what its next draft runs first (0: it keeps no cache)."""
        return 0

    def most(self, context: list[int]) -> int | None:
        """The most tokens a draft after `context` can hold (0: none, its model's positions are full); None where it
        knows no bound. `auto` weighs it at draft lengths up to this, and not at all at 0."""
        return None

    def own_ids(self, context: list[int]) -> list[int]:
        """The ids its model runs for `context`: the target's own, but for a drafter of another tokenizer."""
        return context

    def tokens_per_target_token(self, ids: list[int]) -> float:
        """Its forwards per drafted target token of the text of `ids`: one, but for a drafter of another tokenizer."""
        return 1.0

    def end(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """The generation of `prompt_ids` stopped after `output_ids`."""

    match_length = None  # or a method: context -> the length of the match its next draft follows (0: none)


Q_SUM_TOLERANCE = 1e-2  # a user's q row may sum this far from 1 (rounded in half precision over a large vocabulary)


class Checked(Drafter):
    """A user's drafter (one passed in, or registered from outside speculant), its drafts checked before anything reads
    them: a Draft whose tokens are ids of the target's vocabulary, at most k of them, and whose q is a float tensor
    holding values (not on the meta device) with a row per token as wide as the target's logits, each row a distribution
    giving its drafted token a probability above 0; else a DraftFault (a ConfigError) naming the drafter (a list, an id
    out of range or a q of another width had failed deep in verification, an id past the vocabulary read another token's
    row, a q of 0 for its own token made p/q infinite, and rows that are not distributions voided the output's).
    Everything else is the drafter's own."""

    def __init__(self, inner: Drafter, vocab_size: int, name: str | None = None):
        self.inner, self.vocab_size = inner, vocab_size
        self.name = name or getattr(inner, "name", type(inner).__name__)
        if not isinstance(self.name, str) or not self.name:  # (stats and auto's estimates are kept by name)
            raise ConfigError(f"a drafter's name is a non-empty text, got {self.name!r} ({type(inner).__name__})")
        if inner.match_length is not None:
            self.match_length = self._match_length

    def most(self, context: list[int]) -> int | None:
        """The inner drafter's `most`: None, or a whole number >= 0."""
        most = self.inner.most(context)
        return None if most is None else self._count("most", most)

    def _match_length(self, context: list[int]) -> int:
        """The inner drafter's `match_length`, a whole number >= 0 (auto buckets its acceptance by it)."""
        return self._count("match_length", self.inner.match_length(context))

    def _count(self, what: str, n: object) -> int:
        """`n`, what the inner drafter's `what` returned, as a whole number >= 0; else a DraftFault naming both."""
        if as_integer(n) is None or n < 0:
            raise DraftFault(f"drafter '{self.name}': {what} returned {n!r}, not a whole number >= 0")
        return as_integer(n)

    def begin(self, prompt_ids: list[int]) -> Drafter:
        began = self.inner.begin(prompt_ids)
        if not isinstance(began, Drafter):
            raise DraftFault(f"drafter '{self.name}': begin returned {type(began).__name__}, not a speculant.Drafter "
                             "(itself, or a copy for this generation)")
        return self if began is self.inner else Checked(began, self.vocab_size, self.name)  # (a registered name too)

    def propose(self, context: list[int], k: int) -> Draft:
        draft = self.inner.propose(context, k)
        if not isinstance(draft, Draft):
            raise DraftFault(f"drafter '{self.name}': propose returned {type(draft).__name__}, not a speculant.Draft")
        if not (isinstance(draft.usage, dict) and all(isinstance(u, Usage) for u in draft.usage.values())):
            raise DraftFault(f"drafter '{self.name}': its draft's usage is {draft.usage!r}, not a dict of "
                             "speculant Usage by drafter name (leave it empty where it runs no model)")
        if draft.tree is not None:
            from speculant.trees.tree import TokenTree

            if not isinstance(draft.tree, TokenTree) or draft.tokens:  # (tokens read as a chain had dropped the tree)
                raise DraftFault(f"drafter '{self.name}': its draft holds a tree of {type(draft.tree).__name__} and "
                                 f"tokens {draft.tokens!r}: a draft is a TokenTree (tokens empty) or tokens")
        tokens = draft.tree.tokens[1:] if draft.tree is not None else draft.tokens
        try:
            ids = [as_integer(t) for t in tokens]
        except TypeError:
            ids = [None]
        if any(i is None or not 0 <= i < self.vocab_size for i in ids):
            raise DraftFault(f"drafter '{self.name}': its draft holds {tokens!r}, not token ids in "
                             f"[0, {self.vocab_size})")
        if draft.tree is not None:
            if as_integer(draft.tree.tokens[0]) != context[-1]:
                raise DraftFault(f"drafter '{self.name}': its tree's root is {draft.tree.tokens[0]!r}, not the "
                                 f"context's last token {context[-1]}")
            if max(draft.tree.depths) > k:
                raise DraftFault(f"drafter '{self.name}': a tree {max(draft.tree.depths)} deep proposed where {k} "
                                 "tokens were asked for")
            return draft
        if len(ids) > k:
            raise DraftFault(f"drafter '{self.name}': {len(ids)} tokens proposed where {k} were asked for")
        if draft.probs is not None:
            draft.probs = self._check_q(ids, draft.probs)
        draft.tokens = ids  # (NumPy's integers committed as Python's)
        return draft

    def _check_q(self, ids: list[int], q: torch.Tensor) -> torch.Tensor:
        """q [len(ids), vocab]: a float tensor, a row per drafted token, as wide as the target's logits, each row a
        distribution (what verification's p/q takes it for: another voids the output's) above 0 at its own token
        (verification divides by it). Returned with each row divided by its sum: a row rounded off 1 (within
        Q_SUM_TOLERANCE) would bias the residual max(p - q, 0) that verification samples from (Leviathan et al.
        2023, Algorithm 1), where the distribution the drafter drew from (`torch.multinomial` normalises) sums to
        1."""
        if not isinstance(q, torch.Tensor) or not q.is_floating_point():
            raise DraftFault(f"drafter '{self.name}': its q is {type(q).__name__}"
                             f"{f' of {q.dtype}' if isinstance(q, torch.Tensor) else ''}, not a float tensor")
        if q.is_meta:  # (no values to check or sample from: torch's own error came from `.item()`)
            raise DraftFault(f"drafter '{self.name}': its q is on the meta device, which holds no values")
        if tuple(q.shape) != (len(ids), self.vocab_size):
            raise DraftFault(f"drafter '{self.name}': its q is {tuple(q.shape)}, not one row per token of the "
                             f"target's {self.vocab_size} logits")
        if not ids:  # (an empty draft's rows: none to check)
            return q
        sums, least = q.sum(-1, dtype=torch.float32), q.min()
        if not bool((least >= 0) & ((sums - 1).abs() <= Q_SUM_TOLERANCE).all()):  # (one pass each, one sync)
            raise DraftFault(f"drafter '{self.name}': its q's rows are not distributions (sums "
                             f"{[round(float(x), 4) for x in sums]}, least entry {float(least)})")
        drawn = q.gather(-1, torch.tensor(ids, dtype=torch.long, device=q.device)[:, None])[:, 0]  # q(x_i)
        if not bool((drawn > 0).all()):
            i = int((~(drawn > 0)).nonzero()[0])
            raise DraftFault(f"drafter '{self.name}': its q gives its own token {ids[i]} (draft position {i}) "
                             f"probability {float(drawn[i])}, where it must be above 0 (it drew that token)")
        return q / sums.to(q.dtype)[:, None]

    def observe(self, n_accepted: int) -> None:
        self.inner.observe(n_accepted)

    def lag(self, context: list[int]) -> int:
        """The inner drafter's `lag`, a whole number >= 0 (auto weighs its catch-up by it)."""
        return self._count("lag", self.inner.lag(context))

    def own_ids(self, context: list[int]) -> list[int]:
        return self.inner.own_ids(context)

    def tokens_per_target_token(self, ids: list[int]) -> float:
        return self.inner.tokens_per_target_token(ids)

    def end(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.inner.end(prompt_ids, output_ids)

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # (not yet set: a copy being made)
            raise AttributeError(name)
        return getattr(self.inner, name)  # (what else a user's drafter offers)
