"""Peers run in the same process as speculant's methods: transformers `generate()` plain (`hf-ar`), with
an `assistant_model` (`hf-assisted`, assisted generation) and with `prompt_lookup_num_tokens` (`hf-pld`,
prompt lookup), on the same weights as transformers builds the model (library matmuls and SDPA, not
speculant's batch-invariant kernels); and llama-cpp-python's own `Llama.generate` loop on the target's GGUF
(`llamacpp-ar`) and with its prompt-lookup draft model (`llamacpp-pld`), with the context settings of
speculant's llama.cpp backend (threads, batch, flash attention, bf16 KV cache), so that plain decoding
gives the same tokens; and llama.cpp's own tools built for this machine (`llamacpp-cli-*`,
`speculant.bench.llamacpp_cli`). Their options are dataclasses like a method's; what they do not report is
left unset."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

from speculant.bench.llamacpp_cli import CLI_PEERS, check_draft_length, cli_generate, schema_args
from speculant.config import SamplingConfig, option
from speculant.errors import ConfigError
from speculant.methods.drafting import DrafterOptions

_plain: WeakKeyDictionary = WeakKeyDictionary()  # loaded model -> its transformers form, built once


def plain(model: Any) -> Any:
    """The transformers module of a loaded model as transformers itself would run it."""
    from speculant.models.numerics.exact import plain_copy

    if model not in _plain:
        _plain[model] = plain_copy(model.model)
    return _plain[model]


@dataclass(frozen=True)
class HFAROptions:
    pass


@dataclass(frozen=True)
class HFAssistedOptions(DrafterOptions):
    MODEL_ONLY = "hf-assisted"
    k: int | None = option(None, "fix num_assistant_tokens (default: transformers' heuristic schedule)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_draft_length(self.k)


@dataclass(frozen=True)
class HFPLDOptions:
    k: int | None = option(None, "prompt_lookup_num_tokens (default: 10)")

    def __post_init__(self) -> None:
        check_draft_length(self.k)


PEERS: dict[str, type] = {"hf-ar": HFAROptions, "hf-assisted": HFAssistedOptions, "hf-pld": HFPLDOptions,
                          "llamacpp-ar": HFAROptions, "llamacpp-pld": HFPLDOptions, **CLI_PEERS}
LLAMACPP_PEERS = ("llamacpp-ar", "llamacpp-pld", *CLI_PEERS)
HF_PEERS = ("hf-ar", "hf-assisted", "hf-pld")  # transformers' generate: a target on the transformers backend
_llama: WeakKeyDictionary = WeakKeyDictionary()  # (llama.cpp target, method) -> its llama_cpp.Llama


def check_response_format(method: str, response_format: dict[str, Any] | None) -> None:
    """A ConfigError where the peer cannot follow `response_format` (only llama.cpp's own tool follows JSON)."""
    if method in CLI_PEERS:
        schema_args(method, response_format)
    elif response_format is not None:
        raise ConfigError(f"{method} cannot follow a prompt's response_format (bench it with --ignore-response-format)")


def peer_generate(method: str, target: Any, prompt_ids: list[int], max_new_tokens: int, options: Any,
                  sampling: SamplingConfig, seed: int, response_format: dict[str, Any] | None = None) -> Any:
    check_response_format(method, response_format)
    if method in CLI_PEERS:
        return cli_generate(method, target, prompt_ids, max_new_tokens, options, sampling, seed, response_format)
    if method in LLAMACPP_PEERS:
        return llamacpp_generate(method, target, prompt_ids, max_new_tokens, options, sampling, seed)
    return hf_generate(method, target, prompt_ids, max_new_tokens, options, sampling, seed)


def llamacpp_generate(method: str, target: Any, prompt_ids: list[int], max_new_tokens: int, options: Any,
                      sampling: SamplingConfig, seed: int) -> Any:
    """One generation by llama-cpp-python's `Llama.generate` on the target's GGUF, timed like speculant's."""
    from speculant.api import GenerationResult, decode
    from speculant.decoding.stats import GenerationStats
    from speculant.models.backends import llamacpp

    if not isinstance(target, llamacpp.LlamaCppCausalLM):
        raise ConfigError(f"{method} needs a llama.cpp target (backend=llamacpp)")
    per_target = _llama.setdefault(target, {})
    if method not in per_target:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=options.k or 10) if method == "llamacpp-pld" else None
        per_target[method] = Llama(str(target.weights.path), n_ctx=target.max_positions, n_batch=llamacpp.N_BATCH,
                                   n_ubatch=llamacpp.N_BATCH, n_threads=target.threads,
                                   n_threads_batch=target.threads, flash_attn=True, type_k=llamacpp.KV_TYPE,
                                   type_v=llamacpp.KV_TYPE, draft_model=draft, verbose=False)
    llm = per_target[method]
    llm.reset()  # no reuse of an earlier prompt's cache
    if sampling.greedy:
        knobs = dict(temp=0.0)
    else:
        llm.set_seed(seed)
        knobs = dict(temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0, min_p=0.0)
    tokens: list[int] = []
    start = time.perf_counter()
    first = None
    for token in llm.generate(prompt_ids, reset=True, **knobs):
        first = first or time.perf_counter()
        tokens.append(int(token))
        if token in target.eos_token_ids or len(tokens) >= max_new_tokens:
            break
    wall = time.perf_counter() - start
    stats = GenerationStats(method=method, new_tokens=len(tokens), wall_s=wall, ttft_s=(first or start) - start)
    return GenerationResult(tokens, decode(target.tokenizer, tokens), stats)


def hf_generate(method: str, target: Any, prompt_ids: list[int], max_new_tokens: int, options: Any,
                sampling: SamplingConfig, seed: int) -> Any:
    """One peer generation, timed around the whole call, prefill included, like speculant's own methods.
    `options.drafter` (hf-assisted) must be a loaded transformers-backed model."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    from speculant.api import GenerationResult, decode
    from speculant.decoding.stats import GenerationStats
    from speculant.models import HFCausalLM

    class FirstTokenClock(BaseStreamer):
        """Records when `generate()` streams its first new token (its first `put` is the prompt)."""

        def __init__(self) -> None:
            self.puts = 0
            self.first: float | None = None

        def put(self, value: torch.Tensor) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    assistant = getattr(options, "drafter", None)
    if not isinstance(target, HFCausalLM) or (assistant is not None and not isinstance(assistant, HFCausalLM)):
        raise ConfigError(f"{method} needs transformers models")
    kwargs: dict = {}
    if method == "hf-assisted":
        kwargs["assistant_model"] = plain(assistant)
        if options.k is not None:
            kwargs.update(num_assistant_tokens=options.k, num_assistant_tokens_schedule="constant")
    elif method == "hf-pld":
        kwargs["prompt_lookup_num_tokens"] = options.k or 10
    if not sampling.greedy:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                      top_p=sampling.top_p or 1.0)
        torch.manual_seed(seed)
    else:
        kwargs["do_sample"] = False
    eos = sorted(target.eos_token_ids)
    input_ids = torch.tensor([prompt_ids], device=target.device)
    clock = FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        output = plain(target).generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, streamer=clock, **kwargs)
    wall = time.perf_counter() - start
    tokens = output[0, len(prompt_ids):].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in target.eos_token_ids), None)
    tokens = tokens if stop is None else tokens[: stop + 1]
    stats = GenerationStats(method=method, new_tokens=len(tokens), wall_s=wall,
                            ttft_s=(clock.first or time.perf_counter()) - start)
    return GenerationResult(tokens, decode(target.tokenizer, tokens), stats)
