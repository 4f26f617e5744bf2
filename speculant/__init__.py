"""speculant: lossless speculative inference of language models.

The public names load lazily, so that torch-free parts (`speculant simulate`) start instantly.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["GenerationResult", "GenerationStats", "GenerationStream", "generate", "load_model"]


def __getattr__(name: str) -> Any:
    if name in ("GenerationResult", "GenerationStream", "generate"):
        from speculant import api

        return getattr(api, name)
    if name == "GenerationStats":
        from speculant.decoding.stats import GenerationStats

        return GenerationStats
    if name == "load_model":
        from speculant.models import load_model

        return load_model
    raise AttributeError(f"module 'speculant' has no attribute {name!r}")
