"""CausalLM backends, the catalog of packaged models, and `load_model`. Transformers' models load on first use of
the transformers backend: a GGUF on llama.cpp or the lean kernels needs only a tokenizer from it."""

from speculant.config import QUANTS
from speculant.models.base import CausalLM
from speculant.models.catalog import CATALOG, split_quant
from speculant.models.loading import (
    DTYPES,
    dtype_name,
    load_model,
    quantized_copy,
    resolve_device,
    resolve_dtype,
)

__all__ = ["CATALOG", "DTYPES", "QUANTS", "CausalLM", "HFCausalLM", "dtype_name", "load_model", "quantized_copy",
           "resolve_device", "resolve_dtype", "split_quant"]


def __getattr__(name: str) -> type:
    if name == "HFCausalLM":  # (PEP 562: imported on first use)
        from speculant.models.backends.hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
