"""The ingress FastAPI application: the routers (service/http/routes/, service/http/openai/), the middleware every
request passes first (service/http/middleware.py) and the mapping of every error to the API's JSON error body.

`create_app(ctx)` is Ray-agnostic: the Serve ingress deployment builds it with a handle-backed engine client, unit
tests build it around a local engine. Handlers find the context in `app.state.ctx` and the job runner in
`app.state.jobs`.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from service.errors import ERROR_CODES, OCRError
from service.http.middleware import (CLIENT_CLOSED_REQUEST, BodyLimits, DrainGate, HeaderSizeLimit,
                                     RequestMetricsMiddleware, TenantConcurrencyLimit)
from service.http.openai.router import router as openai_router
from service.http.openapi import openapi_document
from service.http.routes.adapters import router as adapters_router
from service.http.routes.health import router as health_router
from service.http.routes.jobs import JOB_MULTIPART_OVERHEAD_BYTES
from service.http.routes.jobs import router as jobs_router
from service.http.routes.ocr import router as ocr_router
from service.http.routes.ui import router as ui_router
from service.jobs.runner import JobRunner
from service.jobs.store import make_store
from service.pipeline.context import AppContext

log = logging.getLogger(__name__)


def error_response(error: OCRError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def allowed_methods(app: FastAPI, scope) -> list[str]:
    """Every method the routes of this request's path take (a 405's `Allow`)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


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
                    "translation. Errors are `{\"error\": {\"code\", \"message\", \"type\", \"param\"}}` "
                    "with codes: " + ", ".join(f"`{c}` ({s})" for c, (s, _) in ERROR_CODES.items()),
        generate_unique_id_function=lambda route: route.name,  # operationIds: the handlers' names
    )
    open_mode = getattr(ctx.authenticator, "open_mode", False)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, ctx.settings, auth_required=not open_mode)
        return app.openapi_schema

    app.openapi = openapi
    app.state.ctx = ctx
    app.state.jobs = JobRunner(ctx, make_store(ctx.settings))

    @app.exception_handler(OCRError)
    async def _ocr_error(_: Request, exc: OCRError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ())]
        where = ".".join(loc) or "body"
        code = "invalid_request" if first.get("type") == "json_invalid" else "validation_error"
        # the field's path without its location kind (`body`, `path`, `query`), as OpenAI's `param` names it
        param = ".".join(loc[1:] if loc and loc[0] in ("body", "path", "query", "header") else loc) or None
        return error_response(OCRError(code, f"{where}: {first.get('msg', 'invalid value')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type",
                401: "unauthorized", 403: "forbidden", 429: "rate_limited"}.get(exc.status_code)
        if code is None:
            code = "invalid_request" if exc.status_code < 500 else "internal_error"
        err = OCRError(code, str(exc.detail))
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # Starlette names the first route's methods; the path may have more routes
            headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
        return JSONResponse(err.body(), status_code=exc.status_code if exc.status_code < 500 else 500,
                            headers=headers or None)

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

    for router in (health_router, ocr_router, openai_router, adapters_router, jobs_router, ui_router):
        app.include_router(router)
    settings = ctx.settings
    # innermost first: body limits around the routes, then the tenant's slot (taken before any body is read), the
    # drain (a draining instance refuses before anything else), the header cap, metrics outermost
    app.add_middleware(BodyLimits, max_bytes=settings.limits.max_body_bytes, timeout_s=settings.limits.body_timeout_s,
                       min_rate=settings.limits.body_min_rate_bytes_s,
                       path_limits={"/v1/jobs": settings.jobs.max_bytes + JOB_MULTIPART_OVERHEAD_BYTES})
    # open mode (no key file): every caller is one tenant, so a per-tenant cap would only cap the replica, which
    # Serve's max_ongoing_requests already does; the admission pool's tenant share is off there too
    app.add_middleware(TenantConcurrencyLimit, ctx=ctx,
                       max_per_tenant=0 if open_mode else settings.limits.max_concurrent_requests_per_tenant)
    app.add_middleware(DrainGate, ctx=ctx)
    app.add_middleware(HeaderSizeLimit, max_bytes=settings.limits.max_header_bytes)
    # counts every /v1/ocr (and /v1/jobs) answer with its final status, whichever layer produced it
    app.add_middleware(RequestMetricsMiddleware, metrics=ctx.metrics)
    return app
