"""The offline text corpus speculant counts tokens on (Python's own standard library modules: code, comments
and English prose, present on every machine that runs speculant), and what is counted on it once per
tokenizer and cached: Max-Gram's bigram table uses the corpus; FR-Spec's head uses `frequent_tokens`."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from speculant.cache import cache_root


def default_corpus() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_key(files: list[Path]) -> str:
    return hashlib.sha256("\n".join(f"{f}:{f.stat().st_size}" for f in files).encode()).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def tokenize_corpus(tokenizer: Any, files: list[Path]) -> list[list[int]]:
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def frequent_tokens(tokenizer: Any, vocab_size: int, n: int) -> np.ndarray:
    """The `n` token ids most frequent in the corpus, with every special and added token (chat markers, end of
    sequence) whatever its count: ascending int64 ids. Ties, and the tokens the corpus never shows, go in id
    order: a byte-pair vocabulary's ids follow the order its merges were learned, most frequent first.
    FR-Spec (Zhao et al. 2025, section 3.2) restricts a drafter's output head to these."""
    files = default_corpus()
    path = cache_root() / "frequency" / f"{tokenizer_fingerprint(tokenizer)}-{corpus_key(files)}.npy"
    try:
        counts = np.load(path)
    except (OSError, ValueError):
        counts = np.bincount(np.concatenate([np.asarray(s, dtype=np.int64) for s in tokenize_corpus(tokenizer, files)]),
                             minlength=vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, counts)
        tmp.replace(path)
    counts = counts[:vocab_size]
    special = [i for i in (*tokenizer.all_special_ids, *tokenizer.get_added_vocab().values()) if i < vocab_size]
    ranked = np.argsort(-counts, kind="stable")
    chosen = np.union1d(np.asarray(special, dtype=np.int64), ranked[:max(n - len(set(special)), 0)])
    return chosen[:n] if len(chosen) > n else chosen
