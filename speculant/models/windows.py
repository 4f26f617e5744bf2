"""Sliding-window attention as a transformers config declares it, read one way for every backend that builds
attention from such a config (`hf`, `static`)."""

from __future__ import annotations

from typing import Any


def layer_windows(config: Any) -> list[int | None]:
    """Each attention layer's sliding window (each query sees the keys of the last `window` positions; None: all
    of them): `layer_types` where the config has them, else one `sliding_window` for every layer, none where
    `use_sliding_window` is off (Qwen2's default)."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * layers
    return [int(window) if kind == "sliding_attention" else None for kind in types]
