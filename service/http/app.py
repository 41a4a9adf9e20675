"""The ingress FastAPI application: routers, error mapping, and the middleware every request passes first (header
cap, drain, per-tenant concurrency, body size and pace).

`create_app(ctx)` is Ray-agnostic: the Serve ingress deployment builds it with a handle-backed engine client, unit
tests build it around a local engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.pipeline.context import AppContext
from service.http.routes.health import make_router as health_router
from service.http.routes.adapters import make_router as adapters_router
from service.http.routes.ocr import make_router as ocr_router
from service.http.openai.router import make_router as openai_router
from service.http.routes.jobs import JOB_MULTIPART_OVERHEAD_BYTES
from service.http.routes.jobs import make_router as jobs_router
from service.errors import ERROR_CODES, OCRError
from service.observability.metrics import CLIENT_CLOSED_REQUEST, RequestMetricsMiddleware
from service.http.routes.ui import make_router as ui_router

log = logging.getLogger(__name__)


class HeaderSizeLimit:
    """431 `headers_too_large` when the request line and headers exceed `max_header_bytes`. The HTTP edge
    (service/serve/edge.py) refuses such a request while it arrives, before holding it whole; this check covers any
    front end that hands the app a larger one."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and request_head_bytes(scope) > self.max_bytes:
            await _send_error(send, OCRError("headers_too_large",
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
            await _send_error(send, shutting_down())
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
        await _send_error(send, error)
        return
    body = b""
    content_type = dict(response.get("headers") or []).get(b"content-type", b"")
    if content_type.startswith(b"text/event-stream"):
        data = json.dumps(error.body())
        frame = f"data: {data}\n\n" if scope.get("path") in OPENAI_STREAM_PATHS else f"event: error\ndata: {data}\n\n"
        body = frame.encode()
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
            await _send_error(send, OCRError(
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
            await _send_error(send, too_large)
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
            await _send_error(send, refusal)


class _BodyRefused(Exception):
    pass


async def _send_error(send: Send, error: OCRError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_response(error: OCRError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(ctx: AppContext) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        """Background work of the replica (Serve runs the ASGI lifespan at replica start and stop)."""
        if ctx.redis_watch is not None:
            ctx.redis_watch.start()
        try:
            yield
        finally:
            if ctx.redis_watch is not None:
                await ctx.redis_watch.close()

    app = FastAPI(
        lifespan=lifespan,
        title="HunyuanOCR service",
        version="0.1.0",
        description="OCR API: spotting, text, document parsing, tables, formulas, charts, field extraction, "
                    "translation. Errors are `{\"error\": {\"code\", \"message\"}}` with codes: "
                    + ", ".join(f"`{c}` ({s})" for c, (s, _) in ERROR_CODES.items()),
    )
    app.state.ctx = ctx

    @app.exception_handler(OCRError)
    async def _ocr_error(_: Request, exc: OCRError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        code = "invalid_request" if first.get("type") == "json_invalid" else "validation_error"
        return error_response(OCRError(code, f"{where}: {first.get('msg', 'invalid value')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type",
                401: "unauthorized", 403: "forbidden", 429: "rate_limited"}.get(exc.status_code)
        if code is None:
            code = "invalid_request" if exc.status_code < 500 else "internal_error"
        err = OCRError(code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code if exc.status_code < 500 else 500,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, exc: ClientDisconnect):
        # the client closed the connection before its body was read: not a fault of ours, and nobody reads an answer
        # (RequestMetricsMiddleware counts it as `client_disconnected`)
        log.debug("client disconnected while sending its request")
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        # never echo exception text: it may contain document content
        log.error("unhandled error %s", type(exc).__name__, exc_info=exc)
        return error_response(OCRError("internal_error", "internal error"))

    app.include_router(health_router(ctx))
    app.include_router(ocr_router(ctx))
    app.include_router(openai_router(ctx))
    app.include_router(adapters_router(ctx))
    app.include_router(jobs_router(ctx))
    app.include_router(ui_router(ctx))
    for extend in ctx.extras.get("routers", []):
        app.include_router(extend(ctx))
    settings = ctx.settings
    # innermost first: body limits around the routes, then the tenant's slot (taken before any body is read), the
    # drain (a draining instance refuses before anything else), the header cap, metrics outermost
    app.add_middleware(BodyLimits, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       min_rate=settings.body_min_rate_bytes_s,
                       path_limits={"/v1/jobs": settings.max_pdf_bytes + JOB_MULTIPART_OVERHEAD_BYTES})
    app.add_middleware(TenantConcurrencyLimit, ctx=ctx, max_per_tenant=settings.max_concurrent_requests_per_tenant)
    app.add_middleware(DrainGate, ctx=ctx)
    app.add_middleware(HeaderSizeLimit, max_bytes=settings.max_header_bytes)
    # counts every /v1/ocr (and /v1/jobs) answer with its final status, whichever layer produced it
    app.add_middleware(RequestMetricsMiddleware, metrics=ctx.metrics)
    return app
