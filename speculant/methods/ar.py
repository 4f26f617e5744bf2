"""`ar`: plain autoregressive decoding, one target forward per token; the reference every other method
reproduces token for token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speculant.methods.registry import Request, register


@dataclass(frozen=True)
class AROptions:
    pass


@register("ar", AROptions, "autoregressive decoding (no drafter)")
def build(request: Request, options: AROptions) -> Any:
    from speculant.decoding.autoregressive import autoregressive

    return autoregressive(request.target, request.prompt_ids, request.max_new_tokens, request.sampling,
                          request.generator)
