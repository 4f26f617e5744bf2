"""Model loading: catalog names, Hugging Face ids or paths, and already built transformers models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculant.errors import ConfigError, ModelNotAvailable
from speculant.models.base import CausalLM
from speculant.models.catalog import CATALOG, materialize
from speculant.models.hf import HFCausalLM

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

__all__ = ["CATALOG", "DTYPES", "CausalLM", "HFCausalLM", "dtype_name", "load_model", "resolve_device"]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (bf16, fp32) of a torch dtype that speculant loads models in."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def resolve_device(device: str) -> torch.device:
    """Parse `cpu`, `cuda` or `cuda:N`, failing clearly when that device is not there."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device '{device}' (use cpu, cuda or cuda:N)") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ModelNotAvailable(f"device '{device}' is not available: torch sees {count} CUDA device(s)")
    elif parsed.type != "cpu":
        raise ConfigError(f"unsupported device '{device}' (use cpu, cuda or cuda:N)")
    return parsed


def catalog_listing() -> str:
    return ", ".join(CATALOG)


def load_model(spec: Any, dtype: str = "bf16", device: str = "cpu", tokenizer: Any | None = None) -> CausalLM:
    """Load a CausalLM from a catalog name, a Hugging Face id or local path, or a transformers model.

    Catalog models are de-quantized from their packaged GGUF once and cached as safetensors.
    A CausalLM passes through unchanged.
    """
    if isinstance(spec, CausalLM):
        return spec
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    torch_device = resolve_device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(spec, PreTrainedModel):
        return HFCausalLM(spec.to(device=torch_device, dtype=DTYPES[dtype]), tokenizer)
    if not isinstance(spec, (str, Path)):
        raise ConfigError(f"cannot load a model from {type(spec).__name__}")
    name = str(spec)
    if not name:
        raise ConfigError(f"empty model name; catalog models: {catalog_listing()}")
    extra_eos: tuple[str, ...] = ()
    if name in CATALOG:
        path: str | Path = materialize(CATALOG[name], dtype)
        extra_eos = CATALOG[name].extra_eos
    elif Path(name).exists() or "/" in name:
        path = name
    else:
        raise ModelNotAvailable(f"unknown model '{name}'; catalog models: {catalog_listing()} "
                                "(or give a Hugging Face id or a local path)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(torch_device)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ModelNotAvailable(f"cannot load model '{name}': {str(error).splitlines()[0]}") from None
    return HFCausalLM(model, tokenizer, name, frozenset(tokenizer.convert_tokens_to_ids(t) for t in extra_eos))
