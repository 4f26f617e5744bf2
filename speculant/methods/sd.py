"""`sd`: speculative decoding and sampling (Leviathan et al. 2023; Chen et al. 2023) with one drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speculant.config import REQUEST_MOST, option
from speculant.drafters.spec import model_free
from speculant.errors import ConfigError, OptionError
from speculant.methods.drafting import DrafterOptions, check_draft_confidence, draft_confidence_option
from speculant.methods.registry import Request, register


@dataclass(frozen=True)
class SDOptions(DrafterOptions):
    k: int = option(4, "draft tokens per speculation step", most=REQUEST_MOST)
    draft_confidence: float = draft_confidence_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k < 1:
            raise OptionError("k", f"k must be >= 1, got {self.k}")
        check_draft_confidence(self.draft_confidence)
        if self.draft_confidence and model_free(self.drafter):
            raise ConfigError(f"draft_confidence needs a model drafter, not {self.drafter.kind}")


@register("sd", SDOptions, "speculative decoding: k drafts per step, verified in one target forward", chains=True)
def build(request: Request, options: SDOptions) -> Any:
    from speculant.decoding.run import ending
    from speculant.decoding.speculative import speculative
    from speculant.drafters.base import Drafter
    from speculant.drafters.cross_vocab import model_drafter

    source = request.session.drafter(options.drafter, options.drafter_dtype)
    if isinstance(source, Drafter) and options.draft_confidence:
        raise ConfigError(f"draft_confidence needs a model drafter, not {type(source).__name__}")
    if isinstance(source, Drafter):
        drafter = source.begin(request.prompt_ids)
    else:
        drafter = model_drafter(request.session.cache(source), request.target, request.sampling, request.generator,
                                draft_confidence=options.draft_confidence, pairs=request.session.vocab_pairs)
    decoder = speculative(request.target, drafter, request.prompt_ids, options.k, request.max_new_tokens,
                          request.sampling, request.generator)
    return ending(decoder, [drafter], request.prompt_ids)
