"""`speculant serve`: an OpenAI-compatible HTTP API over the serving engine (FastAPI).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as server-sent
events with `stream: true`, ending with `data: [DONE]`; tools called as `speculant.serve.tools` parses them),
GET /health, GET /metrics, and the playground page at / (`playground/`). Every refusal is a
4xx JSON error in OpenAI's shape, given before the request reaches the engine; a fault of the server's own is a
500 in the same shape, logged with an id the client sees (`guard`). A request's `speculant` options are data:
those that name something on the machine are the operator's (`check_request_options`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from speculant.api import encode_prompt
from speculant.config import ModelConfig, SamplingConfig, ServeConfig
from speculant.errors import ConfigError, DraftFault, OptionError, RequestError
from speculant.methods.registry import check_names, get_method, request_options
from speculant.models.wrappers.biased import check_bias
from speculant.models.wrappers.constrained import Constraint, Matcher
from speculant.serve.batcher import CLOSED, WorkerStopped
from speculant.serve.engine import Engine, ServeJob, Outcome, QueueFull
from speculant.serve import schema, tools
from speculant.serve.metrics import Metrics
from speculant.serve.guard import ENDED, Guard, server_fault
from speculant.serve.replies import Shape, Spelling, sse
from speculant.serve.schema import (MAX_FORMAT_DEPTH, ApiError, ChatRequest, CompletionRequest, Sampling, depth,
                                    refused_parameters, texts)

REQUEST_MODELS = {name for name, value in vars(schema).items() if isinstance(value, type) and
                  issubclass(value, BaseModel)}  # the request's parts: a union of them tags errors with their names
BODY_UNREAD = "There was an error parsing the body"
PLAYGROUND = Path(__file__).parent / "playground"  # the page at / (static files: no build step)
PAGE = ("/", "/playground/index.html", "/playground/playground.js", "/playground/playground.css")  # open: no secrets
TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # a logit_bias key: a token id in canonical decimal


class _End:
    def __init__(self, outcome: Outcome | BaseException):
        self.outcome = outcome


class _Step:
    def __init__(self, event: dict[str, Any]):
        self.event = event


def create_app(engine: Engine, served_name: str, config: ServeConfig | None = None,
               replica: str | None = None) -> FastAPI:
    """The API for `engine`'s target, known to clients as `served_name`, as `config` says (its API key, body limit,
    open metrics, generated pages and trusted hosts; the defaults without one); `replica` (if given) names this
    process in each response's `x-speculant-replica` header."""
    config = config or ServeConfig()
    metrics = engine.metrics or Metrics()
    created = int(time.time())
    vocabulary = real_vocabulary(engine.target)
    spelled: list[Spelling] = []

    def spelling() -> Spelling:  # read from the tokenizer once, at the first request that asks for logprobs
        if not spelled:
            spelled.append(Spelling(engine.target.tokenizer, engine.target.vocab_size))
        return spelled[0]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.close)  # SIGTERM: uvicorn stops taking requests, the running ones finish

    pages = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    compiling = threading.Lock()  # one grammar compiles at a time: a client's may hold a GB while it does
    # A path with a trailing slash is a 404, not a redirect, whose Location would echo the client's Host header.
    app = FastAPI(title="speculant", lifespan=lifespan, redirect_slashes=False, **pages)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}",
                   }.get(error.status_code, str(error.detail))
        if message == BODY_UNREAD:  # (FastAPI's words for a body it could not decode as JSON)
            message = "the body is not JSON in UTF-8, or is nested too deeply"
        return JSONResponse(ApiError(error.status_code, message).body, status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(ApiError(400, "the body is not valid JSON").body, status_code=400)
        first = max(errors, key=lambda e: len(e.get("loc", ())))  # the deepest: within a union, the member it meant
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not is_type_tag(p))
        if first.get("type") == "extra_forbidden":
            message = f"{where} is not implemented by this server"
        elif first.get("type") == "string_unicode":  # (a key: a field's value is `Text`, checked by `unicode`)
            message = f"a field's name in {where or 'the body'} is not valid Unicode (a lone surrogate)"
        elif not where:
            message = "the body must be a JSON object (sent as Content-Type: application/json)"
        else:  # (a validator's own ValueError: its words, without pydantic's "Value error, " before them)
            message = f"{where}: {first.get('msg', 'invalid').removeprefix('Value error, ')}"
        return JSONResponse(ApiError(400, message, param=where or None).body, status_code=400)

    app.add_middleware(Guard, metrics=metrics, replica=replica, max_body=int(config.max_body_mb * 1e6),
                       hosts=[h.strip().lower() for h in config.allowed_hosts.split(",")] if config.allowed_hosts
                       else None,
                       key=config.api_key, open_paths=PAGE + (("/health", "/metrics") if config.open_metrics
                                                              else ("/health",)),
                       routes=app.routes)
    app.mount("/playground", StaticFiles(directory=PLAYGROUND), name="playground")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # (as /health: probes may HEAD)
    async def playground() -> FileResponse:
        return FileResponse(PLAYGROUND / "index.html")

    @app.api_route("/health", methods=["GET", "HEAD"])  # (probes may ask with HEAD)
    async def health() -> dict[str, str]:
        if engine.batcher.failure is not None or engine.batcher.closed:  # (every request would fail)
            raise ApiError(503, engine.batcher.failure or CLOSED, code="worker_stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    served = {"id": served_name, "object": "model", "created": created, "owned_by": "speculant"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served]}

    def check_model(name: str) -> None:
        """The model a request names is the one served here (a request's checked first: one for another model costs
        no templating)."""
        if name != served_name:
            raise ApiError(404, f"model '{name}' is not served here (this server has '{served_name}')", "model",
                           "model_not_found")

    @app.get("/v1/models/{model:path}")  # (the OpenAI client's models.retrieve; a model's name may hold slashes)
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return served

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Any:
        check_model(body.model)
        tokenizer = engine.target.tokenizer
        if isinstance(body.prompt, list):
            ids = body.prompt
            if any(not 0 <= t < vocabulary for t in ids):
                raise ApiError(400, f"prompt token ids must lie in [0, {vocabulary})", "prompt")
        else:
            if tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = await asyncio.to_thread(encode_prompt, tokenizer, body.prompt) if body.prompt else []
        return await respond(body, ids, body.max_tokens or 16, False, http)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request) -> Any:
        check_model(body.model)
        tokenizer, choice = engine.target.tokenizer, body.choice
        if body.tools and (refused := await asyncio.to_thread(refused_parameters, body.tools)):  # (they compile)
            raise ApiError(400, f"{refused[0]}: {refused[1]}", refused[0])
        calls = None  # where tools may be called: the grammar of the reply
        if not tools.speaks_tools(tokenizer):  # (its template would leave tools and calls out of the prompt)
            called = next((f"messages.{i}.tool_calls" for i, m in enumerate(body.messages) if m.tool_calls), None)
            if choice != "none" or called:
                raise ApiError(400, "this model's chat template does not call tools (no Hermes <tool_call> format)",
                               "tools" if choice != "none" else called)
        if choice != "none":
            answer = await asyncio.to_thread(answer_format, body.response_format)  # (checked whatever the choice)
            if answer is not None and answer.schema is None:
                raise ApiError(400, f"a response_format of type {answer.kind} cannot be combined with tools "
                               "(json_object and json_schema can)", "response_format")
            schema = answer.schema if answer is not None and choice == "auto" else None  # (a reply that must call
            try:  # has no answer to format; the grammar compiles off the event loop; a schema llguidance refuses is
                functions = [t.function.model_dump() for t in body.tools]  # the client's to mend)
                calls = await asyncio.to_thread(tools.constraint, tokenizer, functions, choice,
                                                body.parallel_tool_calls, schema)
            except ConfigError as error:
                raise ApiError(400, str(error), "tools") from None
        messages = [tools.template_message(m) for m in body.messages]
        controls = control_tokens(tokenizer) if tokenizer is not None else None
        rendered = [(f"messages.{i}.{name}", value) for i, message in enumerate(messages)
                    for name, value in message.items()]
        if choice != "none":  # (the template writes the tools' names, descriptions and schemas into the prompt)
            rendered += [(f"tools.{i}.function", tool.function.model_dump()) for i, tool in enumerate(body.tools)]
        def control(rendered: list[tuple[str, Any]]) -> tuple[str, str] | None:
            """The first field that holds a control token's text, and that text."""
            for param, value in rendered:
                if found := next(filter(None, map(controls.search, texts(value))), None):
                    return param, found.group()
            return None

        if controls is not None and (held := await asyncio.to_thread(control, rendered)):  # (off the event loop: a
            raise ApiError(400, f"{held[0]} holds {held[1]!r}, which this model reads as a control token (a turn's "
                           "end, a call)", held[0])  # conversation of many messages must not hold up the others)
        declared = [t.model_dump(exclude_none=True) for t in body.tools] if choice != "none" else None  # (as the
        try:  # template takes them; off the event loop: a long conversation must not hold up the other requests)
            ids = await asyncio.to_thread(encode_prompt, tokenizer, messages, True, declared)
        except ConfigError as error:  # (a participant's name the template has no place for: its message's field)
            raise ApiError(400, str(error), error.field if isinstance(error, RequestError) else "messages") from None
        return await respond(body, ids, body.max_completion_tokens or body.max_tokens, True, http,
                             [t.function.name for t in body.tools] if choice != "none" else None, calls,
                             choice not in ("none", "auto"))

    async def respond(body: Sampling, ids: list[int], max_tokens: int | None, chat: bool, http: Request,
                      calling: list[str] | None = None, calls: Constraint | None = None, forced: bool = False) -> Any:
        job = await asyncio.to_thread(make_job, body, ids, max_tokens, calls)  # a grammar compiles off the event loop
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: the server stopped
                pass

        try:
            on_text = (lambda piece, logprobs: put((piece, logprobs))) if body.stream else \
                (lambda piece, logprobs: None)  # a whole answer comes with its outcome
            provenance = body.stream and body.stream_options is not None and body.stream_options.include_provenance
            ticket = engine.submit(job, on_text, lambda outcome: put(_End(outcome)),
                                   (lambda event: put(_Step(event))) if provenance else None)
        except QueueFull as error:
            raise ApiError(429, f"the server is busy: {error}", code="queue_full") from None
        except WorkerStopped as error:
            raise ApiError(503, str(error), code="worker_stopped") from None
        except ConfigError as error:
            raise ApiError(400, str(error), option_param(error)) from None
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        spelled_now = await asyncio.to_thread(spelling) if job.logprobs is not None else None  # (the first: a scan)
        shape = Shape(ident, served_name, chat, spelled_now, calling,
                      body.parallel_tool_calls if calling is not None else True, forced)
        refused = "speculant" if body.speculant else None  # what a ConfigError of the running request is about
        try:
            if (item := await next_item(queue, http)) is GONE:
                return Response(status_code=499)  # nobody reads it: the client closed its connection
            if body.stream and not (isinstance(item, _End) and not isinstance(item.outcome, Outcome)):
                # the stream's headers go out with its first item: a request refused before it runs is a 4xx
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                streaming = stream(item, queue, ticket, shape, include_usage, http.scope, refused)
                ticket = None  # the stream cancels it when it ends
                return StreamingResponse(streaming, media_type="text/event-stream")
        finally:
            if ticket is not None:
                ticket.cancel()  # a client that went away frees its row within a step
        outcome = ended(item, refused)
        metrics.usage(outcome.prompt_tokens, outcome.completion_tokens)
        return shape.whole(outcome)

    async def stream(item: Any, queue: asyncio.Queue, ticket: Any, shape: Shape, include_usage: bool,
                     scope: dict[str, Any], refused: str | None) -> AsyncIterator[str]:
        """The SSE stream of a request whose first `item` came (the rest follow on `queue`); its status, by how it
        ends, goes to `scope` (`ENDED`): 200 once its outcome is sent, an error's, or 499 where its client left. With
        `include_usage`, every chunk before the last carries a null `usage`, as OpenAI's do."""
        def chunk(fields: dict[str, Any]) -> str:
            return sse({**fields, "usage": None} if include_usage else fields)

        held = tools.ToolStream() if shape.calling is not None else None  # a reply that may call: calls held to the end
        scope[ENDED] = 499
        try:
            if shape.chat:
                yield chunk(shape.chunk({"role": "assistant", "content": ""}, []))
            while not isinstance(item, _End):
                if isinstance(item, _Step):
                    yield chunk(shape.step(item.event))
                else:
                    piece, entries = item
                    if held is not None:
                        piece = held.push(piece)
                    if piece or entries:  # (log-probabilities alone: a call's tokens, a split character's)
                        yield chunk(shape.chunk(piece or None, entries))
                item = await queue.get()
            outcome = ended(item, refused)
            metrics.usage(outcome.prompt_tokens, outcome.completion_tokens)
            finish = outcome.finish_reason
            if held is not None:
                rest, calls = held.finish(shape.calling, shape.most_calls, shape.forced)
                if rest:
                    yield chunk(shape.chunk(rest, []))
                if calls:
                    yield chunk(shape.chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, []))
                    finish = shape.finish(finish, calls)
            yield chunk(shape.chunk(None, [], finish))
            if include_usage:
                yield sse({**shape.chunk(None, []), "choices": [], "usage": shape.usage(outcome)})
            scope[ENDED] = 200
        except ApiError as error:  # the engine failed mid-stream: say so in the stream
            scope[ENDED] = error.status
            yield sse(error.body)
        except Exception as error:  # noqa: BLE001 - a fault of the server's own, after the headers went out
            scope[ENDED] = 500
            yield sse(server_fault(error, scope["route"].path).body)
        finally:
            ticket.cancel()  # a client that went away frees its row after the current forward
        yield "data: [DONE]\n\n"

    def make_job(body: Sampling, ids: list[int], max_tokens: int | None, calls: Constraint | None = None) -> ServeJob:
        prompt = "messages" if isinstance(body, ChatRequest) else "prompt"  # (the field the prompt came from)
        if not ids:
            raise ApiError(400, "the prompt is empty", prompt)
        limit = engine.target.max_positions
        if limit is not None and len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model holds {limit} positions", prompt,
                           "context_length_exceeded")
        if max_tokens is None:
            max_tokens = (limit - len(ids)) if limit is not None else 1 << 30
        elif limit is not None and len(ids) + max_tokens > limit:
            field = "max_completion_tokens" if prompt == "messages" and body.max_completion_tokens else "max_tokens"
            default = "" if getattr(body, field) else " (the default)"
            raise ApiError(400, f"{field} {max_tokens}{default} after a {len(ids)}-token prompt exceeds this model's "
                           f"{limit} positions", field, "context_length_exceeded")
        sampling = SamplingConfig(body.temperature, None, body.top_p if body.top_p < 1 else None)
        overrides = dict(body.speculant or {})
        method = overrides.pop("method", None)
        if method is not None and not isinstance(method, str):
            raise ApiError(400, "speculant.method must be a method name", "speculant.method")
        check_request_options(method or engine.method.name, overrides)  # (names: a null one's too)
        overrides = {name: value for name, value in overrides.items() if value is not None}  # (null: the default,
        # as at the top level)
        if any(not TOKEN_ID.fullmatch(token) for token in body.logit_bias or {}):
            raise ApiError(400, "logit_bias keys must be token ids in decimal, e.g. \"1234\"", "logit_bias")
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        try:
            check_bias(bias, vocabulary)
        except ConfigError as error:
            raise ApiError(400, str(error), "logit_bias") from None
        constraint = calls or answer_format(body.response_format)
        try:
            matcher = None
            if constraint is not None:  # compiled here, one at a time: a bad schema is a 400 before the request
                with compiling:  # runs, and the forwards' thread never compiles
                    matcher = Matcher(constraint, engine.target.tokenizer, engine.target.vocab_size,
                                      engine.target.eos_token_ids)
        except ConfigError as error:
            raise ApiError(400, str(error), constraint.source) from None
        return ServeJob(ids, max_tokens, sampling, body.seed, body.stops, method, overrides, body.alternatives, bias,
                        matcher, tools.OPEN if calls else None)

    return app


def answer_format(response_format: dict[str, Any] | None) -> Constraint | None:
    """What a request's `response_format` asks of the answer (None: text), checked (a schema compiles: off the event
    loop); a 400 naming the field where it is not one."""
    if response_format is not None and depth(response_format) > MAX_FORMAT_DEPTH:
        raise ApiError(400, f"response_format nests deeper than {MAX_FORMAT_DEPTH} levels", "response_format")
    try:
        return Constraint.from_response_format(response_format or {"type": "text"})
    except ConfigError as error:
        raise ApiError(400, str(error), "response_format") from None


def is_type_tag(part: Any) -> bool:
    """Whether a pydantic error location's part names a union member's type ("str", "list[int]",
    "function-after[...]", a model such as "NamedTool") rather than a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part
                                      or part in REQUEST_MODELS)


def check_request_options(method: str, given: dict[str, Any]) -> None:
    """Refuse, naming the field, a request's `speculant` option that is the operator's (a file, a device, an
    executor, an address, a number of processes: `request_options`) before anything reads it (the engine refuses a
    draft size beyond its `most` once the values are parsed)."""
    try:
        allowed = request_options(method)
    except ConfigError as error:
        raise ApiError(400, str(error), "speculant.method") from None
    try:  # (an unknown name: what the client may set is what it is told of)
        check_names(get_method(method).options, method, given, allowed)
    except OptionError as error:
        raise ApiError(400, str(error), f"speculant.{error.option}") from None
    for name in given:
        if name not in allowed:
            raise ApiError(400, f"speculant.{name} names something on the server: only its operator sets it, when "
                           f"starting it (per request: {', '.join(allowed) or 'none'})", f"speculant.{name}")


@functools.lru_cache(maxsize=4)
def control_tokens(tokenizer: Any) -> re.Pattern | None:
    """The texts of the tokenizer's special tokens (<|im_start|>, <|im_end|>, ...), as one pattern: in a chat
    message's content they would end its turn, so a client's messages may not hold them (as tiktoken refuses
    special tokens in text by default). Added tokens that are not special (<tool_call>) stay allowed: a reply cut
    short keeps a raw call in its content, which the client sends back in the next turn."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = sorted({token.content for token in added.values() if token.special and token.content}, key=len,
                   reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def option_param(error: ConfigError, otherwise: str | None = "speculant") -> str | None:
    """The request field a refused `speculant` option is answered with: the option where the error names one (a
    request's own field where the method cannot keep it)."""
    if isinstance(error, RequestError):
        return error.field
    return f"speculant.{error.option}" if isinstance(error, OptionError) else otherwise


def real_vocabulary(target: Any) -> int:
    """Token ids a client may name: the tokenizer's own, not the embedding's padded rows beyond them."""
    tokenizer = target.tokenizer
    return min(target.vocab_size, len(tokenizer)) if tokenizer is not None else target.vocab_size


GONE = object()  # what `next_item` gives once the client has disconnected
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request asks whether its client is still there


async def next_item(queue: asyncio.Queue, http: Request) -> Any:
    """The engine's next item for a request that answers whole, or GONE as soon as its client disconnects (a
    streaming response learns that from its failed writes)."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return GONE


def ended(item: _End, refused: str | None = None) -> Outcome:
    """The job's outcome, or the ApiError its failure is answered with (a ConfigError: about the field `refused`,
    or the option it names; but a drafter's broken contract, the server's own drafter's, is the server's fault)."""
    if isinstance(item.outcome, Outcome):
        return item.outcome
    if isinstance(item.outcome, ConfigError) and not isinstance(item.outcome, DraftFault):
        raise ApiError(400, str(item.outcome), option_param(item.outcome, refused))
    raise server_fault(item.outcome, "a generation")  # (its text stays in the log: it may hold paths)


def build_app(target_name: str, model: ModelConfig, method: str, options: Any, config: ServeConfig,
              served_name: str, replica: str | None = None) -> FastAPI:
    """Load the target (and the method's drafters) and make the app that serves them."""
    import sys

    from speculant.models import load_model
    from speculant.models.base import CausalLM

    from speculant.serve import serving_backend

    backend = serving_backend(model)
    print(f"loading target {target_name} (backend {backend}, dtype {model.dtype}, {model.device})", file=sys.stderr)
    engine = Engine(lambda: load_model(target_name, dtype=model.dtype, device=model.device, backend=backend,
                                       compile=model.compile),
                    method, options, config.max_batch, config.max_queue, Metrics(), config.prefix_cache_mb)
    # Measure T(W) now (once per machine, on the thread that runs forwards), not in a request: whatever the server's
    # method, a request may pick auto, which reads the profiles, and every other request's stream would wait.
    for each in [engine.target, *(m for m in engine.drafters.values() if isinstance(m, CausalLM))]:
        engine.batcher.run(lambda each=each: engine.session.profile(each))
    print(f"ready: {served_name} ({engine.target.numerics}, {method}; drafters: {', '.join(engine.models) or 'none'})",
          file=sys.stderr)
    return create_app(engine, served_name, config, replica)


def serve(target_name: str, model: ModelConfig, method: str, options: Any, config: ServeConfig,
          served_name: str) -> None:
    """Serve the target with `method` from this process until SIGTERM or Ctrl-C (running requests finish first)."""
    import signal
    import sys

    import uvicorn

    app = build_app(target_name, model, method, options, config, served_name)
    print(f"serving on http://{config.host}:{config.port}/v1", file=sys.stderr)
    # uvicorn drains the requests on SIGTERM, then raises it again: the process ends by the signal, as a service
    # manager expects (not by the CLI's `errors.Terminated`, which took it while the models loaded)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    uvicorn.run(app, host=config.host, port=config.port, **uvicorn_options())


def uvicorn_options() -> dict[str, Any]:
    """How `serve` runs uvicorn: quiet, and answering a request its HTTP/1.1 parser refuses (bad framing, a malformed
    header) as every other refusal, a JSON 400 in the API's shape, not uvicorn's plain text. (Ray Serve's proxy parses
    a replica's requests with its own uvicorn.)"""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JsonRefusals(AutoHTTPProtocol):  # type: ignore[misc, valid-type]  # (httptools', else h11's)
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(ApiError(400, "the request is not valid HTTP/1.1 (its framing or a header could not be "
                                       "parsed)", code="invalid_http").body).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body))
            self.transport.close()

    return {"log_level": "warning", "http": JsonRefusals}
