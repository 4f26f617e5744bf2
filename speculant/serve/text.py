"""Token ids to text as it becomes final, with stop strings matched across token boundaries."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any


PENDING = 4  # ids the decoding window keeps back while the text ends in U+FFFD (a character's bytes: at most four)


class TextStream:
    """Push token ids, get text increments. Holds back an incomplete character (the tokenizer decodes it
    as U+FFFD until its last byte arrives) and any tail that could begin a stop string; at a stop string
    it sets `stopped` and the text ends before it (as in OpenAI's API). Stop strings end an answer, never a call:
    none is matched from `calls` (a tool call's opening tag) on."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), calls: str | None = None):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.calls = calls
        self.call_at: int | None = None  # where in `text` a call begins (None: not yet)
        self.looked = 0  # the final text before it has no call tag
        self.ids: list[int] = []  # every id pushed
        self.kept: list[int] = []  # the ids decoding keeps (not the special ones it skips)
        self.at: list[int] = []  # where each kept id is among `ids`
        self.skipped = skipped_ids(tokenizer)
        self.text = ""  # the text so far, up to a stop string
        self.sent = 0  # characters of `text` handed out
        self.stopped = False
        # Decoding every id again per token would cost O(n^2) on the decode loop: decode a window of `kept` instead,
        # from a few tokens back (`start`) so that merges across the boundary come out right; the first `final` kept
        # ids, and the first `done` ids, are already in `text` (their text final: a caller's per-token entries go
        # with it). A window never begins with a skipped id: decoding drops it, and a decoder's Strip (Llama's,
        # Mistral's) would then take the leading space of the next token, which the text has.
        self.start = self.final = self.done = 0
        # Each stop string's Knuth-Morris-Pratt failure table and state over `text` (its first `fed` characters):
        # the longest tail that begins a stop string costs the characters a token adds, not a search of every tail
        # of the text (under a long stop string from a client, a long generation stalled the engine).
        self.failures = [_failure(s) for s in self.stops]
        self.matched = [0] * len(self.stops)
        self.fed = 0

    def push(self, token: int) -> str:
        """The text that `token` makes final ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        if token in self.skipped:  # (no text of its own: final where the ids around it are)
            return ""
        self.kept.append(token)
        self.at.append(len(self.ids) - 1)
        window, known = self._window()
        text = self.text + window[known:]
        if window.endswith("\ufffd"):  # a character waiting for its last byte; a stop string before it ends now
            ended = self._ended(self.text + text[len(self.text) :].rstrip("\ufffd"))  # (settled U+FFFDs stay)
            return self._settled(window, known) if ended is None else ended
        self._commit(text)
        return self._final()

    def _commit(self, text: str) -> None:
        """`text`, the window's, is final: every id pushed is in it."""
        self.text = text
        self.start, self.final, self.done = self.final, len(self.kept), len(self.ids)

    def _window(self) -> tuple[str, int]:
        """The text of the kept ids from `start` on, and how much of it the final ones make (it is in `text`).
        Where that text no longer begins with theirs, a byte-fallback decoder (Llama's, Gemma's) rendered a run of
        byte tokens across the two whole, each byte a U+FFFD where the run ends inside a character (a stray byte):
        the window then begins at the first id not final, whose bytes are the run's rest."""
        decode = self.tokenizer.decode
        window, known = (decode(self.kept[self.start : end], skip_special_tokens=True) for end in (None, self.final))
        if not window.startswith(known):
            self.start = self.final
            window, known = decode(self.kept[self.start :], skip_special_tokens=True), ""
        return window, len(known)

    def _final(self) -> str:
        """What the text, final so far, hands out: up to a stop string, or all but a tail that may begin one."""
        ended = self._ended(self.text)
        return ended if ended is not None else self._take(len(self.text) - self._held(self.text))

    def _settled(self, window: str, known: int) -> str:
        """While the text ends in U+FFFD, the text of all but the last PENDING ids, made final where the ids split
        there: they decode apart as they do together, and the last ones carry text (bytes after the first ones',
        which no later byte can join to them). So a character cut in two, or followed only by special tokens, waits;
        a byte no character begins with (a client's logit_bias can force runs of them) is final. Without it, the
        window grew for as long as the text ended in U+FFFD, each token decoding all of them again; it still does
        where no split is clean (tokens that each end inside a character)."""
        cut = len(self.kept) - PENDING
        if cut <= self.final:
            return ""
        decode, kept = self.tokenizer.decode, self.kept
        head, tail = (decode(part, skip_special_tokens=True) for part in (kept[self.start : cut], kept[cut:]))
        if not tail or head + tail != window:  # (`window`: the kept ids from `start` on)
            return ""
        self.text += head[known:]
        self.start, self.final, self.done = self.final, cut, self.at[cut]
        return self._final()  # (a stop string that ends in U+FFFD: found once that is settled)

    def _ended(self, text: str, final: bool = False) -> str | None:
        """Where `text` holds a stop string: the text ends before it (`stopped`), and what of it is left to hand
        out; else None. A stop string must lie within the answer, before a call and before a tail that may begin
        one (unless the text is `final`: the generation ended)."""
        longest = max(map(len, self.stops), default=0)
        end = self._answer_end(text) - (0 if final else self._undecided(text))
        hits = [i for i in (text.find(s, max(0, self.sent - longest), end) for s in self.stops) if i >= 0]
        if not hits:
            return None
        self.text, self.stopped = text[: min(hits)], True
        return self._take(len(self.text))

    @property
    def holding(self) -> bool:
        """Whether decoded text is held back (a tail that may begin a stop string)."""
        return self.sent < len(self.text)

    def covering(self) -> int:
        """How many of the pushed tokens the text needs: after a stop string, those that begin before it (the ones
        after add only the stop string's text)."""
        decode, low, high = self.tokenizer.decode, 0, len(self.ids)
        while low < high:  # the fewest tokens whose text holds the whole text (so do all longer runs of them; a run
            mid = (low + high) // 2  # that splits a character ends in U+FFFD, which the text does not have there)
            if decode(self.ids[:mid], skip_special_tokens=True).startswith(self.text):
                high = mid
            else:
                low = mid + 1
        return low

    def flush(self) -> str:
        """What is left when the generation ends (an incomplete character included; a stop string still ends it).
        The window's text, not every id decoded again: a byte-fallback decoder (Llama's, Gemma's) turns a whole run
        of byte tokens into U+FFFDs where the run ends inside a character, and the characters of the run already
        handed out stay as they were sent."""
        if not self.stopped:
            text = self.text
            if self.final < len(self.kept):
                window, known = self._window()
                text += window[known:]
            if (ended := self._ended(text, final=True)) is not None:  # (a tail held as a call's tag's start too)
                return ended
            if self.final < len(self.kept):
                self._commit(text)
        return self._take(len(self.text))

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` (which extends the text of the last call) that begins a stop string,
        or a call's opening tag where stop strings may still end the answer before it."""
        if self._answer_end(text) < len(text):  # (a call: no stop string holds it back)
            return 0
        new = text[self.fed :]
        for i, (stop, failure) in enumerate(zip(self.stops, self.failures)):
            n = self.matched[i]
            for c in new:
                while n and (n == len(stop) or stop[n] != c):
                    n = failure[n - 1]
                n += stop[n] == c
            self.matched[i] = n
        self.fed = len(text)
        held = max((min(n, len(s) - 1) for n, s in zip(self.matched, self.stops)), default=0)
        return max(held, self._undecided(text))

    def _answer_end(self, text: str) -> int:
        """Where the answer in `text` (the final text, extended) ends: at a call's opening tag, else at its end. The
        final text is searched once (it never changes), so each token costs the characters it adds."""
        if self.call_at is None and self.calls is not None and self.stops:
            if (at := text.find(self.calls, self.looked)) >= 0:
                self.call_at = at if at + len(self.calls) <= len(self.text) else None  # (final: a tag for good)
                return at
            self.looked = max(self.looked, len(self.text) - len(self.calls) + 1)
        return len(text) if self.call_at is None else min(self.call_at, len(text))

    def _undecided(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a call's opening tag, where stop strings apply and no
        tag has come (a tag of several tokens: `<tool` may become `<tool_call>`, or stay answer text)."""
        if self.calls is None or self.call_at is not None or not self.stops:
            return 0
        return tag_tail(text, self.calls)

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent : end], end
        return piece


def tag_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (and is not all of it): text that may yet become the
    tag, as more tokens come."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def _failure(stop: str) -> list[int]:
    """failure[i]: the length of the longest proper prefix of stop[: i + 1] that is also its suffix (KMP's table)."""
    failure, n = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while n and stop[i] != stop[n]:
            n = failure[n - 1]
        n += stop[i] == stop[n]
        failure[i] = n
    return failure


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops: special tokens, which decode to their own text
    otherwise (an added token that is not special, e.g. <tool_call>, is text). Found once per tokenizer."""
    return _skipped_ids(tokenizer) if isinstance(tokenizer, Hashable) else _skipped_ids.__wrapped__(tokenizer)


@functools.lru_cache(maxsize=8)
def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    added = {*getattr(tokenizer, "added_tokens_decoder", {}), *getattr(tokenizer, "all_special_ids", ())}
    return frozenset(i for i in added if tokenizer.decode([i], skip_special_tokens=True) == ""
                     and tokenizer.decode([i], skip_special_tokens=False) != "")
