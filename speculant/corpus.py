"""What speculant counts tokens on, offline, once per tokenizer (cached): Python's own standard library modules
(code and comments, present on every machine that runs speculant: Max-Gram's bigram table, and the code half of
FR-Spec's head), and running English prose as `wordfreq` ships its word frequencies (the prose half of FR-Spec's
head, `frequent_tokens`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import sysconfig
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from speculant.cache import cache_root, cached_array
from speculant.errors import ModelNotAvailable


def default_corpus() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_key(files: list[Path]) -> str:
    return hashlib.sha256("\n".join(f"{f}:{f.stat().st_size}" for f in files).encode()).hexdigest()[:16]


FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # per tokenizer object, while it lives


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of how the tokenizer splits text, the key of what is counted with it: a fast tokenizer's whole
    backend as the `tokenizers` library serializes it (vocabulary, merges, normalizer, pre-tokenizer, added tokens:
    two tokenizers of one vocabulary may count apart), else its vocabulary. Taken once per tokenizer object (a
    drafter's load asks for it three times, and serializing a large vocabulary is not free): a tokenizer given
    tokens after its first digest (`add_tokens`) keeps that digest."""
    if tokenizer not in FINGERPRINTS:
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is not None:
            text = backend.to_str()
            text = text[max(text.find('"added_tokens":'), 0):]  # (not the padding and truncation before it, which
            # transformers' calls set and unset)
        else:
            text = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        FINGERPRINTS[tokenizer] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return FINGERPRINTS[tokenizer]


def tokenize_corpus(tokenizer: Any, files: list[Path]) -> list[list[int]]:
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


PROSE_WORDS = 100_000  # wordfreq's most frequent English words, counted in the forms of WORD_FORMS
WORD_FORMS = ((" {word}", 0.75), (" {Word}", 0.15), ("{Word}", 0.10))  # within a sentence; capitalized: a name, a
# sentence's first word, first on a line (wordfreq folds case: these shares stand in for what it folded)


def code_counts(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """How often each token occurs in the standard library's modules."""
    files = default_corpus()
    path = cache_root() / "frequency" / f"{tokenizer_fingerprint(tokenizer)}-{corpus_key(files)}.npy"
    return cached_array(path, lambda: np.bincount(
        np.concatenate([np.asarray(s, dtype=np.int64) for s in tokenize_corpus(tokenizer, files)]),
        minlength=vocab_size))[:vocab_size]


def words_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each short text's token ids, without special tokens. A fast tokenizer's own batch encoder, where there is
    one and it neither pads nor truncates (a tokenizer.json may set either; transformers' call turns them off):
    transformers' wrapper around it spends more time building its output than the encoder does on words."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and backend.padding is None and backend.truncation is None:
        return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def prose_counts(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """How often each token occurs in running English text, estimated from `wordfreq`'s frequencies of the
    `PROSE_WORDS` commonest English words (Speer 2022: Wikipedia, subtitles, news, books, web text and more),
    each word's frequency spread over the tokens of its forms (`WORD_FORMS`). Without `wordfreq` (its version keys
    the cached counts): ModelNotAvailable, one line."""
    from importlib.metadata import PackageNotFoundError, version

    def count() -> np.ndarray:
        from wordfreq import get_frequency_dict  # (imported only to count: a cached count needs none of it)

        words = sorted(get_frequency_dict("en", wordlist="large").items(), key=lambda item: -item[1])[:PROSE_WORDS]
        frequencies = np.array([frequency for _, frequency in words])
        counts = np.zeros(vocab_size)
        for form, share in WORD_FORMS:
            texts = [form.format(word=word, Word=word.capitalize()) for word, _ in words]
            encoded = words_ids(tokenizer, texts)
            ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64)
            weights = np.repeat(frequencies * share, [len(word_ids) for word_ids in encoded])  # each token its word's
            kept = ids < vocab_size
            counts += np.bincount(ids[kept], weights[kept], minlength=vocab_size)
        return counts

    try:
        wordfreq = version("wordfreq")
    except PackageNotFoundError:
        raise ModelNotAvailable("a drafter's FR-Spec head ranks tokens by English word frequencies from the wordfreq "
                                "package, which is not installed; run: pip install wordfreq") from None
    forms = json.dumps([PROSE_WORDS, WORD_FORMS])
    key = hashlib.sha256(f"{wordfreq}|{forms}".encode()).hexdigest()[:16]
    return cached_array(cache_root() / "frequency" / f"{tokenizer_fingerprint(tokenizer)}-prose-{key}.npy",
                        count)[:vocab_size]


def frequent_tokens(tokenizer: Any, vocab_size: int, n: int) -> np.ndarray:
    """The `n` token ids likeliest in code or prose - ranked by the larger of a token's shares of the standard
    library's tokens and of English prose's - with every special and added token (chat markers, end of
    sequence) whatever its count: ascending int64 ids. Ties, and the tokens neither shows, go in id order: a
    byte-pair vocabulary's ids follow the order its merges were learned, most frequent first. FR-Spec (Zhao et
    al. 2025, section 3.2) restricts a drafter's output head to these; it counts on one broad corpus, and a
    coder's drafter serves both code and chat."""
    code, prose = code_counts(tokenizer, vocab_size), prose_counts(tokenizer, vocab_size)
    counts = np.maximum(code / max(code.sum(), 1), prose / max(prose.sum(), 1))
    special = np.unique(np.asarray([i for i in (*tokenizer.all_special_ids, *tokenizer.get_added_vocab().values())
                                    if i < vocab_size], dtype=np.int64))
    ranked = np.argsort(-counts, kind="stable")
    ranked = ranked[~np.isin(ranked, special)]  # (ranked among the rest: a frequent special token is in already)
    return np.union1d(special, ranked[:max(n - len(special), 0)])[:n]
