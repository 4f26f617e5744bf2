"""An OpenAI-compatible server with speculative decoding and continuous batching (`speculant serve`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speculant.config import ModelConfig


def serving_backend(config: ModelConfig) -> str:
    """`auto` for a server: transformers where its batched forwards are fast (AMX or CUDA: a batch of rows
    costs about one row), else what `auto` picks for one sequence. AVX512-BF16 alone is not enough: there the
    lean backend serves several times transformers' bf16 (CHANGELOG.md, serving)."""
    from speculant.machine import cpu_has

    if config.backend != "auto":
        return config.backend
    return "hf" if config.device != "cpu" or cpu_has("amx_bf16") else "auto"
