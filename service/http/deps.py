"""What route handlers take as FastAPI dependencies: the application's context, the caller's principal (every route
that does work authenticates through here, before its body is read) and the admin check."""

from __future__ import annotations

from fastapi import Depends, Request

from service.admission.auth import Principal, require_admin
from service.http.middleware import STATE_TENANT
from service.pipeline.context import AppContext


def app_context(request: Request) -> AppContext:
    return request.app.state.ctx


def principal(request: Request, ctx: AppContext = Depends(app_context)) -> Principal:
    """The caller, from its API key (401/400 otherwise); its tenant labels the request's metrics."""
    caller = ctx.authenticator.authenticate(request.headers)
    setattr(request.state, STATE_TENANT, caller.tenant)
    return caller


def admin(caller: Principal = Depends(principal)) -> Principal:
    """For admin endpoints (adapter load/unload): 403 `forbidden` unless the key has the admin role."""
    return require_admin(caller)
