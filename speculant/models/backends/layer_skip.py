"""Self-speculation by layer skipping (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et al. 2025): the target's own
weights draft with some of its layers left out, on a cache of their own. Which layers, and how many, is calibrated
once per model on the offline corpus (`speculant.corpus`, never on benchmark prompts) and remembered: each middle
layer's importance is the top-1 agreement with the full model when it alone is skipped (teacher-forced, SWIFT's
criterion); the least important are skipped one more at a time while Leviathan et al.'s expected wall-time
improvement (Theorem 3.8, with c the share of the weights' bytes the drafter still streams) keeps growing."""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from speculant.cache import remembered
from speculant.corpus import corpus_key, default_corpus, tokenize_corpus
from speculant.errors import ConfigError
from speculant.models.backends.lean import LeanCausalLM
from speculant.theory import sd_walltime_improvement

CALIBRATION = 256  # corpus tokens a calibration forward reads
SCORED = 128  # of them, the last ones whose next token is compared
FILES = 8  # corpus files the tokens come from, spread over the corpus
LOOKAHEADS = range(1, 9)  # draft lengths the expected improvement is maximised over


def skipped_layers(model: LeanCausalLM) -> tuple[int, ...]:
    """The layers a lean model (`models.backends.lean.LeanCausalLM`) skips when it drafts for itself, ascending; a
    ConfigError where calibration found none worth skipping (the draft would cost a whole forward of the model)."""
    skipped = tuple(calibration(model)["skipped"])
    if not skipped:
        raise ConfigError(f"self@skip: calibration found no layer worth skipping in {model.name} (a draft would cost "
                          "as much as the model's own forward): draft with another drafter")
    return skipped


def calibration(model: LeanCausalLM) -> dict:
    """{"skipped": layers, "agreement": the draft's top-1 agreement with the model, "share": c by bytes, "gain":
    the expected improvement at the best draft length}: measured the first time (~1 minute for the 1.5B) and
    remembered per model file, corpus and calibration code."""
    if model.tokenizer is None:
        raise ConfigError("self@skip calibrates on text: the target needs a tokenizer")
    files = default_corpus()
    source = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:16]
    key = f"{model.weights.directory.name}|{corpus_key(files)}|{source}"
    return remembered("layer_skip.json", key, lambda: _calibrate(model, files))


def _calibrate(model: LeanCausalLM, files: list[Path]) -> dict:
    stride = max(len(files) // FILES, 1)
    ids = [t for seq in tokenize_corpus(model.tokenizer, files[::stride][:FILES]) for t in seq[:CALIBRATION // FILES]]
    ids = ids[:min(CALIBRATION, model.max_positions)]
    scored = min(SCORED, len(ids) - 1)
    layers, weights = model.layers, model.weights

    bar = tqdm(desc=f"choosing the layers {model.name} skips as its own drafter, once", unit=" forwards",
               disable=len(layers) < 8, file=sys.stderr, leave=False)

    def next_tokens(skipped: Sequence[int]) -> torch.Tensor:
        handle = model.skipping(skipped)
        handle.prefill(ids[:-scored])
        bar.update()
        return handle.forward(ids[-scored:]).argmax(-1)

    per_layer = [sum(m.data.numel() for m in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down))
                 for layer in weights.layers]
    total = sum(m.data.numel() for m in weights.matrices())

    def share(skipped: Sequence[int]) -> float:
        """The share of a forward's weight bytes that a draft still streams."""
        return 1 - sum(per_layer[i] for i in skipped) / total

    full = next_tokens(())

    def agreement(skipped: Sequence[int]) -> float:
        return float((next_tokens(skipped) == full).float().mean())

    middle = layers[1:-1]  # the first and last layers carry the embedding's and the head's geometry
    importance = {i: agreement([i]) for i in middle}
    order = sorted(middle, key=lambda i: -importance[i])
    chosen = {"skipped": [], "agreement": 1.0, "share": 1.0, "gain": 0.0}
    for m in range(1, len(order) + 1):
        skipped = sorted(order[:m])
        a = importance[order[0]] if m == 1 else agreement(skipped)
        gain = max(sd_walltime_improvement(a, k, share(skipped)) for k in LOOKAHEADS)
        if gain <= chosen["gain"]:
            break
        chosen = {"skipped": skipped, "agreement": a, "share": share(skipped), "gain": gain}
    bar.close()
    return chosen
