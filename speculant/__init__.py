"""speculant: lossless speculative inference of language models.

The public names load lazily, so that torch-free parts (`speculant simulate`) start instantly.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Draft", "Drafter", "GenerationResult", "GenerationStats", "GenerationStream", "Session", "generate",
           "load_model", "register_drafter"]


def __getattr__(name: str) -> Any:
    if name in ("Draft", "Drafter"):
        from speculant.drafters import base

        return getattr(base, name)
    if name == "register_drafter":
        from speculant.drafters.registry import register_drafter

        return register_drafter
    if name == "Session":
        from speculant.session import Session

        return Session
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
