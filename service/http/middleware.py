"""ASGI middleware every request passes, outermost first: request metrics (the final status and error code,
whichever layer answered), the header cap, the drain gate, the tenant's concurrency slot, the body's size and pace.
Each refuses with the API's JSON error body before a route (or a parser) runs."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import ERROR_CODES, OCRError
from service.http.sse import sse
from service.observability.metrics import IngressMetrics, task_label
from service.pipeline.context import AppContext

# Routes counted in `ocr_requests_total` (path prefix -> `endpoint` label); health probes are not requests.
COUNTED_ENDPOINTS = {"/v1/ocr": "ocr", "/v1/jobs": "jobs"}

# A client that went away before its whole answer was sent: neither a success nor a fault of ours. Counted with
# nginx's status for it, 499, and this code (no response carries either: nobody is there to read it).
CLIENT_CLOSED_REQUEST = 499

CLIENT_DISCONNECTED = "client_disconnected"

# Keys the handlers put into the ASGI scope state (request.state.<key>) for the middleware's labels.
STATE_TASK = "metrics_task"

STATE_TENANT = "metrics_tenant"


class RequestMetricsMiddleware:
    """Counts every request to a COUNTED_ENDPOINTS route with its final HTTP status and error code, whichever layer
    answered (handler, exception handlers, body-size cap). Handlers add `task`/`tenant` via `request.state`; the error
    code is read from the (small) JSON error body. A request whose client disconnected before the answer's last byte
    (an `http.disconnect` from the server, or Serve cancelling the request when its proxy saw the client go) counts
    as 499 `client_disconnected`, whatever the app answered into the void."""

    def __init__(self, app, metrics: IngressMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        endpoint = _endpoint(scope)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        status = 500
        error_body = bytearray()
        answered = disconnected = False

        async def watching_receive():
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not answered:
                disconnected = True
            return message

        async def recording_send(message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                if status >= 400 and len(error_body) < 4096:
                    error_body.extend(message.get("body", b""))
                answered = answered or not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, watching_receive, recording_send)
        except asyncio.CancelledError:
            disconnected = not answered
            raise
        finally:
            if disconnected:
                status, code = CLIENT_CLOSED_REQUEST, CLIENT_DISCONNECTED
            else:
                code = "ok" if status < 400 else _error_code(bytes(error_body), status)
            self.metrics.request_finished(endpoint=endpoint, task=task_label(state.get(STATE_TASK)),
                                          status=status, code=code, tenant=str(state.get(STATE_TENANT) or "unknown"),
                                          seconds=time.perf_counter() - started)


def _endpoint(scope) -> str | None:
    if scope.get("type") != "http":
        return None
    path = scope.get("path", "")
    for prefix, name in COUNTED_ENDPOINTS.items():
        if path == prefix or path.startswith(prefix + "/"):
            return name
    return None


def _error_code(body: bytes, status: int) -> str:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if code in ERROR_CODES:
        return code
    return "internal_error" if status >= 500 else "invalid_request"


class HeaderSizeLimit:
    """431 `headers_too_large` when the request line and headers exceed `max_header_bytes`. The HTTP edge
    (service/serve/edge.py) refuses such a request while it arrives, before holding it whole; this check covers any
    front end that hands the app a larger one."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and request_head_bytes(scope) > self.max_bytes:
            await send_error(send, OCRError("headers_too_large",
                                             f"request line and headers exceed {self.max_bytes} bytes"))
            return
        await self.app(scope, receive, send)


def request_head_bytes(scope: Scope) -> int:
    """The size of the request line and headers as they came over HTTP/1.1 (`NAME: value\r\n` per header)."""
    line = len(scope.get("method", "")) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    return line + 12 + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or ())


class DrainGate:
    """Counts requests that do work (POST, PUT, PATCH, DELETE) in `ctx.in_flight`; the drain waits for 0. While
    `ctx.draining`, new ones get 503 `shutting_down` with Retry-After; reads (GET/HEAD: probes, metrics, job polling,
    long-lived event streams) are still answered and not waited for.

    Every request runs as a task of its own in `ctx.open_requests`, so that at the drain's deadline `cut_requests`
    can end whatever is left: a request without a response yet gets 503 `shutting_down` with Retry-After, a stream
    that has begun gets a last `shutting_down` error event and ends. No accepted request is left without an answer
    when the replica stops."""

    NEW_WORK = {"POST", "PUT", "PATCH", "DELETE"}

    def __init__(self, app: ASGIApp, ctx: AppContext):
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        new_work = scope.get("method") in self.NEW_WORK
        if new_work and self.ctx.draining:
            await send_error(send, shutting_down())
            return
        response: dict[str, Any] = {}  # the response's start message, once sent
        finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.start":
                response.update(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        work = asyncio.ensure_future(self.app(scope, receive, tracking_send))
        self.ctx.open_requests.add(work)
        self.ctx.in_flight += new_work
        try:
            await work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not work.cancelled() or (current is not None and current.cancelling()):
                raise  # the caller (client gone, Serve) cancelled this request, not the drain
            if not finished:  # cut by the drain
                await _end_cut_response(scope, response, send)
        finally:
            self.ctx.in_flight -= new_work
            self.ctx.open_requests.discard(work)


def shutting_down() -> OCRError:
    return OCRError("shutting_down", "this instance is shutting down; retry", headers={"Retry-After": "1"})


def cut_requests(ctx: AppContext) -> int:
    """The drain's deadline: end every open request of this replica (DrainGate answers each). Returns how many."""
    ctx.draining = True
    open_requests = list(ctx.open_requests)
    for work in open_requests:
        work.cancel()
    return len(open_requests)


# OpenAI clients read errors from an SSE `data:` line without an event name; our streams name the event `error`
OPENAI_STREAM_PATHS = ("/v1/chat/completions", "/v1/completions")


async def _end_cut_response(scope: Scope, response: dict[str, Any], send: Send) -> None:
    error = shutting_down()
    if not response:
        await send_error(send, error)
        return
    body = b""
    content_type = dict(response.get("headers") or []).get(b"content-type", b"")
    if content_type.startswith(b"text/event-stream"):
        openai = scope.get("path") in OPENAI_STREAM_PATHS
        body = sse(error.body(), event=None if openai else "error").encode()
    try:
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # the client is gone already: nothing left to tell it
        pass


class TenantConcurrencyLimit:
    """At most `max_per_tenant` requests to /v1/ of one tenant in flight on this replica (each ingress replica counts
    its own): past it 429 `too_many_concurrent_requests` with Retry-After, before the body is read. The tenant is the
    one the request's key names; a request whose key does not authenticate passes on to its route, which answers
    401."""

    def __init__(self, app: ASGIApp, ctx: AppContext, max_per_tenant: int):
        self.app = app
        self.ctx = ctx
        self.max_per_tenant = max_per_tenant
        self.in_flight: dict[str, int] = {}  # tenant → requests in flight; a tenant with none has no entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.max_per_tenant or scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        try:
            tenant = self.ctx.authenticator.authenticate(Headers(scope=scope)).tenant
        except OCRError:
            await self.app(scope, receive, send)
            return
        if self.in_flight.get(tenant, 0) >= self.max_per_tenant:
            await send_error(send, OCRError(
                "too_many_concurrent_requests",
                f"tenant {tenant!r} already has {self.max_per_tenant} requests in flight; retry",
                headers={"Retry-After": "1"}))
            return
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[tenant] -= 1
            if not self.in_flight[tenant]:
                del self.in_flight[tenant]


class BodyLimits:
    """The request body's size and pace, checked while it streams in (no Content-Length trust):
    413 `payload_too_large` as soon as it passes the cap; 408 `request_timeout` when it arrives slower than
    `timeout_s` plus one second per `min_rate` bytes received, counted from the app's first read. Whatever the app
    (or a parser that swallowed the error) answered instead, the client gets the refusal."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, min_rate: int,
                 path_limits: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.path_limits = path_limits or {}  # exact path → its own cap (jobs take PDFs up to max_pdf_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = OCRError("payload_too_large", f"request body exceeds {max_bytes} bytes")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await send_error(send, too_large)
            return
        loop = asyncio.get_running_loop()
        first_read: float | None = None
        received = 0
        body_complete = False
        response_started = False
        refusal: OCRError | None = None  # once set, whatever the app answers is replaced

        async def limited_receive() -> Message:
            nonlocal first_read, received, body_complete, refusal
            if body_complete:  # only http.disconnect is left to wait for, as long as it takes
                return await receive()
            if first_read is None:
                first_read = loop.time()
            allowed = first_read + self.timeout_s + (received / self.min_rate if self.min_rate else 0.0)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, allowed - loop.time()))
            except TimeoutError:
                refusal = OCRError("request_timeout", f"the request body arrived too slowly ({received} bytes in "
                                   f"{loop.time() - first_read:.0f} s)")
                raise _BodyRefused() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_complete = not message.get("more_body", False)
                if received > max_bytes:
                    refusal = too_large
                    raise _BodyRefused()
            else:
                body_complete = True
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if refusal is not None and not response_started:
                return  # e.g. multipart parsing turned _BodyRefused into a 400: the client gets the refusal below
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception:
            if refusal is None:
                raise  # not a body refusal: the error handlers outside report it
        if refusal is not None and not response_started:
            await send_error(send, refusal)


class _BodyRefused(Exception):
    pass


async def send_error(send: Send, error: OCRError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
