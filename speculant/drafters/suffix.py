"""Suffix decoding (Oliaro et al., "SuffixDecoding: A Model-Free Approach to Speeding Up Large Language Model
Inference", 2024): drafts continue the longest suffix of the context that occurred before, in the context itself
or in an earlier generation of the same `Session`, along the continuation seen most often after it.

Where Max-Gram follows the latest occurrence of its match, this drafter counts every occurrence of the longest
match (section 3: a suffix tree's node frequencies) and extends the draft one token at a time with the most
frequent next token among the occurrences that agree so far; a token's empirical probability is the share of
those occurrences that continue with it, and the draft stops where the path's probability (their product, the
paper's score) falls below `min_prob`. An occurrence in the context that runs into the context's end goes on
with the tokens drafted after it (an overlapping copy, as Max-Gram's), so a repeated run drafts k tokens, not one
period. Earlier generations (prompt and output) live in the session's bounded `History`; a generation never drafts
from earlier ones that had the same prompt (a benchmark's repeats, or a method run after another on the same
prompt, would otherwise read their own answer). A proposal costs no model forward: well under a millisecond.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speculant.drafters.base import Draft, Drafter
from speculant.drafters.maxgram import MIN_MATCH, ContextArray, suffix_ends
from speculant.drafters.registry import register_drafter

MIN_PROB = 0.1  # a draft's path probability below this ends it
CAPACITY = 1 << 18  # tokens of earlier generations kept (the oldest go first): a search reads them all
GAP = -1  # separates generations in the history
Source = tuple[np.ndarray, np.ndarray, bool]  # a corpus, where the match ends in it, whether it is the context


def prompt_key(prompt_ids: list[int]) -> bytes:
    return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=8).digest()


@dataclass
class History:
    """Earlier generations of one target, prompt and output, in one bounded token array (`GAP` between them),
    with each one's prompt key: what suffix drafts may follow beyond the context itself."""

    capacity: int = CAPACITY
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    keys: list[tuple[int, bytes]] = field(default_factory=list)  # (start in `tokens`, prompt key), in order

    def add(self, prompt_ids: list[int], output: list[int]) -> None:
        sequence = np.asarray([*prompt_ids, *output, GAP], dtype=np.int64)[-self.capacity:]
        keep = max(0, self.capacity - len(sequence))
        drop = max(0, len(self.tokens) - keep)
        ends = [start for start, _ in self.keys[1:]] + [len(self.tokens)]
        self.tokens = np.concatenate([self.tokens[drop:], sequence])
        # a generation whose first tokens were dropped keeps its key while any of it is left (`without` blanks it)
        self.keys = [(max(start - drop, 0), key) for (start, key), end in zip(self.keys, ends) if end > drop]
        self.keys.append((len(self.tokens) - len(sequence), prompt_key(prompt_ids)))

    def without(self, key: bytes | None) -> np.ndarray:
        """The history with the generations of prompt `key` blanked out."""
        starts = [start for start, k in self.keys if k == key]
        if not starts:
            return self.tokens
        tokens = self.tokens.copy()
        bounds = [start for start, _ in self.keys] + [len(tokens)]
        for start in starts:
            tokens[start:bounds[bounds.index(start) + 1]] = GAP
        return tokens


class SuffixDrafter(Drafter):
    """Deterministic drafter (q is one-hot, `Draft.probs` is None) over the context and a `History`. `prompt`
    names the generation it drafts for (`begin`): earlier generations of the same prompt are not read."""

    name = "suffix"  # as drafter specs spell it

    def __init__(self, history: History, min_match: int = MIN_MATCH, min_prob: float = MIN_PROB,
                 prompt: list[int] | None = None):
        self.history, self.min_match, self.min_prob = history, min_match, min_prob
        self._past = history.without(prompt_key(prompt)) if prompt is not None else None  # None: all of it, now
        self._found: tuple[list[int] | None, int, list[Source], int] = (None, 0, [], 0)
        self._array = ContextArray()

    def begin(self, prompt_ids: list[int]) -> SuffixDrafter:
        """This drafter for one generation of `prompt_ids`: the history as it is now, without that prompt's."""
        return SuffixDrafter(self.history, self.min_match, self.min_prob, list(prompt_ids))

    def end(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Keep the generation, finished or stopped, in the history."""
        self.history.add(prompt_ids, output_ids)

    def _occurrences(self, context: list[int]) -> tuple[list[Source], int]:
        """[(corpus, ends, whether it is the context)] of the longest match of the context's suffix, in the context
        and in the history."""
        if self._found[0] is context and self._found[1] == len(context):  # auto asks for the length, then the draft
            return self._found[2], self._found[3]
        query = self._array(context)
        past = self._past if self._past is not None else self.history.tokens
        found = [(corpus, *suffix_ends(corpus, query), corpus is query) for corpus in (query, past)]
        length = max(n for _, _, n, _ in found)
        sources = [(corpus, ends, own) for corpus, ends, n, own in found if n == length >= self.min_match]
        self._found = (context, len(context), sources, length if sources else 0)
        return sources, self._found[3]

    def match_length(self, context: list[int]) -> int:
        """The length of the suffix match a proposal after `context` would follow (0: none)."""
        return self._occurrences(context)[1]

    def propose(self, context: list[int], k: int) -> Draft:
        sources, _ = self._occurrences(context)
        draft: list[int] = []
        probability = 1.0
        while len(draft) < k and sources:
            step = len(draft) + 1
            nexts = []  # (corpus, ends, own, the token `step` after each end) where one follows
            for corpus, ends, own in sources:
                # the context goes on with the draft: an occurrence that runs into its end copies what it drafted
                read = np.concatenate([corpus, np.asarray(draft, dtype=np.int64)]) if own else corpus
                ends = ends[ends + step < len(read)]
                follow = read[ends + step]
                nexts.append((corpus, ends[follow != GAP], own, follow[follow != GAP]))
            seen = np.concatenate([follow for *_, follow in nexts])
            if not seen.size:
                break
            values, counts = np.unique(seen, return_counts=True)
            best = counts.max()
            # Ties go to the token of the latest occurrence in the context (Max-Gram's choice), then the history.
            tied = set(values[counts == best].tolist())
            token = next((int(t) for *_, follow in nexts for t in follow[::-1] if int(t) in tied))
            probability *= best / seen.size
            if probability < self.min_prob:
                break
            draft.append(token)
            sources = [(corpus, ends[follow == token], own) for corpus, ends, own, follow in nexts
                       if (follow == token).any()]
        return Draft(draft, None, {})


@register_drafter("suffix", with_session=True)
def suffix(target: Any, session: Any) -> SuffixDrafter:
    """Suffix decoding over the context and the session's earlier generations."""
    return SuffixDrafter(session.history)
