"""Two vocabularies side by side: the bytes every token spells, the tokens both share, and text turned into the
target's tokens at safe boundaries. The ground of drafting with another tokenizer (Timor et al. 2025,
"Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies":
string-level exact match, Algorithm 2, and token-level intersection, Algorithm 4).

Tokens are compared as bytes, so byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM), SentencePiece pieces (`▁`,
`<0xNN>`) and plain token strings line up with each other. Special tokens are compared by their content, and
only with special tokens. A logits row may be wider than its tokenizer (Qwen pads 151,665 tokens to 151,936
rows; GGUF conversions name the extra rows `[PAD<id>]`): such ids spell nothing, are never shared and are
never drafted.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import torch

from speculant.models.base import common_prefix_len


@cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet (transformers' `bytes_to_unicode`), inverted: character -> the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _decoders(tokenizer: Any) -> set[str]:
    """The types of a fast tokenizer's decoders (ByteLevel, ByteFallback, Metaspace, ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    if not decoder:
        return set()
    return {d.get("type") for d in (decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder])}


_PIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, width: int) -> tuple[list[bytes | None], frozenset[int]]:
    """(what each of `width` ids spells, the ids of special tokens). Ids past the tokenizer (padded rows) and
    `[PAD<id>]` placeholders spell None."""
    kinds = _decoders(tokenizer)
    byte_of = byte_of_char()
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items() if i < width}
    spelled: list[bytes | None] = [None] * width
    for token, i in tokenizer.get_vocab().items():
        if i >= width or i in added or token == f"[PAD{i}]":
            continue
        if "ByteLevel" in kinds and all(c in byte_of for c in token):
            spelled[i] = bytes(byte_of[c] for c in token)
        elif "ByteFallback" in kinds and (byte := _PIECE_BYTE.fullmatch(token)):
            spelled[i] = bytes([int(byte.group(1), 16)])
        elif "Metaspace" in kinds or ("Replace" in kinds and "ByteFallback" in kinds):
            spelled[i] = token.replace("▁", " ").encode()
        else:
            spelled[i] = token.encode()
    for i, token in added.items():
        spelled[i] = token.content.encode()
    return spelled, frozenset(i for i, t in added.items() if t.special)


def incomplete_tail(data: bytes) -> int:
    """How many trailing bytes of `data` begin a UTF-8 character that is not complete yet (0 to 3)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): how long is its character?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else \
                4 if byte >> 3 == 0b11110 else 1
            return back if need > back else 0
    return 0


@dataclass
class VocabPair:
    """A target's and a drafter's vocabularies: what each id spells, and `to_target` [drafter width], the target id
    spelling the same bytes (special tokens: the same content), -1 where the target has none. The rest is derived
    once, here, for the decode loop."""

    target: Any  # the target's tokenizer
    drafter: Any  # the drafter's tokenizer
    target_bytes: list[bytes | None]
    drafter_bytes: list[bytes | None]
    drafter_specials: frozenset[int]
    to_target: torch.Tensor  # [drafter width] long
    shared: torch.Tensor = field(init=False)  # [drafter width] bool: ids the target has too (the intersection)
    spelled: torch.Tensor = field(init=False)  # [drafter width] bool: ids that spell something (not padding)
    _columns: torch.Tensor = field(init=False)  # the shared drafter ids, and below the target ids they map to
    _targets: torch.Tensor = field(init=False)
    _by_bytes: list[bytes] = field(init=False)  # the drafter's non-special tokens in byte order, and their ids
    _ids_by_bytes: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.shared = self.to_target >= 0
        self.spelled = torch.tensor([b is not None for b in self.drafter_bytes])
        self._columns = torch.nonzero(self.shared)[:, 0]
        self._targets = self.to_target[self._columns]
        order = sorted((b, i) for i, b in enumerate(self.drafter_bytes)
                       if b is not None and i not in self.drafter_specials)
        self._by_bytes = [b for b, _ in order]
        self._ids_by_bytes = torch.tensor([i for _, i in order], dtype=torch.long)

    def on_target(self, q: torch.Tensor, width: int) -> torch.Tensor:
        """Drafter distributions [n, drafter width] that are zero outside the shared tokens, on the target's ids
        [n, width]: a target id that several drafter ids spell (a byte-fallback token and the character it
        spells, as Llama 2's `<0x61>` and `a`) gets their summed probability."""
        mapped = torch.zeros(q.shape[0], width, dtype=q.dtype, device=q.device)
        return mapped.index_add_(1, self._targets.to(q.device), q[:, self._columns.to(q.device)])

    def starting_with(self, prefix: bytes) -> torch.Tensor:
        """The drafter ids whose bytes start with `prefix` (special tokens aside): one range of the byte order."""
        start = bisect.bisect_left(self._by_bytes, prefix)
        after = prefix.rstrip(b"\xff")  # the first byte string past every one starting with `prefix`
        end = bisect.bisect_left(self._by_bytes, after[:-1] + bytes([after[-1] + 1])) if after else len(self._by_bytes)
        return self._ids_by_bytes[start:end]

    def text(self, target_ids: list[int]) -> str | None:
        """The text the target's ids spell, or None when one spells nothing or the last character is cut."""
        parts = [self.target_bytes[i] if 0 <= i < len(self.target_bytes) else None for i in target_ids]
        if any(p is None for p in parts):
            return None
        data = b"".join(parts)
        return None if incomplete_tail(data) else data.decode("utf-8", errors="replace")

    def drafter_ids(self, text: str) -> list[int]:
        """The drafter's own tokens for `text`."""
        return self.drafter.encode(text, add_special_tokens=False)

    def draft_text(self, drafter_ids: list[int], skip: int = 0) -> tuple[str, int | None, bool]:
        """What a draft of drafter ids says: (its text up to the last whole character and before any special or
        unspelled token; the target id of a special token that ended it, if the target has one; whether the draft
        ended there)."""
        data, end, ended = bytearray(), None, False
        for i in drafter_ids:
            spelled = self.drafter_bytes[i]
            if spelled is None or i in self.drafter_specials:
                ended = True
                end = int(self.to_target[i]) if spelled is not None and self.to_target[i] >= 0 else None
                break
            data += spelled
        data = data[skip:]
        cut = incomplete_tail(bytes(data))
        text = bytes(data[: len(data) - cut]).decode("utf-8", errors="replace")
        return (text, None, False) if cut else (text, end, ended)

    def safe_target_ids(self, text: str, ended: bool) -> list[int]:
        """The target's tokens for `text` that more text is unlikely to change: all of them when the text ended,
        else all but the last pre-token's (words, numbers, runs of spaces: the pieces a BPE tokenizes one by one;
        a word may go on and merge into other tokens), at most its last three (a pre-token can be a whole clause
        of Chinese); without a pre-tokenizer, all but the last token."""
        if not text:
            return []
        backend = getattr(self.target, "backend_tokenizer", None)  # a fast tokenizer's
        pre = backend.pre_tokenizer if backend is not None else None
        if ended or pre is None:
            ids = self.target.encode(text, add_special_tokens=False)
            return ids if ended else ids[:-1]
        encoded = self.target(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        pieces = pre.pre_tokenize_str(text)
        last = pieces[-1][1][0] if pieces else 0
        before = sum(end <= last for _, end in encoded["offset_mapping"])
        return ids[: max(before, len(ids) - 3)]


def build_pair(target: Any, drafter: Any, target_width: int, drafter_width: int) -> VocabPair:
    target_bytes, target_specials = token_bytes(target, target_width)
    drafter_bytes, drafter_specials = token_bytes(drafter, drafter_width)
    index: dict[tuple[bool, bytes], int] = {}
    for i, spelled in enumerate(target_bytes):
        if spelled is not None:
            index.setdefault((i in target_specials, spelled), i)
    to_target = torch.tensor([index.get((i in drafter_specials, b), -1) if b is not None else -1
                              for i, b in enumerate(drafter_bytes)], dtype=torch.long)
    return VocabPair(target, drafter, target_bytes, drafter_bytes, drafter_specials, to_target)


class GrowingEncoding:
    """The drafter's tokens for a text that mostly grows (a context as decoding goes on): each call re-encodes
    only the text from the last word boundary before where it changed, and keeps the tokens before it.

    A boundary is the start of a kept token that is a space between two non-space characters, all three
    unchanged: byte-level BPE pre-tokenizers (GPT-2's, Llama 3's, Qwen's, SmolLM's) never merge across such a
    space into what precedes it, so the splice equals encoding the whole text (tested against it). Where the
    kept tokens do not spell the text byte for byte (a normalizing tokenizer), every call encodes it whole."""

    def __init__(self, pair: VocabPair):
        self.pair = pair
        self.data = b""  # the text last encoded, and its tokens with the byte offset where each starts
        self.ids: list[int] = []
        self.starts: list[int] = []

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        common = common_prefix_len(self.data, data)
        kept = bisect.bisect_right(self.starts, common - 2)  # tokens starting at least 2 bytes before the change
        while kept > 0 and not _word_boundary(data, self.starts[kept - 1]):
            kept -= 1
        kept = max(kept - 1, 0)  # the token at the boundary is encoded again with the rest
        cut = self.starts[kept] if kept else 0
        tail = self.pair.drafter_ids(data[cut:].decode("utf-8"))
        spelled = [self.pair.drafter_bytes[i] for i in tail]
        if any(b is None for b in spelled) or b"".join(spelled) != data[cut:]:  # not byte for byte: no splicing
            self.data, self.ids, self.starts = b"", [], []
            return tail if not kept else self.pair.drafter_ids(text)
        self.ids = self.ids[:kept] + tail
        self.starts = self.starts[:kept] + list(itertools.accumulate((len(b) for b in spelled[:-1]), initial=cut))
        self.data = data
        return list(self.ids)


def _word_boundary(data: bytes, at: int) -> bool:
    """Whether `data[at]` is a space between two non-space bytes (where a pre-token starts)."""
    return 0 < at < len(data) - 1 and data[at] == 0x20 and not data[at - 1:at].isspace() \
        and not data[at + 1:at + 2].isspace()


def vocab_pair(target: Any, drafter: Any, pairs: dict) -> VocabPair:
    """The VocabPair of two models (their tokenizers and logits widths), built once per pair (seconds for
    150k-token vocabularies) and kept in `pairs` (a `Session`'s)."""
    key = (id(target.tokenizer), id(drafter.tokenizer), target.vocab_size, drafter.vocab_size)  # a pair holds both
    if key not in pairs:  # tokenizers, so their ids stay theirs while it is kept
        pairs[key] = build_pair(target.tokenizer, drafter.tokenizer, target.vocab_size, drafter.vocab_size)
    return pairs[key]


def same_vocabulary(target: Any, drafter: Any) -> bool:
    """Whether two models' ids mean the same tokens: the same tokenizer vocabulary, or (without tokenizers) the
    same logits width."""
    if target.tokenizer is None or drafter.tokenizer is None:
        return target.vocab_size == drafter.vocab_size
    return _same_tokens(target.tokenizer, drafter.tokenizer)


@lru_cache(maxsize=32)
def _same_tokens(a: Any, b: Any) -> bool:
    return a is b or a.get_vocab() == b.get_vocab()
