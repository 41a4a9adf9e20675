"""Liveness, readiness and model listing.

`/healthz` and `/readyz` answer without a key (probes carry none; they show the engine kind and the base model name,
nothing tenant-specific). `/v1/models` needs a key when the service has a key file: adapter names are tenants'
business, and it lists only the adapters the calling key may use.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from service.admission.auth import Principal
from service.errors import openapi_error_responses
from service.http.deps import app_context, principal
from service.pipeline.context import AppContext

READY_TIMEOUT_S = 30.0

router = APIRouter()


@router.get("/healthz", summary="Process is alive")
async def healthz():
    return {"status": "ok"}


@router.get("/readyz", summary="Engine loaded and a real tiny inference passed",
            responses={503: {"description": "Not ready: engine unavailable, or draining before shutdown."}})
async def readyz(ctx: AppContext = Depends(app_context)):
    if ctx.draining:
        return JSONResponse({"status": "draining", "in_flight": ctx.in_flight}, status_code=503)
    started = time.perf_counter()
    try:
        await asyncio.wait_for(ctx.engine.check_health(), READY_TIMEOUT_S)
        info = await ctx.get_engine_info()
    except Exception as exc:  # any failure means not ready; the reason class is safe to show
        return JSONResponse({"status": "unavailable", "reason": type(exc).__name__}, status_code=503)
    return {"status": "ready", "engine": info.name, "model": info.model,
            "check_ms": round((time.perf_counter() - started) * 1000, 1), "in_flight": ctx.in_flight}


@router.get("/v1/models", summary="Base model and the LoRA adapters the calling key may use (OpenAI format)",
            responses=openapi_error_responses(400, 401))
async def models(ctx: AppContext = Depends(app_context), caller: Principal = Depends(principal)):
    info = await ctx.get_engine_info()
    adapters = [name for name in await ctx.engine.list_adapters() if caller.may_use_adapter(name)]
    data = [{"id": info.model, "object": "model", "owned_by": "ocr-service", "root": info.model, "parent": None}]
    data += [{"id": name, "object": "model", "owned_by": "ocr-service", "root": name, "parent": info.model}
             for name in adapters]
    return {"object": "list", "data": data}
