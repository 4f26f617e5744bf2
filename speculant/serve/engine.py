"""The serving engine: requests decoded concurrently with any registered method, forwards batched.

The engine loads the target and its method's drafters once. Each request decodes on the `Batcher`'s
worker, on `Row` handles of those models (a KV cache per request, forwards batched with the other
requests'), so every method and drafter works unchanged and a request's greedy output is what it would
be alone. At most `max_batch` requests decode at once; up to `max_queue` more wait for a row, the rest
are refused. DSI requests decode apart, each on a thread of its own (`APART`), at most `max_batch` at once: they
never wait, so the rest are refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any

from speculant.api import check_request, decoded_target
from speculant.config import SamplingConfig, ServeConfig, default_of
from speculant.drafters.spec import MAXGRAM, SELF, DrafterSpec
from speculant.errors import ConfigError, OptionError
from speculant.methods import Request, get_method
from speculant.methods.auto import with_own_drafters
from speculant.methods.drafting import check_capabilities, drafters_by_field, with_default_drafter, with_drafters
from speculant.models.base import Call, CausalLM, Delegating, Interrupted
from speculant.models.wrappers.constrained import Matcher
from speculant.models.wrappers.logprobs import TokenLogprob
from speculant.prefixes import PrefixCache
from speculant.sampling import seeded
from speculant.serve.batcher import CLOSED, Batcher, Row, WorkerStopped
from speculant.serve.metrics import Metrics
from speculant.serve.text import TextStream
from speculant.session import Session


def as_text(value: Any) -> str:
    """A JSON value of a request's option as the text a flag would hold (lists comma-separated)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


# Methods whose requests decode on a thread of their own, not among the batched ones: DSI's drafter waits on its
# target servers' threads (Timor et al. 2025), which on the batcher's one worker would stall every other request.
APART = frozenset({"dsi"})


class QueueFull(Exception):
    """More requests wait than the engine's queue holds."""


@dataclass(frozen=True)
class ServeJob:
    """One generation a client asked for (already validated against the target)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None = None
    stops: tuple[str, ...] = ()
    method: str | None = None  # None: the server's method
    options: Mapping[str, Any] = field(default_factory=dict)  # the method's options, overriding the server's
    logprobs: int | None = None  # None: none; n: each token's log-probability and its n likeliest alternatives
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # added to the target's logits
    constraint: Matcher | None = None  # what the output must match (structured output), compiled (off the forwards'
    # thread: the request's handler compiles it)
    calls: str | None = None  # where the reply may call tools: a call's opening tag (no stop string cuts a call)


@dataclass
class Outcome:
    text: str
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    speculative: dict[str, Any]
    logprobs: list[TokenLogprob] | None = None


class Steps:
    """What speculation did for one request, read off its target forwards: each forward after the prefill
    verifies its draft tokens (a chain's W - 1, a tree's nodes below its root), and the tokens committed before
    the next forward are the accepted ones plus the target's own. Counted outside the decoder, so that it holds
    for every method, and for a generation cut short by a stop string or a disconnect."""

    def __init__(self, metrics: Metrics | None, on_step: Callable[[dict[str, Any]], None] | None = None,
                 verified: bool = True):
        """`verified`: the target's verifications run on the rows counted here (not where a method verifies on
        servers of its own, DSI's: what those did is unknown here, null in the summary rather than zero, and left
        out of the acceptance metrics)."""
        self.metrics, self.on_step, self.verified = metrics, on_step, verified
        self.forwards = self.drafted = self.accepted = 0
        self.call: Call | None = None  # the open step's verification (None: none yet, or the prefill)
        self.drafter_forwards = 0
        self.tokens: list[int] = []  # the open step's committed tokens
        self.texts: list[str] = []  # the reply's text each of them made final (`on_token`)
        self.drafter: str | None = None  # the model drafter that drafted what the open step verifies
        self.drafting: str | None = None  # the model drafter that ran since the last target forward

    def on_target(self, call: Call) -> None:
        if call.continues:  # a later part of the prefill counted already
            return
        self.close()
        self.forwards += 1
        self.call = None if call.prefill else call
        self.drafter, self.drafting = self.drafting, None

    def on_drafter(self, call: Call, name: str | None = None) -> None:
        self.drafter_forwards += 1
        self.drafting = name

    def on_token(self, token: int, text: str) -> None:
        """A committed token, with the text of the reply it made final (the request's TextStream: "" while a split
        character or a tail that may begin a stop string is held back, a stop string never)."""
        self.tokens.append(token)
        self.texts.append(text)

    def on_rest(self, text: str) -> None:
        """The text held back when the reply ended, made final with its last token."""
        if self.texts:
            self.texts[-1] += text

    def close(self) -> None:
        """End the open step: of its drafts, those its committed tokens took (`provenance`: a path, one at each depth
        from the first; all of them where the reply ended on a draft's token, at an end of sequence or a stop
        string); `on_step` hears each token's provenance and how deep the draft went."""
        depths = draft_depths(self.call)
        kinds = provenance(self.call, self.tokens)
        accepted = kinds.count("accepted")
        self.drafted += len(depths)
        self.accepted += accepted
        if self.metrics is not None and self.verified:
            self.metrics.step(depths, accepted)
        if self.on_step is not None and self.tokens:
            depth = max(depths, default=0)
            self.on_step({"tokens": self.tokens, "texts": self.texts, "kinds": kinds, "drafted": depth,
                          "accepted": accepted, "drafter": self.drafter if depth else None})
        self.tokens, self.texts, self.drafter, self.call = [], [], None, None

    def summary(self, method: str, tokens: int) -> dict[str, Any]:
        self.close()
        steps = max(self.forwards - 1, 0)  # verification forwards
        if not self.verified:
            return {"method": method, "drafted_tokens": None, "accepted_tokens": None, "mean_accepted_length": None,
                    "target_forwards": None, "drafter_forwards": self.drafter_forwards}
        return {"method": method, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "mean_accepted_length": round((tokens - 1) / steps, 3) if steps and tokens > 1 else 1.0,
                "target_forwards": self.forwards, "drafter_forwards": self.drafter_forwards}


def draft_depths(call: Call | None) -> list[int]:
    """The depth of each draft token a verification `call` verifies (1: right after the last committed token): a
    chain's 1..W-1, a tree's nodes below its root, several at a depth (None, the prefill: none)."""
    if call is None:
        return []
    if call.tree is None:
        return list(range(1, len(call.ids)))
    return [depth for depth in call.tree.depths[len(call.tree) - len(call.ids):] if depth]


def provenance(call: Call | None, tokens: list[int]) -> list[str]:
    """Each token a step committed after its verification `call` (None: the prefill): "accepted" where it is the
    draft's token at its place (a chain's next, a child of the tree's last accepted node), "corrected" where the
    target chose another while drafts were left there, "target" where none were (no draft, or all accepted)."""
    if call is None:
        return ["target"] * len(tokens)
    drafted, parents = (call.tree.tokens, call.tree.parents) if call.tree is not None else \
        (call.ids, range(-1, len(call.ids) - 1))  # node 0: the last committed token
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(parents):
        if node:
            children.setdefault(parent, {})[drafted[node]] = node
    kinds, node = [], 0
    for token in tokens:
        below = children.get(node, {})
        if token in below:
            kinds.append("accepted")
            node = below[token]
        else:
            kinds.append("corrected" if below else "target")
    return kinds


def culprit(build: Callable[[Mapping[str, Any]], Any], values: Mapping[str, Any]) -> str:
    """The option a request's refused `values` fail on: the first that makes `build` fail, added in turn to what the
    method defaults to; `method` where that fails already (a method that needs what the server did not load)."""
    names = list(values)
    for count in range(len(names) + 1):
        try:
            build({name: values[name] for name in names[:count]})
        except ConfigError:
            return names[count - 1] if count else "method"
    return names[-1]  # (they fail only all together)


class Ticket:
    """A submitted job: `cancel()` ends it after the forward it waits on (a client went away), or takes it out of the
    queue where it waits for a row (`withdraw`)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.withdraw: Callable[[], Any] | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.withdraw is not None:
            self.withdraw()


def on_own_thread(method: str, options: Any) -> None:
    """Refuse options that would run a request's drafter on a thread of its own: the batcher runs every served
    forward on its thread (a tree's stage scheduling drafts on another)."""
    if getattr(options, "schedule", "serial") != "serial":
        raise OptionError("schedule", f"{method} with schedule={options.schedule} drafts on a thread of its own, "
                          "which a server's batched forwards cannot run: serve it with schedule=serial")


class Engine:
    """Serves one target with one method (its drafters loaded once); requests may pick another method or
    other options, drawing only on the models loaded here."""

    def __init__(self, target: CausalLM | Callable[[], CausalLM], method: str = "auto", options: Any = None,
                 max_batch: int = 16, max_queue: int = 64, metrics: Metrics | None = None,
                 prefix_cache_mb: float = ServeConfig.prefix_cache_mb):
        """`target` may be given as a function that loads it: the models then load on the thread that runs
        their forwards (torch's OpenMP threads, once started from a loading thread, slow down later forwards from
        the worker). Requests' prompts are kept in a prefix cache of `prefix_cache_mb` (`speculant.prefixes`)."""
        on_own_thread(method, options)
        self.metrics = metrics
        self.batcher = Batcher(max_batch, metrics.batch if metrics else None)
        self.target = self.batcher.run(target) if callable(target) and not isinstance(target, CausalLM) else target
        self.method = get_method(method)
        options = with_default_drafter(options if options is not None else self.method.make_options({}),
                                       self.target.name)
        check_capabilities(options, self.target)
        if self.method.name == "auto":
            options = with_own_drafters(options, self.target)
        # What the requests load and learn, shared by all of them, and the KV of their prompts.
        self.session = Session(self.target, PrefixCache(prefix_cache_mb, metrics.prefix if metrics else None))
        if metrics:
            metrics.prefix_bytes.set_function(lambda: self.session.prefixes.bytes)
            metrics.queue_depth.set_function(lambda: self.batcher.waiting)
        self.drafters: dict[str, Any] = {}  # spec (an object's name) -> the served model or Drafter requests draft with
        self.given: dict[str, Any] = {}  # an object's name -> the object as the server was given it
        self.options = options
        drafting = self.batcher.run(lambda: with_drafters(options, self._load))
        if self.method.loaded is not None:  # (refused at the start: not as every request's 400)
            # each model as a request drafts with it: through a wrapper, as its `Row` (no tree's levels in one call)
            self.method.loaded(with_drafters(drafting, lambda m: Delegating(m) if isinstance(m, CausalLM) else m),
                               self.target)
        self.served = tuple(self.drafters)  # the server's own drafters: a request's defaults, whatever others added
        # Max-Gram costs nothing to hold, so any request may draft with it: loaded now, on the batcher's thread, as a
        # request's first use on the event loop's would change the session's drafters while a step reads them
        self.batcher.run(lambda: self._load(MAXGRAM))
        # Each request opens a handle on every model it runs (twice on the target where it drafts for itself): room
        # for a full batch of them now, not while requests wait (`reserve`: a compiled pool's growth compiles)
        served = [model for model in (self.target, *self.drafters.values()) if isinstance(model, CausalLM)]
        for model in {id(model): model for model in served}.values():
            handles = sum(other is model for other in served) * max_batch
            self.batcher.run(lambda model=model, handles=handles: model.reserve(handles))
        self.max_batch, self.max_queue = max_batch, max_queue
        self._lock = threading.Lock()  # submissions and their count of waiting requests
        self._running_apart: set[threading.Thread] = set()

    def _load(self, spec: Any) -> Any:
        """The served drafter for `spec`, loaded once: a request names it by its spec, or by the name of an object the
        server was given (neither the name of another drafter nor a built-in's, which requests may always name)."""
        from speculant.drafters.registry import RESERVED, is_registered

        given = not isinstance(spec, (str, DrafterSpec))
        name = getattr(spec, "name", None)
        key = str(spec) if not given else name if isinstance(name, str) and name else type(spec).__name__
        if given and (key in RESERVED or is_registered(key)):
            raise ConfigError(f"a drafter object is named '{key}', as a built-in drafter that requests may name: give "
                              "it a name of its own")
        if self.given.get(key, spec) is not spec or given and key in self.drafters and key not in self.given:
            raise ConfigError(f"two of the server's drafters go by '{key}', by which a request names one: give the "
                              "drafter object a name of its own")
        if given:
            self.given[key] = spec
        if key not in self.drafters:
            if isinstance(spec, DrafterSpec) and spec.kind == SELF and not (spec.quant or spec.skip):
                self.drafters[key] = self.target  # its rows share the target's weights (and its batched forwards)
            else:
                self.drafters[key] = self.session.drafter(spec, getattr(self.options, "drafter_dtype", None))
        return self.drafters[key]

    def loaded_for(self, drafter: Any) -> Any | None:
        """What the server loaded for a request's `drafter`: by its spec or name, or the object it was given (or
        loaded); None where it loaded nothing for it."""
        if isinstance(drafter, (str, DrafterSpec)):
            return self.drafters.get(str(drafter))
        return next((loaded for key, loaded in self.drafters.items()
                     if drafter is loaded or drafter is self.given.get(key)), None)

    @property
    def models(self) -> list[str]:
        return list(self.drafters)

    @property
    def active(self) -> int:
        """Requests waiting or decoding."""
        return self.batcher.waiting + self.batcher.load + len(self._running_apart)

    def options_for(self, method: str | None, given: Mapping[str, Any]) -> tuple[Any, Any]:
        """(method, options) for a request: the server's, or another method with `given` options; drafters
        default to the server's and must be among those it loaded. A ConfigError names what is wrong."""
        if method is None and not given:
            return self.method, self.options
        try:
            spec = get_method(self.method.name if method is None else method)
        except ConfigError as error:
            raise OptionError("method", str(error)) from None
        by_name = {f.name: f for f in fields(spec.options)}
        for name, value in given.items():  # (their text would name no drafter, width or number: refused as what it is)
            if isinstance(value, dict) or isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
                raise OptionError(name, f"{name} takes text, a number, true or false, or a list of them; got "
                                  f"{type(value).__name__} {json.dumps(value, default=str)[:60]}")
        text = {k: as_text(v) for k, v in given.items()}  # values as a bench spec gives them: parsed, checked
        loaded: dict[str, Any] = {}  # the defaults a request's values replace
        if "drafter" in by_name:  # the server's first model drafter, else Max-Gram
            models = [k for k in self.served if k != MAXGRAM]
            loaded["drafter"] = self.drafters[models[0]] if models else MAXGRAM
        if "drafters" in by_name:
            loaded["drafters"] = tuple(self.drafters[k] for k in self.served) or MAXGRAM

        def build(values: Mapping[str, Any]) -> Any:
            if spec is self.method:  # the server's method: the operator's settings stay, its drafters too (a
                # request's own draft with what the server loaded: the operator's drafter dtype is not theirs)
                switched = "drafter_dtype" in by_name and bool({"drafter", "drafters"} & set(values))
                return replace(self.options, **values, **({"drafter_dtype": None} if switched else {}))
            return spec.make_options({**loaded, **values})

        values = spec.parse_values(text)
        for name, value in given.items():
            if isinstance(value, list) and not isinstance(values[name], (list, tuple)):
                raise OptionError(name, f"{name} takes one value, not a list")
        for pair in getattr(spec.options, "EITHER", ()):  # one of a pair named: the other's default, not the server's
            for one, other in (pair, pair[::-1]):
                if one in values and other not in values:
                    values[other] = default_of(by_name[other])
        try:
            options = with_default_drafter(build(values), self.target.name)  # (`default`: refused now, where it is)
        except OptionError:
            raise
        except ConfigError as error:  # (an options class's own check: named after the option it fails on)
            raise OptionError(culprit(build, values), str(error)) from None
        spec.check_request(options, given)
        check_capabilities(options, self.target)
        for name, drafters in drafters_by_field(options).items():
            for drafter in drafters:
                if self.loaded_for(drafter) is None:
                    raise OptionError(name, f"drafter '{drafter}' is not loaded on this server (loaded: "
                                      f"{', '.join(self.drafters)})")
        on_own_thread(spec.name, options)
        return spec, options

    def submit(self, job: ServeJob, on_text: Callable[[str, list[TokenLogprob]], None],
               on_end: Callable[[Outcome | BaseException], None],
               on_step: Callable[[dict[str, Any]], None] | None = None) -> Ticket:
        """Start `job`; text increments (with the log-probabilities of the tokens committed since the last
        one, where the job asks for them) go to `on_text`, each step's tokens and their provenance to `on_step`
        (`Steps.close`) where given, and the end to `on_end`, from the batcher's thread. Raises QueueFull when the
        queue is full (or, for a request apart, `max_batch` run apart already), WorkerStopped once the batcher's
        worker has stopped or the engine closes, a ConfigError for options the server cannot run."""
        spec, options = self.options_for(job.method, job.options)
        check_request(spec.name, job.logprobs, job.logit_bias, job.constraint and job.constraint.constraint)
        ticket, submitted, apart = Ticket(), time.perf_counter(), spec.name in APART

        def work() -> None:
            try:
                if not ticket.cancelled.is_set():
                    on_end(self._decode(job, spec, options, ticket, on_text, submitted, apart, on_step))
            except Exception as error:  # noqa: BLE001 - the request's caller reports it
                on_end(error)

        with self._lock:
            if self.batcher.closed:  # (a request apart too: `close` waits for those it knows of)
                raise WorkerStopped(CLOSED)
            if apart and len(self._running_apart) >= self.max_batch:
                raise QueueFull(f"{len(self._running_apart)} {spec.name} requests are decoding; try again later")
            if not apart and self.batcher.waiting + self.batcher.load >= self.max_batch + self.max_queue:
                raise QueueFull(f"{self.batcher.waiting} requests are waiting; try again later")
            if apart:
                thread = threading.Thread(target=self._apart, args=(work,), name=f"speculant-{spec.name}", daemon=True)
                self._running_apart.add(thread)
                thread.start()
            else:
                self.batcher.start(work, on_end)
                ticket.withdraw = partial(self.batcher.withdraw, work)
        return ticket

    def _apart(self, work: Callable[[], None]) -> None:
        try:
            work()
        finally:
            with self._lock:
                self._running_apart.discard(threading.current_thread())

    def _decode(self, job: ServeJob, spec: Any, options: Any, ticket: Ticket,
                on_text: Callable[[str, list[TokenLogprob]], None], submitted: float, apart: bool = False,
                on_step: Callable[[dict[str, Any]], None] | None = None) -> Outcome:
        steps = Steps(self.metrics, on_step, verified=not apart)
        rows: dict[int, Row] = {}
        batcher = None if apart else self.batcher  # a request apart runs its own forwards on its own thread

        def row(model: CausalLM, on_forward: Callable[[Call], None]) -> Row:
            if id(model) not in rows:
                rows[id(model)] = Row(batcher, model, on_forward, ticket.cancelled.is_set, self.session.prefixes)
            return rows[id(model)]

        def for_request(held: Any) -> Any:
            loaded = self.loaded_for(held)
            loaded = held if loaded is None else loaded
            return row(loaded, lambda call, name=loaded.name: steps.on_drafter(call, name)) \
                if isinstance(loaded, CausalLM) else loaded

        target = Row(batcher, self.target, steps.on_target, ticket.cancelled.is_set, self.session.prefixes)
        decoded, recorded = decoded_target(target, job.logprobs, job.logit_bias, job.constraint)
        options = with_drafters(options, for_request)
        request = Request(decoded, job.prompt_ids, job.max_tokens, job.sampling,
                          seeded(self.target.device, job.seed), self.session, job.seed)
        decoder = spec.build(request, options)
        text = TextStream(self.target.tokenizer, job.stops, job.calls)
        tokens, finish, last = 0, "length", None
        entries: list[TokenLogprob] = []  # where the job asks for log-probabilities
        unsent = 0  # entries not yet handed out with a piece of text
        try:
            for token in decoder:
                now = time.perf_counter()
                if self.metrics:
                    self.metrics.token(now - (last if last is not None else submitted), first=last is None)
                last = now
                tokens += 1
                if recorded is not None:  # (the end-of-sequence token adds nothing to the content: no entry)
                    entry = recorded.take(token)
                    if token not in self.target.eos_token_ids:
                        entries.append(entry)
                piece = text.push(token)
                steps.on_token(token, piece)
                if text.stopped:  # (the tokens of the stop string, cut from the text, leave its log-probabilities)
                    del entries[text.covering():]
                if piece:  # entries wait while text is held back (it may begin a stop string, and they with it)
                    sent = entries[unsent : text.done] if not text.holding else []  # (those whose text is final)
                    on_text(piece, sent)
                    unsent += len(sent)
                if text.stopped or token in self.target.eos_token_ids:
                    finish = "stop"
                    break
                if ticket.cancelled.is_set():
                    finish = "cancelled"
                    break
        except Interrupted:  # a prompt's prefill stopped between its parts: the client went away
            if not ticket.cancelled.is_set():
                raise
            finish = "cancelled"
        finally:
            decoder.close()
        stopped = text.stopped
        piece = text.flush()
        # A stop string that ends in U+FFFD, found as the rest settles (also after the end-of-sequence token):
        if text.stopped and not stopped:
            finish = "stop"
            del entries[text.covering():]
        if piece or unsent < len(entries):
            on_text(piece, entries[unsent:])
            steps.on_rest(piece)
        return Outcome(text.text, finish, len(job.prompt_ids), tokens, steps.summary(spec.name, tokens),
                       entries if recorded is not None else None)

    def close(self) -> None:
        """Finish the running and waiting requests, then stop."""
        self.batcher.close()
        with self._lock:
            apart = list(self._running_apart)
        for thread in apart:
            thread.join()
