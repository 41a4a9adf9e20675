"""The ingress FastAPI application: routers, error mapping and the streaming body-size cap.

`create_app(ctx)` is Ray-agnostic: the Serve ingress deployment builds it with a handle-backed engine client, unit
tests build it around a local engine.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.context import AppContext
from service.api.health import make_router as health_router
from service.api.adapters import make_router as adapters_router
from service.api.ocr import make_router as ocr_router
from service.api.openai import make_router as openai_router
from service.api.jobs import JOB_MULTIPART_OVERHEAD_BYTES
from service.api.jobs import make_router as jobs_router
from service.errors import ERROR_CODES, OCRError
from service.metrics import CLIENT_CLOSED_REQUEST, RequestMetricsMiddleware
from service.ui import make_router as ui_router

log = logging.getLogger(__name__)


class BodySizeLimit:
    """413 `payload_too_large` as soon as the body passes the cap, counted while streaming (no Content-Length trust)."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
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
        received = 0
        response_started = False
        overflowed = False  # once set, whatever the app answers (a parser may swallow the exception) is replaced

        async def counting_receive() -> Message:
            nonlocal received, overflowed
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    overflowed = True
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if overflowed and not response_started:
                return  # e.g. multipart parsing turned _BodyTooLarge into a 400: the client gets the 413 below
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception:
            if not overflowed:
                raise  # not a body overflow: the error handlers outside report it
        if overflowed and not response_started:
            await _send_error(send, too_large)


class _BodyTooLarge(Exception):
    pass


class DrainGate:
    """Counts requests that do work (POST, PUT, PATCH, DELETE) in `ctx.in_flight`; the drain waits for 0. While
    `ctx.draining`, new ones get 503 `shutting_down` with Retry-After; reads (GET/HEAD: probes, metrics, job polling,
    long-lived event streams) are still answered and not waited for."""

    NEW_WORK = {"POST", "PUT", "PATCH", "DELETE"}

    def __init__(self, app: ASGIApp, ctx: AppContext):
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in self.NEW_WORK:
            await self.app(scope, receive, send)
            return
        if self.ctx.draining:
            await _send_error(send, OCRError("shutting_down", "this instance is shutting down; retry",
                                             headers={"Retry-After": "1"}))
            return
        self.ctx.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.ctx.in_flight -= 1


async def _send_error(send: Send, error: OCRError) -> None:
    import json

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
    app.add_middleware(BodySizeLimit, max_bytes=ctx.settings.max_body_bytes,
                       path_limits={"/v1/jobs": ctx.settings.max_pdf_bytes + JOB_MULTIPART_OVERHEAD_BYTES})
    app.add_middleware(DrainGate, ctx=ctx)  # outermost: a draining instance refuses before reading any body
    # counts every /v1/ocr (and /v1/jobs) answer with its final status, whichever layer produced it
    app.add_middleware(RequestMetricsMiddleware, metrics=ctx.metrics)
    return app
