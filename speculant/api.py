"""The public entry point: `generate(target, prompt, method=..., **options)`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from speculant.config import RunConfig, SamplingConfig
from speculant.decoding.run import Decoder, timed
from speculant.decoding.stats import GenerationStats
from speculant.errors import ConfigError, RequestError
from speculant.methods import Request, get_method
from speculant.methods.drafting import check_capabilities
from speculant.models import load_model
from speculant.models.wrappers.biased import Biased
from speculant.models.wrappers.constrained import Constrained, Constraint, Matcher
from speculant.models.wrappers.logprobs import MAX_TOP, Recorded, TokenLogprob
from speculant.models.base import owner_of
from speculant.sampling import seeded
from speculant.session import Session

DEFAULT_METHOD = "auto"


def method_for(method: str | None, options: dict[str, Any]) -> str:
    """The method to run when none is named: auto, or sd when an option auto does not take is given
    (a `drafter`, a `k`; sd then names any option it does not take either)."""
    if method is not None:
        return method
    return DEFAULT_METHOD if set(options) <= {f.name for f in fields(get_method(DEFAULT_METHOD).options)} else "sd"


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # per token, where asked for


class GenerationStream:
    """Iterates over token ids as they are committed; `.logprobs` (where asked for) grows with them, one entry
    per token before it is yielded; `.result` is set once the stream is exhausted."""

    def __init__(self, decoder: Decoder, tokenizer: Any | None, target: str = "", recorded: Recorded | None = None):
        self._decoder = decoder
        self._tokenizer = tokenizer
        self._target = target
        self._recorded = recorded
        self.logprobs: list[TokenLogprob] | None = [] if recorded is not None else None
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[int]:
        tokens: list[int] = []
        timing = timed(self._decoder, tokens)
        while True:
            try:
                token = next(timing)
            except StopIteration as stop:
                stats = stop.value
                break
            if self._recorded is not None:
                self.logprobs.append(self._recorded.take(token))
            yield token
        stats.target = self._target
        self.result = GenerationResult(tokens, decode(self._tokenizer, tokens), stats, self.logprobs)


def decode(tokenizer: Any | None, token_ids: list[int]) -> str | None:
    return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None


def encode_prompt(tokenizer: Any | None, prompt: str | Sequence[dict[str, Any]], chat: bool = False,
                  tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a text prompt, optionally wrapped in the tokenizer's chat template, or of a conversation
    (a sequence of {"role", "content"} messages, always templated, with the `tools` the model may call where
    given) for the model to answer."""
    if tokenizer is None:
        raise ConfigError("a text prompt needs a model with a tokenizer; pass prompt_ids instead")
    if chat or not isinstance(prompt, str):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this tokenizer has no chat template")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
            raise ConfigError('a conversation is a list of {"role": str, "content": str} messages')
        from jinja2 import TemplateError  # (transformers' chat templates run on jinja2)

        try:
            ids = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None,
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        except TemplateError as error:  # (a template that refuses a role or an order of messages)
            raise ConfigError(f"the chat template refuses these messages: {error}") from None
        return list(ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def check_request(method: str, logprobs: int | None, logit_bias: Mapping[int, float] | None = None,
                  constraint: Constraint | None = None) -> None:
    """A ConfigError for a count of top log-probabilities out of range, or for options DSI cannot keep: its
    target servers run apart from the decoder, so they neither record nor bias nor mask the target's logits."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP):
        raise ConfigError(f"logprobs must be an integer in [0, {MAX_TOP}], got {logprobs!r}")
    asked = [name for name, value in (("logprobs", logprobs), ("logit_bias", logit_bias or None),
                                      ("response_format", constraint)) if value is not None]
    if method == "dsi" and asked:
        raise RequestError(asked[0], f"{', '.join(asked)} not available with dsi: its target servers run apart from "
                           "the decoder")


def decoded_target(target: Any, logprobs: int | None, logit_bias: Mapping[int, float] | None,
                   constraint: Constraint | None = None) -> tuple[Any, Recorded | None]:
    """(what the method decodes with, what records its logits or None): the target, wrapped to keep its logits
    for `logprobs` (the target's own), to add `logit_bias` to them, and to mask them to `constraint`, in that
    order (a bias never lets a forbidden token through)."""
    recorded = Recorded(target, logprobs) if logprobs is not None else None
    decoded = recorded if recorded is not None else target
    if logit_bias:
        decoded = Biased(decoded, logit_bias)
    if constraint is not None:
        decoded = Constrained(decoded, Matcher(constraint, target.tokenizer, target.vocab_size))
    return decoded, recorded


def room_for(target: Any, prompt_len: int) -> int:
    """How many new tokens fit after a prompt within the target's positions (a generation stops there)."""
    limit = target.max_positions
    if limit is None:
        return 1 << 30
    if prompt_len >= limit:
        raise ConfigError(f"the prompt has {prompt_len} tokens but {target.name} holds at most {limit} positions")
    return limit - prompt_len


def generate(
    target: Any,
    prompt: str | Sequence[dict[str, str]] | None = None,
    *,
    prompt_ids: list[int] | None = None,
    method: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    verifier: str = "block",
    seed: int | None = None,
    stream: bool = False,
    chat: bool = False,
    logprobs: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    response_format: Mapping[str, Any] | Constraint | None = None,
    session: Session | None = None,
    **options: Any,
) -> GenerationResult | GenerationStream:
    """Generate from `prompt` (text, or a conversation: {"role", "content"} messages, chat-templated) or
    `prompt_ids` with a registered method (`speculant.methods`): "auto"
    (the default; "sd" when the options given are sd's, e.g. a `drafter`), "ar", "sd", "tree", "cascade"
    or "dsi". `options`
    are the method's own (e.g. sd: `drafter`, `k`, `draft_confidence`); a name the method does not take
    is an error naming the methods that do.

    `target` may be a catalog name (with an optional `@int8`/`@int4` suffix), a Hugging Face id or path,
    a transformers model or a loaded CausalLM; a drafter may be any of those, `self[@int8|@int4]`,
    "maxgram" or a Drafter. Greedy at temperature 0; sampled drafts are verified as blocks (`verifier`="block", Sun et
    al. 2024) or token by token ("token"), either way lossless. With `stream=True` the returned GenerationStream
    yields token ids as they are committed. A generation ends at the target's last position. With `logprobs`
    = n (0-20), the result's `logprobs` give each token's log-probability under the target and the n likeliest
    tokens there (`models.wrappers.logprobs`; not with "dsi", whose target servers are other processes). `logit_bias`
    ({token id: -100..100}) is added to the target's logits, which then verify (`models.wrappers.biased`; logprobs
    stay the unbiased target's). `response_format` (OpenAI's: {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"schema": ...}}; or {"type": "grammar", "grammar": LARK}, {"type": "regex", "regex": ...})
    masks the target's logits to what it allows (`models.wrappers.constrained`); greedy output then equals constrained
    `ar`'s. `session` holds what generations load and learn (drafters and their caches, acceptance, timings):
    default, the target's own (`Session.of`).
    """
    spec = get_method(method_for(method, options))
    run = RunConfig(max_new_tokens=max_new_tokens, seed=seed)
    sampling = SamplingConfig(temperature, top_k, top_p, verifier)
    method_options = spec.make_options(options)
    constraint = response_format if isinstance(response_format, Constraint) or response_format is None \
        else Constraint.from_response_format(response_format)
    check_request(spec.name, logprobs, logit_bias, constraint)
    target = load_model(target)
    check_capabilities(method_options, target)
    if prompt_ids is None:
        if prompt is None or not (prompt.strip() if isinstance(prompt, str) else prompt):
            raise ConfigError("the prompt is empty")
        prompt_ids = encode_prompt(target.tokenizer, prompt, chat)
    elif prompt is not None:
        raise ConfigError("give either prompt or prompt_ids, not both")
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    if any(not 0 <= t < target.vocab_size for t in prompt_ids):
        raise ConfigError(f"prompt token ids must lie in [0, {target.vocab_size})")
    room = room_for(target, len(prompt_ids))
    decoded, recorded = decoded_target(target, logprobs, logit_bias, constraint)
    if session is None:
        session = Session.of(target)
    elif session.target is not owner_of(target):
        raise ConfigError(f"the session is for {session.target.name}, not {target.name}")
    request = Request(decoded, prompt_ids, min(run.max_new_tokens, room), sampling,
                      seeded(target.device, seed), session, seed)
    label = f"{getattr(target, 'numerics', '')}, {getattr(target, 'kernel', '')} kernel".strip(", ")
    result = GenerationStream(spec.build(request, method_options), target.tokenizer, label, recorded)
    if stream:
        return result
    for _ in result:
        pass
    assert result.result is not None
    return result.result
