"""The public entry point: `generate(target, prompt, method=..., **options)`."""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set as AbstractSet
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import Any

from speculant.config import RunConfig, SamplingConfig, as_integer, check_sampled, typed
from speculant.decoding.run import Decoder, timed
from speculant.decoding.stats import GenerationStats
from speculant.errors import ConfigError, OptionError, RequestError, SpeculantError
from speculant.methods import Request, get_method
from speculant.methods.registry import check_given_pairs, check_names
from speculant.methods.drafting import check_capabilities, held_drafters, takes_model_free, with_default_drafter
from speculant.models import load_model
from speculant.models.catalog import check_name
from speculant.models.wrappers.biased import Biased, check_bias_type
from speculant.models.wrappers.constrained import Constrained, Constraint, Matcher
from speculant.models.wrappers.logprobs import MAX_TOP, Recorded, TokenLogprob
from speculant.models.base import CausalLM, owner_of
from speculant.sampling import seeded
from speculant.session import Session

DEFAULT_METHOD = "auto"
log = logging.getLogger("speculant")


def method_for(method: str | None, options: dict[str, Any]) -> str:
    """The method to run when none is named: auto, or sd when an option of sd's that auto does not take is given
    (a `drafter`, a `k`; sd then names any other option it does not take). A name neither takes is refused as
    auto's, the default's, naming the methods that take it where any does."""
    if method is not None:
        return method
    beyond = set(options) - {f.name for f in fields(get_method(DEFAULT_METHOD).options)}
    if not (chose := sorted(beyond & {f.name for f in fields(get_method("sd").options)})):
        return DEFAULT_METHOD
    try:  # (a name sd does not take: the refusal says why sd, a method the caller never named)
        check_names(get_method("sd").options, "sd", options)
    except OptionError as error:
        raise OptionError(error.option, f"no method given, and option '{chose[0]}' is sd's: {error}") from None
    return "sd"


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # per token, where asked for


class GenerationStream:
    """Iterates over token ids as they are committed (it is its own iterator: iterating again goes on where the last
    left off, and once it is exhausted, yields nothing); `.logprobs` (where asked for) grows with them, one entry per
    token before it is yielded; `.result` is set once the stream is exhausted. A stream dropped before its end closes
    its decoder (nothing refers back to the stream, so that happens at once)."""

    def __init__(self, decoder: Decoder, tokenizer: Any | None, target: str = "", recorded: Recorded | None = None):
        self._tokens: list[int] = []
        self._timing: Decoder | None = timed(decoder, self._tokens)
        self._tokenizer = tokenizer
        self._target = target
        self._recorded = recorded
        self.logprobs: list[TokenLogprob] | None = [] if recorded is not None else None
        self.result: GenerationResult | None = None
        self._reading = threading.Lock()  # held by the thread taking the next token
        self._closing = False  # closed: ends before the next token (`close`)
        self._reader: int | None = None  # the thread taking the next token

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> int:
        if not self._reading.acquire(blocking=False):  # (a second thread had ended the stream for the first)
            if self._closing:  # (another thread is closing it)
                raise StopIteration
            raise ConfigError("a stream is read by one thread at a time: another thread is taking its next token")
        self._reader = threading.get_ident()
        try:
            return self._next()
        finally:
            self._reader = None
            self._reading.release()

    def _next(self) -> int:
        if self._closing and self._timing is not None:  # (`close` from inside the last token's step)
            self._timing.close()
            self._timing = None
        if self._timing is None:
            raise StopIteration
        try:
            token = next(self._timing)
        except StopIteration as stop:
            self._timing = None
            stats: GenerationStats | None = stop.value
            if stats is None:  # (ended from outside between its steps, at the interpreter's exit: no result)
                raise StopIteration from None
            stats.target = self._target
            self.result = GenerationResult(self._tokens, decode(self._tokenizer, self._tokens), stats, self.logprobs)
            raise StopIteration from None
        except BaseException:
            self._timing = None  # (its error is the generation's end)
            raise
        if self._recorded is not None:
            self.logprobs.append(self._recorded.take(token))
        return token

    def close(self) -> None:
        """End the generation here (its decoder closed: a drafter's thread stopped, what it learned kept); closed
        while another thread takes its next token, once that token is taken (this call waits for it); closed from
        inside a step of its own (a drafter's), before the next."""
        self._closing = True
        if self._reader == threading.get_ident():
            return
        with self._reading:
            if self._timing is not None:
                self._timing.close()
                self._timing = None


def decode(tokenizer: Any | None, token_ids: list[int]) -> str | None:
    return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None


def check_prompt(prompt: Any) -> None:
    """A ConfigError unless `prompt` is a text or a sequence of messages, each text encodable as UTF-8 (a lone
    surrogate, as JSON's escapes can write one, is not): a message's content and its other texts (a role, a name)."""
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (str, Sequence)):
        raise ConfigError(f"the prompt must be a text or a list of messages, not {type(prompt).__name__}")
    if not isinstance(prompt, str) and prompt and all(isinstance(item, int) for item in prompt):
        raise ConfigError("the prompt is a text or a list of messages: token ids go in prompt_ids")
    texts = [prompt] if isinstance(prompt, str) else [v for m in prompt if isinstance(m, dict) for v in m.values()]
    for text in (t for t in texts if isinstance(t, str)):
        try:
            text.encode()
        except UnicodeEncodeError as error:
            raise ConfigError(f"the prompt is not UTF-8 text ({error.reason} at character {error.start})") from None


def encode_prompt(tokenizer: Any | None, prompt: str | Sequence[dict[str, Any]], chat: bool = False,
                  tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a text prompt, optionally wrapped in the tokenizer's chat template, or of a conversation
    (a sequence of {"role", "content"} messages, always templated, with the `tools` the model may call where
    given) for the model to answer."""
    if tokenizer is None:
        raise ConfigError("a text prompt needs a model with a tokenizer, and this one has none that can be read (from "
                          "Python: pass prompt_ids instead)")
    check_prompt(prompt)
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
        except Exception as error:  # noqa: BLE001 - a template is the model's code: whatever else it raises
            raise ConfigError(f"the chat template fails on these messages ({type(error).__name__}: {error})") \
                from None
        if any("name" in message for message in messages) and (unwritten := unwritten_names(tokenizer, messages,
                                                                                             tools)):
            raise RequestError(f"messages.{unwritten[0]}.name", "this model's chat template has no place for this "
                               "participant's name (leave it out, or say it in the content)")
        return list(ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def unwritten_names(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
                    ) -> list[int]:
    """The messages whose participant's `name` the chat template leaves out of the prompt (a template may write
    some roles' names and not others'): each name is rendered as a marker of its own, and looked for."""
    marker = f"speculant-name-{uuid.uuid4().hex}-"
    marked = [{**message, "name": f"{marker}{i}."} if "name" in message else message
              for i, message in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(marked, tools=list(tools) if tools else None, add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - the template is the model's code (it rendered these messages with their names,
        return []  # so a failure on the markers alone says nothing of where it writes them)
    return [i for i, message in enumerate(messages) if "name" in message and f"{marker}{i}." not in text]


def check_request(method: str, logprobs: int | None, logit_bias: Mapping[int, float] | None = None,
                  constraint: Constraint | None = None) -> None:
    """A ConfigError for a count of top log-probabilities out of range, or for options DSI cannot keep: its
    target servers run apart from the decoder, so they neither record nor bias nor mask the target's logits."""
    if logprobs is not None and (as_integer(logprobs) is None or not 0 <= logprobs <= MAX_TOP):
        raise ConfigError(f"logprobs must be an integer in [0, {MAX_TOP}], got {logprobs!r}")
    if logit_bias is not None:
        check_bias_type(logit_bias)
    asked = [name for name, value in (("logprobs", logprobs), ("logit_bias", logit_bias or None),
                                      (constraint.source if constraint else "", constraint)) if value is not None]
    if method == "dsi" and asked:
        raise RequestError(asked[0], f"{', '.join(asked)} not available with dsi: its target servers run apart from "
                           "the decoder")


def decoded_target(target: Any, logprobs: int | None, logit_bias: Mapping[int, float] | None,
                   constraint: Constraint | Matcher | None = None) -> tuple[Any, Recorded | None]:
    """(what the method decodes with, what records its logits or None): the target, wrapped to keep its logits
    for `logprobs` (the target's own), to add `logit_bias` to them, and to mask them to `constraint` (compiled here,
    or given compiled: a server compiles it apart from the thread that runs the forwards), in that order (a bias
    never lets a forbidden token through)."""
    recorded = Recorded(target, int(logprobs)) if logprobs is not None else None
    decoded = recorded if recorded is not None else target
    if logit_bias:
        decoded = Biased(decoded, logit_bias)
    if constraint is not None:
        matcher = constraint if isinstance(constraint, Matcher) else \
            Matcher(constraint, target.tokenizer, target.vocab_size, target.eos_token_ids)
        decoded = Constrained(decoded, matcher)
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

    `target` may be a catalog name (with an optional `@int8`/`@int4` suffix), a Hugging Face id or path, a
    transformers model or a loaded CausalLM; a drafter may be any of those (also `@gguf`, `@lean`),
    `self[@int8|@int4|@skip]`, "maxgram", "suffix", a registered drafter's name, or a Drafter. Greedy at temperature
    0; sampled draft chains (sd, cascade, auto's) are verified as blocks (`verifier`="block", Sun et al. 2024) or
    token by token ("token"), either way lossless. With `stream=True` the returned GenerationStream yields token ids
    as they are committed. A generation ends at the target's last position. With `logprobs` = n (0-20), the result's
    `logprobs` give each token's log-probability under the target and the n likeliest tokens there
    (`models.wrappers.logprobs`; not with "dsi", whose target servers run apart from the decoder). `logit_bias`
    ({token id: -100..100}) is added to the target's logits, which then verify (`models.wrappers.biased`; logprobs
    stay the unbiased target's). `response_format` (OpenAI's: {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"schema": ...}}; or {"type": "grammar", "grammar": LARK}, {"type": "regex", "regex": ...}) masks
    the target's logits to what it allows (`models.wrappers.constrained`); greedy output then equals constrained
    `ar`'s. `session` holds what generations load and learn (drafters and their caches, acceptance, timings): default,
    the target's own (`Session.of`).
    """
    spec = get_method(method_for(method, options))
    run = RunConfig(**typed(RunConfig, {"max_new_tokens": max_new_tokens, "seed": seed}))
    sampling = SamplingConfig(**typed(SamplingConfig, {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                                                       "verifier": verifier}))
    given = [name for name, value in (("top_k", top_k), ("top_p", top_p)) if value is not None]
    given += ["verifier"] if verifier != SamplingConfig().verifier else []
    check_sampled(sampling, given)  # (a seed, which changes nothing greedy either, is taken: programs pass one
    # whatever the temperature)
    spec.check_verifier(given)
    method_options = spec.make_options(options)
    check_given_pairs(method_options, spec.name, options)
    constraint = response_format if isinstance(response_format, Constraint) or response_format is None \
        else Constraint.from_response_format(response_format)
    check_request(spec.name, logprobs, logit_bias, constraint)
    for name, value in (("stream", stream), ("chat", chat)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
    if prompt_ids is None:
        if prompt is not None:
            check_prompt(prompt)
        if not prompt:  # (a text of white space is a prompt, as the server takes it: it encodes to tokens)
            raise ConfigError("the prompt is empty")
    elif prompt is not None:
        raise ConfigError("give either prompt or prompt_ids, not both")
    else:
        if chat:
            raise ConfigError("chat templates a text prompt; prompt_ids are taken as they are (give a prompt, or "
                              "leave chat out)")
        prompt_ids = token_ids(prompt_ids)
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
    if session is not None and not isinstance(session, Session):
        raise ConfigError(f"session must be a speculant Session, got {type(session).__name__}")
    # (a target's name: `@lean`, a drafter's form of a model, is refused)
    check_models([target] if isinstance(target, str) else [], held_drafters(method_options),
                 takes_model_free(method_options))  # `default`: the target's own, or refused before it loads
    method_options = with_default_drafter(method_options, target if isinstance(target, str) else
                                          getattr(target, "name", ""))
    target = load_model(target)
    check_capabilities(method_options, target)
    if prompt_ids is None:
        prompt_ids = encode_prompt(target.tokenizer, prompt, chat)
        if not prompt_ids:  # (a text the tokenizer has no tokens for, a template that renders nothing)
            raise ConfigError("the prompt encodes to no tokens")
    if any(not 0 <= t < target.vocab_size for t in prompt_ids):
        raise ConfigError(f"prompt token ids must lie in [0, {target.vocab_size})")
    room = room_for(target, len(prompt_ids))
    decoded, recorded = decoded_target(target, logprobs, logit_bias, constraint)
    if session is None:
        session = Session.of(target)
    else:
        owner = session.target  # (a ConfigError where the session's target was dropped)
        if owner is not owner_of(target):
            raise ConfigError(f"the session is for {owner.name}, not {target.name}" + (
                " (another instance of it: pass the model load_model returned to both Session and generate)"
                if owner.name == target.name else ""))
    if run.max_new_tokens > room:
        log.warning(f"speculant: {target.name} holds {target.max_positions} positions: at most {room} new tokens after "
                    f"this {len(prompt_ids)}-token prompt, not {run.max_new_tokens}")
    request = Request(decoded, prompt_ids, min(run.max_new_tokens, room), sampling,
                      seeded(target.device, run.seed), session, run.seed)
    kernel = getattr(target, "kernel", "")  # (a CausalLM of the caller's own may name none)
    label = ", ".join(part for part in (getattr(target, "numerics", ""), kernel and f"{kernel} kernel") if part)
    hold = Hold([owner_of(target), *(owner_of(model) for model in held_drafters(method_options)
                                     if isinstance(model, CausalLM))])
    with hold.taken():  # building a decoder may run the target (a machine profile measured): a paused stream ends
        result = GenerationStream(hold.steps(spec.build(request, method_options)), target.tokenizer, label, recorded)
    if stream:
        return result
    with hold.taken():  # a whole generation: another thread's waits for it
        for _ in result:
            pass
    assert result.result is not None
    return result.result


def check_models(targets: Sequence[str], drafters: Sequence[Any] = (), model_free: bool = True) -> None:
    """Refuse, before any model loads, a target or a model drafter (a spec, or its text) that no loader takes: a name
    neither in the catalog, nor a local path, nor a Hugging Face id (`catalog.check_name`). Where drafters without a
    model are taken (`model_free`), a drafter's refusal also names them (a misspelt "maxgram" is read as a model's
    name)."""
    from speculant.drafters.registry import names
    from speculant.drafters.spec import MODEL, DrafterSpec, as_drafter

    for target in targets:
        check_name(target)
    for drafter in map(as_drafter, drafters):
        if isinstance(drafter, DrafterSpec) and drafter.kind == MODEL:
            try:
                check_name(drafter.source)
            except SpeculantError as error:
                raise ConfigError(f"drafter: {error}" + (f"; or a drafter without a model: {', '.join(names())}"
                                                         if model_free else "")) from None


def token_ids(value: Any) -> list[int]:
    """`prompt_ids` as a list of ints: a sequence of integers (Python's, NumPy's) or a 1-D array or tensor of them;
    a ConfigError otherwise (a 2-D batch of one, text, floats, bools)."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) != 1:
        raise ConfigError(f"prompt_ids must be one sequence of token ids, not an array of shape {tuple(shape)}"
                          f"{' (a batch of one: pass its row, ids[0])' if len(shape) == 2 and shape[0] == 1 else ''}")
    items = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(items, Mapping):
        raise ConfigError(f"prompt_ids must be a sequence of token ids, not a {type(value).__name__} (a tokenizer's "
                          "output: pass its ['input_ids'])")
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ConfigError(f"prompt_ids must be a sequence of token ids, not {type(value).__name__}")
    if isinstance(items, AbstractSet):
        raise ConfigError(f"prompt_ids must be a sequence of token ids in order, not a {type(value).__name__}")
    items = list(items)
    ids = [as_integer(item) for item in items]
    if None in ids:
        raise ConfigError(f"prompt_ids must hold integer token ids, not {items[ids.index(None)]!r}")
    return ids


class Hold:
    """A generation's hold on the KV caches it runs: its target's (and its session's drafter caches), which every
    generation on the target shares, and those of drafter models the caller passed in, which another generation may
    run too (as its target or its drafter). Each step runs under the locks of those models, so threads take turns,
    and each model records which generation holds its cache: the one made or stepped last. Taking one over ends a
    paused generation that has started (its decoder closed under its own models' locks: a drafter's thread drafting
    ahead is waited for, what the generation learned is kept), and that stream, resumed, raises instead of decoding
    from the other text. A stream not yet started is not ended: it takes the caches at its first step. A stream
    dropped closes its decoder under the locks. (A model refers to its holder weakly: neither keeps the other
    alive.)"""

    def __init__(self, models: Sequence[Any]):
        self.models = sorted({id(model): model for model in models}.values(), key=id)  # (the order locks are taken in)
        self.locks = [model.__dict__.setdefault("generation_lock", threading.RLock()) for model in self.models]
        self.decoder: Decoder | None = None  # once its first step ran
        self.ended = False  # its decoder closed by a generation that took a cache over (it holds the others no more)
        LIVE.add(self)

    def locked(self, *others: Hold) -> AbstractContextManager[Any]:
        """Under the locks of this generation's models and of `others`', taken in one order (by id), so that two
        generations that share a model never wait on each other crosswise."""
        if not others:  # (every step: the locks already in that order; one model's alone)
            return self.locks[0] if len(self.locks) == 1 else all_of(self.locks)
        locks = {id(model): lock for hold in (self, *others) for model, lock in zip(hold.models, hold.locks)}
        return all_of([locks[key] for key in sorted(locks)])

    @contextmanager
    def taken(self) -> Iterator[None]:
        """Under the locks, holding every model's cache: the paused generations that held one end first, under
        their models' locks taken with these (a generation that takes one over meanwhile is seen on the next try)."""
        if shared := [m.name for m in self.models if any(m is o for held in STEPPING.get() for o in held.models)]:
            raise ConfigError(f"a generation on {', '.join(shared)} was asked for from inside a step of another on the "
                              "same model: a model's KV cache runs one generation at a time; load another instance "
                              "of it")
        others: list[Hold] = []
        while True:
            with self.locked(*others):
                holders = [held for held in map(holder, self.models)
                           if held is not None and held is not self and not held.ended]
                if all(any(held is other for other in others) for held in holders):
                    for held in holders:
                        held.end()
                    for model in self.models:
                        model.__dict__["generation"] = weakref.ref(self)
                    yield
                    return
            others = holders

    def end(self) -> None:
        """End the generation where it is (under the locks): its decoder closed, its threads stopped."""
        with self.locked():
            if self.decoder is not None:
                self.decoder.close()
                self.ended = True

    def steps(self, decoder: Decoder) -> Decoder:
        try:
            while True:
                with self.taken() if self.decoder is None else self.locked():
                    if self.decoder is None:
                        self.decoder = decoder
                    elif lost := next((model for model in self.models if holder(model) is not self), None):
                        raise ConfigError(f"another generation was made or ran on {lost.name} since this stream's "
                                          "last token (its KV cache holds that text now): finish or close a stream "
                                          "before the next generation on the same model, or load another instance "
                                          "of it")
                    outer = STEPPING.set((*STEPPING.get(), self))
                    try:
                        token = next(decoder)
                    except StopIteration as stop:
                        return stop.value
                    finally:
                        STEPPING.reset(outer)
                yield token
        finally:
            with self.locked():
                decoder.close()


@contextmanager
def all_of(locks: Sequence[Any]) -> Iterator[None]:
    """Under each of `locks`, taken in their order."""
    with ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield


def holder(model: Any) -> Hold | None:
    """The generation that holds `model`'s cache (None: none alive)."""
    held = model.__dict__.get("generation")
    return held() if held is not None else None


# The generations whose steps the code running now is part of, outermost first: a drafter's `propose`, on the step's
# thread or on one the step started (a DSI drafter's, which copies the context), and a generation that runs in it. A
# generation it asks for on a model one of those runs would wait for that step's locks, or end it from inside:
# `Hold.taken` refuses it.
STEPPING: contextvars.ContextVar[tuple[Hold, ...]] = contextvars.ContextVar("speculant_stepping", default=())
LIVE: weakref.WeakSet[Hold] = weakref.WeakSet()  # the generations alive: those paused end at the interpreter's
# exit, before it tears down (a DSI generation's drafter and server threads, left running in torch, aborted it)
atexit.register(lambda: [hold.end() for hold in list(LIVE)])
