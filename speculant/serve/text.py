"""Token ids to text as it becomes final, with stop strings matched across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


PENDING = 4  # ids the decoding window keeps back while the text ends in U+FFFD (a character's bytes: at most four)


class TextStream:
    """Push token ids, get text increments. Holds back an incomplete character (the tokenizer decodes it
    as U+FFFD until its last byte arrives) and any tail that could begin a stop string; at a stop string
    it sets `stopped` and the text ends before it (as in OpenAI's API)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text = ""  # the text so far, up to a stop string
        self.sent = 0  # characters of `text` handed out
        self.stopped = False
        # Decoding every id again per token would cost O(n^2) on the decode loop: decode a window instead,
        # from a few tokens back (`start`) so that merges across the boundary come out right; `done` ids
        # are already in `text` (their text final: a caller's per-token entries go with it).
        self.start = self.done = 0
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
        decode = self.tokenizer.decode
        window = decode(self.ids[self.start :], skip_special_tokens=True)
        known = len(decode(self.ids[self.start : self.done], skip_special_tokens=True))  # (of `window`, in `text`)
        text = self.text + window[known:]
        if window.endswith("\ufffd"):  # a character waiting for its last byte; a stop string before it ends now
            ended = self._ended(self.text + text[len(self.text) :].rstrip("\ufffd"))  # (settled U+FFFDs stay)
            return self._settled(window, known) if ended is None else ended
        self.start, self.done = self.done, len(self.ids)
        self.text = text
        return self._final()

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
        cut = len(self.ids) - PENDING
        if cut <= self.done:
            return ""
        decode, ids = self.tokenizer.decode, self.ids
        head, tail = (decode(part, skip_special_tokens=True) for part in (ids[self.start : cut], ids[cut:]))
        if not tail or head + tail != window:  # (`window`: the ids from `start` on)
            return ""
        self.text += head[known:]
        self.start, self.done = self.done, cut
        return self._final()  # (a stop string that ends in U+FFFD: found once that is settled)

    def _ended(self, text: str) -> str | None:
        """Where `text` holds a stop string: the text ends before it (`stopped`), and what of it is left to hand
        out; else None."""
        longest = max(map(len, self.stops), default=0)
        hits = [i for i in (text.find(s, max(0, self.sent - longest)) for s in self.stops) if i >= 0]
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
        """What is left when the generation ends (an incomplete character included; a stop string still ends it)."""
        if not self.stopped and self.ids:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if (ended := self._ended(text)) is not None:
                return ended
            self.text = text
        return self._take(len(self.text))

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` (which extends the text of the last call) that begins a stop string."""
        new = text[self.fed :]
        for i, (stop, failure) in enumerate(zip(self.stops, self.failures)):
            n = self.matched[i]
            for c in new:
                while n and (n == len(stop) or stop[n] != c):
                    n = failure[n - 1]
                n += stop[n] == c
            self.matched[i] = n
        self.fed = len(text)
        return max((min(n, len(s) - 1) for n, s in zip(self.matched, self.stops)), default=0)

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent : end], end
        return piece


def _failure(stop: str) -> list[int]:
    """failure[i]: the length of the longest proper prefix of stop[: i + 1] that is also its suffix (KMP's table)."""
    failure, n = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while n and stop[i] != stop[n]:
            n = failure[n - 1]
        n += stop[i] == stop[n]
        failure[i] = n
    return failure
