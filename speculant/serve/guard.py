"""What every request passes before it reaches a route (`Guard`, a plain ASGI middleware): the trusted-host check, the
API key, the body limit, a JSON body Python's `json` would read past, and the one 500 path for a fault of the
server's own, logged with an id the client sees; each API request counted once, by route and status."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from speculant.serve.metrics import Metrics
from speculant.serve.schema import ApiError, body_fault


LOG = logging.getLogger("speculant.serve")
ENDED = "speculant.status"  # a stream's status by how it ended, in its ASGI scope: what `Guard` counts it as


def server_fault(error: BaseException, where: str) -> ApiError:
    """A fault of the server's own: logged with an id that the client's error names, answered 500."""
    ident = uuid.uuid4().hex[:12]
    LOG.error("server error %s in %s", ident, where, exc_info=error)
    return ApiError(500, f"the server failed (error id {ident}; its log has the details)", code="server_error")


HOST = re.compile(r"(?P<name>\[[^\s/@\[\]]+\]|[^\s:/@\[\]]+)(:\d{0,5})?")  # a Host header: uri-host [":" port]


class Guard:
    """What every request passes first, as a plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide a
    client's disconnect from the endpoints, which poll for it): the trusted-host check; the API key, on every path
    but `open_paths`; the body limit (413 from the declared length before a byte is read; every body is read here,
    counted, so that a length the transfer does not keep to cannot pass more); a JSON body to a POST route that
    Python's `json` would read past without a word (`schema.body_fault`: a 400 naming where); one 500 in the API's
    shape, logged and counted, for any fault of the server's own; each API request counted once, when it ends, by its
    route's template (an unknown path counts as `unmatched`, so that clients cannot grow the metrics) and by its
    status (a stream's by how it ended, `ENDED`: its headers went out as 200 before it knew; 499 for one whose client
    left, whether the app saw it go, the server cancelled the request, or `receive` failed; a request the server
    itself cancels, past Ray Serve's request timeout or at a shutdown, counts so too), and the replica named in a
    header."""

    def __init__(self, app: Any, metrics: Metrics, replica: str | None = None, max_body: int = 4_000_000,
                 hosts: list[str] | None = None, key: str | None = None, open_paths: tuple[str, ...] = ("/health",),
                 routes: list[Any] = ()):
        self.app, self.metrics, self.max_body, self.hosts = app, metrics, max_body, hosts
        self.key, self.open_paths, self.routes = key, open_paths, routes
        self.header = [(b"x-speculant-replica", replica.encode())] if replica else []

    def posted(self, scope: dict[str, Any]) -> bool:
        """Whether the request is a POST to a route that takes one (elsewhere the app answers 404 or 405 first)."""
        return scope["method"] == "POST" and any(getattr(route, "path", None) == scope["path"] and
                                                 "POST" in getattr(route, "methods", ()) for route in self.routes)

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None  # the response's, once its headers went out
        receive = heard(receive)

        async def answer(error: ApiError, count: bool = True) -> None:  # a refusal before routing, counted by path
            if count and scope["path"].startswith("/v1/"):
                known = any(getattr(route, "path", None) == scope["path"] for route in self.routes)
                self.metrics.request(scope["path"] if known else "unmatched", error.status)
            await send({"type": "http.response.start", "status": error.status,
                        "headers": [(b"content-type", b"application/json"), *self.header]})
            await send({"type": "http.response.body", "body": json.dumps(error.body).encode()})

        def label() -> str:
            route = scope.get("route")
            return route.path if route is not None else "unmatched"

        async def sent(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *self.header]}
            await send(message)

        headers = dict(scope.get("headers", ()))
        if self.hosts is not None:  # one Host header, a name (or an IPv6 literal) and a port of digits, a trusted name
            named = [value.decode("latin-1").strip().lower() for name, value in scope.get("headers", ())
                     if name == b"host"]
            found = HOST.fullmatch(named[0]) if len(named) == 1 else None
            if found is None or found["name"] not in self.hosts:
                shown = found["name"] if found else ", ".join(named) or "none"
                return await answer(ApiError(400, f"host '{shown}' is not served here", code="invalid_host"))
        # one Authorization header, naming its scheme in any case (of two, a proxy's and a client's, neither is chosen)
        keys = [value for name, value in scope.get("headers", ()) if name == b"authorization"]
        scheme, _, given = (keys[0] if len(keys) == 1 else b"").strip().partition(b" ")
        if self.key is not None and scope["path"] not in self.open_paths and \
                not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key.encode())):
            return await answer(ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')" if
                                         len(keys) < 2 else f"{len(keys)} Authorization headers: send one",
                                         code="invalid_api_key"))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return await answer(too_large(self.max_body))
        if scope["method"] in ("POST", "PUT", "PATCH"):  # read here, counted (a declared length may not frame it)
            body, more = bytearray(), True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body:
                    return await answer(too_large(self.max_body))
            kind = next((value for name, value in scope.get("headers", ()) if name == b"content-type"), b"")  # (the
            if self.posted(scope) and is_json(kind):  # first, as the app reads it)
                read = bytes(body)  # (a long read off the event loop, a short one here: the thread pool may be busy)
                fault = body_fault(read) if len(read) <= INLINE_BODY else await asyncio.to_thread(body_fault, read)
                if fault is not None:
                    return await answer(fault)
            whole, after = [{"type": "http.request", "body": bytes(body), "more_body": False}], receive

            async def replayed() -> dict[str, Any]:
                return whole.pop() if whole else await after()  # (then a disconnect, when it comes)

            receive = replayed
        try:
            await self.app(scope, receive, sent)
        except asyncio.CancelledError:  # the server dropped the request: Ray Serve does once its client left
            scope.setdefault(ENDED, 499)
            raise
        except Exception as error:  # noqa: BLE001 - the one 500 path: logged, counted, in the API's shape
            scope[ENDED] = 500
            fault = server_fault(error, label())
            if status is None:
                await answer(fault, count=False)
        finally:
            if scope["path"].startswith("/v1/") and (ended := scope.get(ENDED, status)) is not None:
                self.metrics.request(label(), ended)


INLINE_BODY = 1 << 16  # bytes of a body `Guard` checks on the event loop (a longer one: on a thread)


def is_json(content_type: bytes) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON: none given, application/json, application/*+json."""
    kind = content_type.decode("latin-1").partition(";")[0].strip().lower()
    return not kind or kind == "application/json" or kind.startswith("application/") and kind.endswith("+json")


def heard(receive: Callable) -> Callable:
    """`receive`, where a channel that fails is a client that left, for good: Ray Serve's replica hears its client
    through a call to the proxy, which raises (TaskCancelledError) once the proxy has cancelled the request, and
    then never answers again; that is a disconnect (a 499), not a fault of the server's."""
    failed = False

    async def received() -> dict[str, Any]:
        nonlocal failed
        if not failed:
            try:
                return await receive()
            except Exception as error:  # noqa: BLE001 - whatever the transport raised, the client cannot be heard
                LOG.debug("receive failed (%s): taken for a disconnect", type(error).__name__)
                failed = True
        return {"type": "http.disconnect"}

    return received


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds this server's {limit / 1e6:g} MB (--max-body-mb)",
                    code="request_too_large")

