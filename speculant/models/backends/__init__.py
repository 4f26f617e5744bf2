"""The backends: each a CausalLM on its own numerics, declaring its `Capabilities` (see models/base.py): `lean`
(GGUF on speculant's 4-bit kernels), `llamacpp` (GGUF on ggml, and the native build it runs on), `hf`
(transformers on batch-invariant linears) and `static` (torch, a static cache, compiled)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from speculant.config import BACKENDS

if TYPE_CHECKING:
    from speculant.models.base import Capabilities


def capabilities_of(backend: str) -> Capabilities:
    """A backend's declared capabilities, by its name, before any model loads (its module imported, nothing else)."""
    return getattr(importlib.import_module(f"{__name__}.{backend}"), BACKENDS[backend]).capabilities
