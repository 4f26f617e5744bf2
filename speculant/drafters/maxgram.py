"""Max-Gram drafting with a bigram fallback (Chen et al., "Cascade Speculative Drafting", section 3.3).

The drafter finds the longest suffix of the context that occurred earlier in the context and proposes
the tokens that followed its most recent earlier occurrence (prompt lookup). When no suffix matches,
it proposes the most likely next token under a bigram table built from a corpus with the target's
tokenizer. A proposal costs no model forward: tens of microseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from speculant.cache import cache_root, cached_array
from speculant.corpus import corpus_key, default_corpus, tokenize_corpus, tokenizer_fingerprint
from speculant.drafters.base import Draft, Drafter
from speculant.drafters.registry import register_drafter

MAX_MATCH = 64  # longer suffixes add nothing but cost
MIN_MATCH = 2  # a single repeated token predicts little (few of such drafts were accepted on HumanEval)


def suffix_ends(corpus: np.ndarray, query: np.ndarray, limit: int = MAX_MATCH) -> tuple[np.ndarray, int]:
    """(ends, length): every index of `corpus` where the longest suffix of `query` found in `corpus` (at most
    `limit` tokens) ends, ascending, excluding the corpus's last index (its continuation is unknown); length 0
    means no match. With corpus = query, the earlier occurrences of the context's own suffix."""
    if not len(query) or len(corpus) < 2:
        return np.empty(0, dtype=np.int64), 0
    ends = np.flatnonzero(corpus[:-1] == query[-1])  # candidates matching the last token
    length = 1 if ends.size else 0
    while ends.size and length < min(limit, len(query)):
        reach = ends - length
        valid = reach >= 0
        extended = ends[valid][corpus[reach[valid]] == query[-1 - length]]
        if extended.size == 0:
            break
        ends, length = extended, length + 1
    return ends, length


class ContextArray:
    """A drafter's contexts as int64 arrays, each converted only after the longest prefix it shares with the last one.
    A generation's contexts extend one another (a step's committed tokens; a cascade's draft on top, replaced at the
    next step), and converting a whole list is most of a lookup's time at thousands of tokens; comparing it with the
    last one is a fifth of that. The last context is kept as a copy (a caller may change its list in place) and read
    once per call, with its array, as one pair."""

    TAIL = 64  # tokens at the end of the last context that the next one may replace (a draft) without a full conversion

    def __init__(self) -> None:
        self._last: tuple[list[int], np.ndarray] = ([], np.empty(0, dtype=np.int64))

    def __call__(self, context: list[int]) -> np.ndarray:
        context = context if type(context) is list else list(context)  # (compared as lists)
        tokens, array = self._last
        n, common = len(tokens), min(len(tokens), len(context))
        if context[:common] == tokens[:common]:
            shared = common
        elif (cut := common - self.TAIL) > 0 and context[:cut] == tokens[:cut]:
            shared = next(i for i in range(cut, common) if context[i] != tokens[i])
        else:
            shared = 0
        if shared == n == len(context):
            return array
        array = np.concatenate([array[:shared], np.asarray(context[shared:], dtype=np.int64)])
        self._last = (list(context), array)
        return array


def longest_suffix_match(tokens: np.ndarray) -> tuple[int, int]:
    """(end, length) of the longest suffix of `tokens` that also ends earlier, at the latest such end.

    `end` is the index of the earlier occurrence's last token; length 0 means no match.
    """
    ends, length = suffix_ends(tokens, tokens)
    return (int(ends[-1]), length) if length else (-1, 0)


class MaxGramDrafter(Drafter):
    """Deterministic drafter (q is one-hot, `Draft.probs` is None) over the context itself. A suffix
    match shorter than `min_match` tokens counts as none."""

    name = "maxgram"  # as drafter specs spell it

    def __init__(self, bigram: np.ndarray | None = None, min_match: int = MIN_MATCH):
        self.bigram = bigram  # bigram[a] = most likely token after a, or -1
        self.min_match = min_match
        self.array = ContextArray()

    def begin(self, prompt_ids: list[int]) -> MaxGramDrafter:
        """A drafter of its own for each generation (its contexts' array), on the same bigram table."""
        return MaxGramDrafter(self.bigram, self.min_match)

    def match_length(self, context: list[int]) -> int:
        """The length of the suffix match a proposal after `context` would follow (0: none)."""
        length = longest_suffix_match(self.array(context))[1]
        return length if length >= self.min_match else 0

    def propose(self, context: list[int], k: int) -> Draft:
        """Up to k tokens after `context`: the match's continuation, else the bigram's; none after an empty
        context."""
        if not len(context):
            return Draft([])
        tokens = self.array(context)
        draft: list[int] = []
        while len(draft) < k:
            end, length = longest_suffix_match(tokens)
            if length >= self.min_match:
                # what followed the match, read as an overlapping copy (LZ77's): where it runs into the
                # context's end it goes on with the tokens it just copied, so one lookup drafts the rest
                draft += np.resize(tokens[end + 1 :], k - len(draft)).tolist()
                break
            if self.bigram is None or not 0 <= tokens[-1] < len(self.bigram) or self.bigram[tokens[-1]] < 0:
                break
            follow = self.bigram[tokens[-1:]]  # no match: the bigram's token, and a lookup after it
            draft.append(int(follow[0]))
            tokens = np.concatenate([tokens, follow])
        return Draft(draft, None, {})


@register_drafter("maxgram")
def maxgram(target: Any) -> MaxGramDrafter:
    """Prompt lookup with the bigram table of the target's tokenizer as its fallback."""
    tokenizer = target.tokenizer
    return MaxGramDrafter(load_bigram(tokenizer, target.vocab_size) if tokenizer is not None else None)


def bigram_table(sequences: Iterable[list[int]], vocab_size: int) -> np.ndarray:
    """For each token, the token that most often follows it in `sequences` (-1 if never seen)."""
    pairs = [np.stack([s[:-1], s[1:]], axis=1) for s in map(np.asarray, sequences) if len(s) > 1]
    table = np.full(vocab_size, -1, dtype=np.int64)
    if not pairs:
        return table
    flat = np.concatenate(pairs)
    keys, counts = np.unique(flat[:, 0] * vocab_size + flat[:, 1], return_counts=True)
    first, second = keys // vocab_size, keys % vocab_size
    order = np.lexsort((-counts, first))  # by first token, most frequent follower first
    first, second = first[order], second[order]
    leaders = np.ones(len(first), dtype=bool)
    leaders[1:] = first[1:] != first[:-1]
    table[first[leaders]] = second[leaders]
    return table


def load_bigram(tokenizer: Any, vocab_size: int, corpus: list[Path] | None = None,
                cache_dir: Path | None = None) -> np.ndarray:
    """The bigram table for `tokenizer` over `corpus` (default: the stdlib), cached per tokenizer and corpus."""
    files = corpus if corpus is not None else default_corpus()
    path = (cache_dir or cache_root() / "bigram") / f"{tokenizer_fingerprint(tokenizer)}-{corpus_key(files)}.npy"
    return cached_array(path, lambda: bigram_table(tokenize_corpus(tokenizer, files), vocab_size),
                        fits=lambda table: table.shape == (vocab_size,))
