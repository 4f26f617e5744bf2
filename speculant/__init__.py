"""speculant: lossless speculative inference of language models."""

from speculant.api import GenerationResult, GenerationStream, generate
from speculant.decoding.stats import GenerationStats
from speculant.models import load_model

__version__ = "0.1.0"
__all__ = ["GenerationResult", "GenerationStats", "GenerationStream", "generate", "load_model"]
