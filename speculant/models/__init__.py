"""CausalLM backends, the catalog of packaged models, and `load_model`."""

from speculant.models.base import CausalLM
from speculant.models.catalog import CATALOG
from speculant.models.backends.hf import HFCausalLM
from speculant.models.loading import (
    DTYPES,
    dtype_name,
    load_model,
    quantized_copy,
    resolve_device,
    resolve_dtype,
    split_quant,
)
from speculant.models.numerics.quant import QUANTS

__all__ = ["CATALOG", "DTYPES", "QUANTS", "CausalLM", "HFCausalLM", "dtype_name", "load_model", "quantized_copy",
           "resolve_device", "resolve_dtype", "split_quant"]
