"""`cascade`: cascade speculative drafting (Chen et al., "Cascade Speculative Drafting"): drafters largest
first, Max-Gram last, shaped by an upper-triangular K matrix, inner reviews relaxed by a leniency."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from speculant.config import REQUEST_MOST, option
from speculant.drafters.spec import MAXGRAM, DrafterSpec, model_free, named
from speculant.errors import ConfigError, OptionError
from speculant.methods.drafting import as_drafters, check_drafters, drafter_dtype_option, parse_drafters
from speculant.methods.registry import Request, register


DEFAULT_K = 4


@dataclass(frozen=True)
class CascadeOptions:
    EITHER = (("k", "k_matrix"),)  # one or the other, the second where given (`registry.parse_values`)

    drafters: Any = option((), "drafter levels, largest first, maxgram last, e.g. qwen2.5-coder-0.5b@int8,maxgram "
                           "(required; default: none)",
                           parse=parse_drafters)
    k_matrix: Any = option(None, "the upper-triangular K matrix, rows split by ';' (e.g. '4,2;0,6' or '4,2;6'; "
                           "default: k tokens per level plus 2 maxgram tokens after each)", most=REQUEST_MOST)
    k: int = option(DEFAULT_K, "draft tokens per level when no K matrix is given", most=REQUEST_MOST)
    leniency: float = option(1.0, "leniency l >= 1 of the inner reviews (the target's stays exact)")
    drafter_dtype: str | None = drafter_dtype_option()

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", as_drafters(self.drafters))
        if not self.drafters:
            raise ConfigError("method 'cascade' needs option 'drafters', e.g. qwen2.5-coder-0.5b@int8,maxgram")
        if any(isinstance(d, DrafterSpec) and d.kind == MAXGRAM for d in self.drafters[:-1]):
            raise ConfigError("maxgram can only be the last (smallest) drafter of a cascade")
        for i, drafter in enumerate(self.drafters):  # (a spec equal to an earlier one's, or the same object)
            if any(drafter == other if isinstance(drafter, DrafterSpec) else drafter is other
                   for other in self.drafters[:i]):
                raise OptionError("drafters", f"drafters: {named(drafter)} is given twice: each level of a cascade is "
                                  "a drafter of its own, smaller than the one before")
        check_drafters(self)
        if self.k < 1:
            raise OptionError("k", f"k must be >= 1, got {self.k}")
        if not 1 <= self.leniency < math.inf:
            raise OptionError("leniency", f"leniency must be a finite number >= 1, got {self.leniency}")
        if self.leniency != 1 and all(map(model_free, self.drafters[:-1])):  # (before loading: a model may review)
            from speculant.drafters.cascade import unreviewed

            raise unreviewed(self.leniency)
        if self.k_matrix is not None and self.k != DEFAULT_K:
            raise ConfigError("k sizes the default K matrix: give k or k_matrix, not both")
        if self.k_matrix is not None:  # (checked here, so that a bad matrix is refused before anything loads)
            from speculant.drafters.cascade import check_k_matrix, parse_k_matrix

            try:
                if isinstance(self.k_matrix, str):
                    object.__setattr__(self, "k_matrix", parse_k_matrix(self.k_matrix, len(self.drafters)))
                object.__setattr__(self, "k_matrix", check_k_matrix(self.k_matrix, len(self.drafters)))
            except ConfigError as error:
                raise OptionError("k_matrix", str(error)) from None


@register("cascade", CascadeOptions, "cascade speculative drafting over several drafters", chains=True)
def build(request: Request, options: CascadeOptions) -> Any:
    from speculant.decoding.run import ending
    from speculant.decoding.speculative import speculative
    from speculant.drafters.base import Drafter
    from speculant.drafters.cascade import CascadeDrafter, default_k_matrix
    from speculant.drafters.cross_vocab import model_drafter

    levels = []
    for item in options.drafters:
        source = request.session.drafter(item, options.drafter_dtype)
        levels.append(source if isinstance(source, Drafter) else
                      model_drafter(request.session.cache(source), request.target, request.sampling, request.generator,
                                    keep_probs=options.leniency > 1, pairs=request.session.vocab_pairs))
    k_matrix = options.k_matrix or default_k_matrix(levels, options.k)
    cascade = CascadeDrafter(levels, [list(row) for row in k_matrix], options.leniency, request.sampling,
                             request.generator, request.target.eos_token_ids).begin(request.prompt_ids)
    decoder = speculative(request.target, cascade, request.prompt_ids, cascade.max_draft, request.max_new_tokens,
                          request.sampling, request.generator, method="cascade")
    return ending(decoder, [cascade], request.prompt_ids)
