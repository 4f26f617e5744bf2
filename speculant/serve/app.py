"""`speculant serve`: an OpenAI-compatible HTTP API over the serving engine (FastAPI).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as server-sent
events with `stream: true`, ending with `data: [DONE]`), GET /health, GET /metrics. Every refusal is a
4xx JSON error in OpenAI's shape, given before the request reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from speculant.api import encode_prompt
from speculant.config import ModelConfig, SamplingConfig, ServeConfig
from speculant.errors import ConfigError
from speculant.models.wrappers.biased import check_bias
from speculant.models.wrappers.constrained import Constraint, Matcher
from speculant.models.wrappers.logprobs import TokenLogprob
from speculant.serve.engine import Engine, ServeJob, Outcome, QueueFull
from speculant.serve.metrics import Metrics
from speculant.serve.schema import ApiError, ChatRequest, CompletionRequest, Sampling


class _End:
    def __init__(self, outcome: Outcome | BaseException):
        self.outcome = outcome


def create_app(engine: Engine, served_name: str, api_key: str | None = None, replica: str | None = None) -> FastAPI:
    """The API for `engine`'s target, known to clients as `served_name`; `api_key` (if given) is required;
    `replica` (if given) names this process in each API response's `x-speculant-replica` header."""
    metrics = engine.metrics or Metrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.close)  # SIGTERM: uvicorn stops taking requests, the running ones finish

    app = FastAPI(title="speculant", lifespan=lifespan)

    def check_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = "the body is not valid JSON" if first.get("type") == "json_invalid" else \
            f"{where} is not implemented by this server" if first.get("type") == "extra_forbidden" else \
            f"{where or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(ApiError(400, message, param=where or None).body, status_code=400)

    app.add_middleware(Counted, metrics=metrics, replica=replica)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": created,
                                            "owned_by": "speculant"}]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, http: Request) -> Any:
        tokenizer = engine.target.tokenizer
        if isinstance(body.prompt, list):
            ids = body.prompt
            if any(not 0 <= t < engine.target.vocab_size for t in ids):
                raise ApiError(400, f"prompt token ids must lie in [0, {engine.target.vocab_size})", "prompt")
        else:
            if tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = encode_prompt(tokenizer, body.prompt) if body.prompt else []
        return await respond(body, ids, body.max_tokens or 16, False, http)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat(body: ChatRequest, http: Request) -> Any:
        try:
            ids = encode_prompt(engine.target.tokenizer, [m.as_template() for m in body.messages])
        except ConfigError as error:
            raise ApiError(400, str(error), "messages") from None
        return await respond(body, ids, body.max_completion_tokens or body.max_tokens, True, http)

    async def respond(body: Sampling, ids: list[int], max_tokens: int | None, chat: bool, http: Request) -> Any:
        if body.model != served_name:
            raise ApiError(404, f"model '{body.model}' is not served here (this server has '{served_name}')",
                           "model", "model_not_found")
        job = await asyncio.to_thread(make_job, body, ids, max_tokens)  # a grammar compiles off the event loop
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
            ticket = engine.submit(job, on_text, lambda outcome: put(_End(outcome)))
        except QueueFull as error:
            raise ApiError(429, f"the server is busy: {error}", code="queue_full") from None
        except ConfigError as error:
            raise ApiError(400, str(error), "speculant") from None
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        shape = Shape(ident, served_name, chat, engine.target.tokenizer, job.logprobs is not None)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(queue, ticket, shape, include_usage), media_type="text/event-stream")
        try:
            if (item := await next_item(queue, http)) is GONE:
                return Response(status_code=499)  # nobody reads it: the client closed its connection
        finally:
            ticket.cancel()  # a client that went away frees its row within a step
        outcome = ended(item)
        metrics.usage(outcome.prompt_tokens, outcome.completion_tokens)
        return shape.whole(outcome)

    async def stream(queue: asyncio.Queue, ticket: Any, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
        try:
            if shape.chat:
                yield sse(shape.chunk({"role": "assistant", "content": ""}, []))
            while not isinstance(item := await queue.get(), _End):
                yield sse(shape.chunk(*item))
            outcome = ended(item)
            metrics.usage(outcome.prompt_tokens, outcome.completion_tokens)
            yield sse(shape.chunk(None, [], outcome.finish_reason))
            if include_usage:
                yield sse({**shape.chunk(None, []), "choices": [], "usage": shape.usage(outcome)})
        except ApiError as error:  # the engine failed mid-stream: say so in the stream
            yield sse(error.body)
        finally:
            ticket.cancel()  # a client that went away frees its row after the current forward
        yield "data: [DONE]\n\n"

    def make_job(body: Sampling, ids: list[int], max_tokens: int | None) -> ServeJob:
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        limit = engine.target.max_positions
        if limit is not None and len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model holds {limit} positions", "prompt",
                           "context_length_exceeded")
        if max_tokens is None:
            max_tokens = (limit - len(ids)) if limit is not None else 1 << 30
        elif limit is not None and len(ids) + max_tokens > limit:
            raise ApiError(400, f"max_tokens {max_tokens} after a {len(ids)}-token prompt exceeds this model's "
                           f"{limit} positions", "max_tokens", "context_length_exceeded")
        sampling = SamplingConfig(body.temperature, None, body.top_p if body.top_p < 1 else None)
        overrides = dict(body.speculant or {})
        method = overrides.pop("method", None)
        if method is not None and not isinstance(method, str):
            raise ApiError(400, "speculant.method must be a method name", "speculant")
        try:
            bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        except ValueError:
            raise ApiError(400, "logit_bias keys must be token ids", "logit_bias") from None
        try:
            check_bias(bias, engine.target.vocab_size)
        except ConfigError as error:
            raise ApiError(400, str(error), "logit_bias") from None
        try:
            constraint = Constraint.from_response_format(body.response_format or {"type": "text"})
            if constraint is not None:  # compiled here, so that a bad schema is a 400 before the request runs
                Matcher(constraint, engine.target.tokenizer, engine.target.vocab_size)
        except ConfigError as error:
            raise ApiError(400, str(error), "response_format") from None
        return ServeJob(ids, max_tokens, sampling, body.seed, body.stops, method, overrides, body.alternatives, bias,
                   constraint)

    return app


class Counted:
    """Counts the API's requests by endpoint and status, and names the replica that answers them: a plain ASGI
    middleware (Starlette's BaseHTTPMiddleware would hide a client's disconnect from the endpoints, which poll
    for it)."""

    def __init__(self, app: Any, metrics: Metrics, replica: str | None = None):
        self.app, self.metrics = app, metrics
        self.header = [(b"x-speculant-replica", replica.encode())] if replica else []

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request(scope["path"], message["status"])
                message = {**message, "headers": [*message.get("headers", []), *self.header]}
            await send(message)

        await self.app(scope, receive, counted)


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


def ended(item: _End) -> Outcome:
    """The job's outcome, or the ApiError its failure is answered with."""
    if isinstance(item.outcome, Outcome):
        return item.outcome
    if isinstance(item.outcome, ConfigError):
        raise ApiError(400, str(item.outcome))
    raise ApiError(500, f"generation failed: {type(item.outcome).__name__}: {item.outcome}")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Shape:
    """The OpenAI response and chunk objects of one request; with `logprobs`, each choice carries its tokens'
    log-probabilities in the endpoint's form (chat: `content` entries; completions: parallel lists)."""

    def __init__(self, ident: str, model: str, chat: bool, tokenizer: Any = None, logprobs: bool = False):
        self.ident, self.model, self.chat, self.created = ident, model, chat, int(time.time())
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.offset = 0  # characters of completion text before the next token (completions' text_offset)

    def usage(self, outcome: Outcome) -> dict[str, Any]:
        return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens, "speculative": outcome.speculative}

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        logprobs = self.entries(outcome.logprobs or [])
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text},
                      "finish_reason": outcome.finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": logprobs}
        return {"id": self.ident, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(outcome)}

    def chunk(self, delta: Any, entries: list[TokenLogprob], finish_reason: str | None = None) -> dict[str, Any]:
        logprobs = self.entries(entries) if entries else None
        if self.chat:
            content = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason, "logprobs": logprobs}
        return {"id": self.ident, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def entries(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """Log-probabilities in the endpoint's form (None where the request asked for none)."""
        if not self.logprobs:
            return None

        def token(t: int) -> str:  # one token's text (bytes of a character it splits decode as U+FFFD)
            return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

        if self.chat:
            def entry(t: int, logprob: float) -> dict[str, Any]:
                piece = token(t)
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

            return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        pieces = [token(e.token) for e in entries]
        offsets = []
        for piece in pieces:
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{token(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def serving_backend(config: ModelConfig) -> str:
    """`auto` for a server: transformers where its batched forwards are fast (AMX or CUDA: a batch of rows
    costs about one row), else what `auto` picks for one sequence. AVX512-BF16 alone is not enough: there the
    lean backend serves several times transformers' bf16 (CHANGELOG.md, serving)."""
    from speculant.machine import cpu_has

    if config.backend != "auto":
        return config.backend
    return "hf" if config.device != "cpu" or cpu_has("amx_bf16") else "auto"


def build_app(target_name: str, model: ModelConfig, method: str, options: Any, config: ServeConfig,
              served_name: str, replica: str | None = None) -> FastAPI:
    """Load the target (and the method's drafters) and make the app that serves them."""
    import sys

    from speculant.models import load_model
    from speculant.models.base import CausalLM

    backend = serving_backend(model)
    print(f"loading target {target_name} (backend {backend}, dtype {model.dtype}, {model.device})", file=sys.stderr)
    engine = Engine(lambda: load_model(target_name, dtype=model.dtype, device=model.device, backend=backend,
                                       compile=model.compile),
                    method, options, config.max_batch, config.max_queue, Metrics())
    if method == "auto":  # measure T(W) now (once per machine, on the thread that runs forwards), not in a request
        for each in [engine.target, *(m for m in engine.drafters.values() if isinstance(m, CausalLM))]:
            engine.batcher.run(lambda each=each: engine.session.profile(each))
    print(f"ready: {served_name} ({engine.target.numerics}, {method}; drafters: {', '.join(engine.models) or 'none'})",
          file=sys.stderr)
    return create_app(engine, served_name, config.api_key, replica)


def serve(target_name: str, model: ModelConfig, method: str, options: Any, config: ServeConfig,
          served_name: str) -> None:
    """Serve the target with `method` from this process until SIGTERM or Ctrl-C (running requests finish first)."""
    import sys

    import uvicorn

    app = build_app(target_name, model, method, options, config, served_name)
    print(f"serving on http://{config.host}:{config.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
