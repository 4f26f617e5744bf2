"""The public entry point: `generate(target, prompt, drafter=..., method=...)`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculant.analysis.profile import LatencyProfile
from speculant.config import DecodeConfig, SamplingConfig
from speculant.decoding.autoregressive import autoregressive
from speculant.decoding.dsi.engine import dsi
from speculant.decoding.dsi.executors import ServerSpec, make_executor, replica_factory
from speculant.decoding.dsi.plan import measure_step, plan
from speculant.decoding.dsi.twin import Latency, PaddedModel
from speculant.decoding.run import Decoder, timed
from speculant.decoding.speculative import speculative
from speculant.decoding.tree import tree_speculative
from speculant.decoding.tree_shape import tree_shape
from speculant.decoding.stats import GenerationStats
from speculant.drafters.base import Drafter
from speculant.drafters.cascade import CascadeDrafter, default_k_matrix, parse_k_matrix
from speculant.drafters.maxgram import NAME as MAXGRAM
from speculant.drafters.maxgram import MaxGramDrafter, load_bigram
from speculant.drafters.model import ModelDrafter
from speculant.drafters.tree import TreeDrafter
from speculant.errors import ConfigError, IncompatibleModels
from speculant.models import CausalLM, HFCausalLM, dtype_name, load_model, quantized_copy, resolve_device, split_quant


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: GenerationStats


class GenerationStream:
    """Iterates over token ids as they are committed; `.result` is set once the stream is exhausted."""

    def __init__(self, decoder: Decoder, tokenizer: Any | None):
        self._decoder = decoder
        self._tokenizer = tokenizer
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[int]:
        tokens: list[int] = []
        stats = yield from timed(self._decoder, tokens)
        self.result = GenerationResult(tokens, decode(self._tokenizer, tokens), stats)


def decode(tokenizer: Any | None, token_ids: list[int]) -> str | None:
    return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None


def encode_prompt(tokenizer: Any | None, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a text prompt, optionally wrapped in the tokenizer's chat template."""
    if tokenizer is None:
        raise ConfigError("a text prompt needs a model with a tokenizer; pass prompt_ids instead")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def check_compatible(target: CausalLM, drafter: CausalLM) -> None:
    """A model drafter must share the target's vocabulary token for token."""
    same_vocab = target.vocab_size == drafter.vocab_size
    if same_vocab and target.tokenizer is not None and drafter.tokenizer is not None:
        same_vocab = target.tokenizer.get_vocab() == drafter.tokenizer.get_vocab()
    if not same_vocab:
        raise IncompatibleModels(
            f"drafter '{drafter.name}' uses a different tokenizer than target '{target.name}'; "
            "drafters with another vocabulary are not supported yet"
        )


def load_drafter(drafter: Any, target: CausalLM, dtype: str | None = None) -> CausalLM | Drafter:
    """What drafts for `target`: a Drafter as given; "maxgram" (prompt lookup with the bigram table of
    the target's tokenizer); `self@int8` / `self@int4` (the target's own weights quantized); or any
    model `load_model` accepts, loaded on the target's device in `dtype` (default: the target's)."""
    if isinstance(drafter, Drafter):
        return drafter
    if drafter == MAXGRAM:
        tokenizer = target.tokenizer
        return MaxGramDrafter(load_bigram(tokenizer, target.vocab_size) if tokenizer is not None else None)
    if isinstance(drafter, str) and drafter.startswith("self@"):
        if not isinstance(target, HFCausalLM):
            raise ConfigError("self@quant drafting needs a transformers target")
        return quantized_copy(target, split_quant(drafter)[1])
    model = load_model(drafter, dtype=dtype or dtype_name(target.dtype), device=str(target.device))
    if model is target:  # a model drafting for itself needs a KV cache of its own
        if not isinstance(target, HFCausalLM):
            raise ConfigError("pass a separate model instance as drafter for this backend")
        model = target.share()
    check_compatible(target, model)
    return model


def make_drafter(drafter: Any, target: CausalLM, sampling: SamplingConfig, generator: torch.Generator | None,
                 draft_confidence: float = 0.0) -> Drafter:
    """A Drafter for one generation: models from `load_drafter` get a ModelDrafter around them."""
    source = load_drafter(drafter, target)
    if not isinstance(source, Drafter):
        return ModelDrafter(source, sampling, generator, draft_confidence=draft_confidence)
    if draft_confidence:
        raise ConfigError(f"draft_confidence needs a model drafter, not {type(source).__name__}")
    return source


def make_cascade(drafters: list[Any], target: CausalLM, k_matrix: list[list[int]] | str | None, k: int,
                 leniency: float, sampling: SamplingConfig, generator: torch.Generator | None) -> CascadeDrafter:
    """A CascadeDrafter over `drafters` (largest first; models, "maxgram" last), K from `k_matrix` (a
    matrix, or text like "4,2;0,6") or `default_k_matrix`."""
    if not drafters:
        raise ConfigError("method 'cascade' needs drafters, e.g. ['qwen2.5-coder-0.5b', 'maxgram']")
    levels = []
    for item in drafters:
        source = load_drafter(item, target)
        if isinstance(source, Drafter) and not isinstance(source, (MaxGramDrafter, ModelDrafter)):
            raise ConfigError(f"cascade levels are models or 'maxgram', not {type(source).__name__}")
        levels.append(source if isinstance(source, Drafter) else
                      ModelDrafter(source, sampling, generator, keep_probs=leniency > 1))
    if k_matrix is None:
        k_matrix = default_k_matrix(levels, k)
    elif isinstance(k_matrix, str):
        k_matrix = parse_k_matrix(k_matrix, len(levels))
    return CascadeDrafter(levels, [list(row) for row in k_matrix], leniency, sampling, generator)


def seeded(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def make_dsi(target: CausalLM, drafter: Any, prompt_ids: list[int], config: DecodeConfig, sampling: SamplingConfig,
             generator: torch.Generator, target_devices: list[str] | None, twin: tuple[Latency, Latency] | None,
             ray_address: str | None, pool: Any = None) -> Decoder:
    """DSI over `config.servers` target servers on `target_devices` (default: the target's device), run by
    `config.executor`; with `twin` (target, drafter latencies) every forward is padded to them. The lookahead
    is planned from the twin's latencies, or from one measured forward of each model, unless given. `pool`,
    a started executor from `decoding.dsi.executors`, runs the servers instead and stays open."""
    source = load_drafter(drafter, target)
    if isinstance(source, Drafter):
        draft_source, drafter_s = source, 0.0  # Max-Gram and other model-free drafters cost next to nothing
    else:
        model = source if twin is None else PaddedModel(source, twin[1])
        draft_generator = seeded(target.device, None if config.seed is None else config.seed + 1)
        draft_source, drafter_s = ModelDrafter(model, sampling, draft_generator), None
    devices = target_devices or [str(target.device)] * config.servers
    if len(devices) != config.servers:
        raise ConfigError(f"{len(devices)} target devices given for {config.servers} servers")
    for device in devices:
        resolve_device(device)
    if twin is not None:
        target_s, drafter_s = twin[0].step_s, twin[1].step_s
    elif config.lookahead is None:
        target_s = measure_step(target, prompt_ids)
        drafter_s = measure_step(source, prompt_ids) if drafter_s is None else drafter_s
    else:
        target_s = drafter_s = None
    chosen = plan(config.servers, config.lookahead, target_s, drafter_s)
    if pool is not None:  # servers already running, kept for the next generation
        if pool.spec.sampling != sampling or len(pool.spec.devices) != config.servers:
            raise ConfigError("the given executor's servers were built for other sampling settings or server count")
        return dsi(pool, draft_source, prompt_ids, config.max_new_tokens, chosen.lookahead, sampling, generator,
                   target.eos_token_ids, close_executor=False)
    spec = ServerSpec(replica_factory(target), devices, sampling, twin[0] if twin else None)
    return dsi(make_executor(config.executor, spec, ray_address), draft_source, prompt_ids, config.max_new_tokens,
               chosen.lookahead, sampling, generator, target.eos_token_ids)


def generate(
    target: Any,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    drafter: Any = None,
    method: str = "sd",
    k: int = 4,
    draft_confidence: float = 0.0,
    depth: int | str = 4,
    width: int | str = 4,
    drafters: list[Any] | None = None,
    k_matrix: list[list[int]] | str | None = None,
    leniency: float = 1.0,
    verify_width: int | str | None = None,
    target_profile: LatencyProfile | str | Path | None = None,
    servers: int = 1,
    lookahead: int | None = None,
    executor: Any = "thread",
    target_devices: list[str] | None = None,
    twin: tuple[Latency, Latency] | None = None,
    ray_address: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stream: bool = False,
    chat: bool = False,
) -> GenerationResult | GenerationStream:
    """Generate with `method` "ar" (autoregressive), "sd" (speculative decoding/sampling: `k` drafts per
    step, fewer once a model drafter's probability of its own draft falls below `draft_confidence`), "tree"
    (token-tree speculation: `depth` drafting steps of `width` nodes each, at most `verify_width` of them
    verified; when `target_profile`, a `speculant profile` JSON of the target, gives its T(W), the
    latency-aware objective decides how deep (up to `depth`) to draft and how many nodes to verify;
    each of the three may be "auto", T(W) then being measured when no profile is given) or
    "cascade" (cascade
    speculative drafting over `drafters`, largest first, "maxgram" last, shaped by the K matrix
    `k_matrix`, with inner reviews relaxed by `leniency`) or "dsi" (distributed speculative inference:
    `servers` target servers verify in parallel while the drafter keeps drafting, `lookahead` drafts per
    job (planned when None), servers run by `executor` "thread", "process" or "ray" (`ray_address` joins a
    cluster) on `target_devices`; `twin` = (target, drafter) Latency pads every forward: the latency twin).

    `target` and `drafter` may be catalog names (with an optional `@int8`/`@int4` suffix), Hugging
    Face ids or paths, transformers models or loaded CausalLMs; `drafter` may also be `self@int8` /
    `self@int4` (the target's weights quantized), "maxgram" (prompt lookup) or any Drafter. Greedy at temperature 0. With
    `stream=True` the returned GenerationStream yields token ids as they are committed.
    """
    sampling = SamplingConfig(temperature, top_k, top_p)
    config = DecodeConfig(method=method, k=k, draft_confidence=draft_confidence, depth=depth, width=width,
                          verify_width=verify_width, leniency=leniency, servers=servers, lookahead=lookahead,
                          max_new_tokens=max_new_tokens, seed=seed,
                          executor=executor if isinstance(executor, str) else executor.name)
    target = load_model(target)
    if prompt_ids is None:
        if prompt is None or not prompt.strip():
            raise ConfigError("the prompt is empty")
        prompt_ids = encode_prompt(target.tokenizer, prompt, chat)
    elif prompt is not None:
        raise ConfigError("give either prompt or prompt_ids, not both")
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    if any(not 0 <= t < target.vocab_size for t in prompt_ids):
        raise ConfigError(f"prompt token ids must lie in [0, {target.vocab_size})")
    generator = seeded(target.device, seed)

    if config.method != "cascade" and (drafters is not None or k_matrix is not None or leniency != 1):
        raise ConfigError("drafters, k_matrix and leniency apply to method 'cascade' only")
    if config.method != "tree" and (verify_width is not None or target_profile is not None):
        raise ConfigError("verify_width and target_profile apply to method 'tree' only")
    if config.method != "dsi" and any((target_devices, twin, ray_address)):
        raise ConfigError("target_devices, twin and ray_address apply to method 'dsi' only")
    if config.method == "cascade":
        if drafter is not None:
            drafters = [drafter, *(drafters or [])]
        cascade = make_cascade(drafters or [], target, k_matrix, config.k, config.leniency, sampling, generator)
        decoder = speculative(target, cascade, prompt_ids, cascade.max_draft, config.max_new_tokens, sampling,
                              generator, method="cascade")
    elif config.method == "ar":
        if drafter is not None:
            raise ConfigError("method 'ar' takes no drafter")
        decoder = autoregressive(target, prompt_ids, config.max_new_tokens, sampling, generator)
    elif drafter is None:
        raise ConfigError(f"method '{config.method}' needs a drafter")
    elif config.method == "dsi":
        pool = None if isinstance(executor, str) else executor
        decoder = make_dsi(target, drafter, prompt_ids, config, sampling, generator, target_devices, twin, ray_address,
                           pool)
    elif config.method == "tree":
        model = load_drafter(drafter, target)
        if isinstance(model, Drafter):
            raise ConfigError("method 'tree' needs a model drafter")
        profile = target_profile
        if profile is not None and not isinstance(profile, LatencyProfile):
            profile = LatencyProfile.load(profile)
        shape = tree_shape(target, model, prompt_ids, config.depth, config.width, config.verify_width, profile)
        decoder = tree_speculative(target, TreeDrafter(model), prompt_ids, shape.depth, shape.width,
                                   config.max_new_tokens, sampling, generator, shape.verify_width, shape.cost)
    else:
        draft_source = make_drafter(drafter, target, sampling, generator, config.draft_confidence)
        decoder = speculative(target, draft_source, prompt_ids, config.k, config.max_new_tokens, sampling, generator)

    result = GenerationStream(decoder, target.tokenizer)
    if stream:
        return result
    for _ in result:
        pass
    assert result.result is not None
    return result.result
