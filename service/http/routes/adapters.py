"""LoRA adapters: `GET /v1/adapters` (anyone) and the admin endpoints `POST /v1/adapters/{name}/load|unload`.

Adapters live in `settings.engine.lora.adapters_dir` (one sub-directory per adapter, name = directory name) or are registered at
run time with an admin load that names a path. Requests pick one with `adapter` (/v1/ocr) or OpenAI `model`; Serve
model multiplexing routes them to replicas that already hold it. Load/unload act on the replica the call reaches
(adapters load lazily on every other replica at their first request).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.admission.auth import Principal
from service.http.deps import admin, app_context, principal
from service.pipeline.context import AppContext
from service.errors import OCRError, openapi_error_responses


class AdapterInfo(BaseModel):
    name: str
    loaded: bool = Field(description="Held in an engine replica's LoRA cache now (the replica that answered).")
    allowed: bool = Field(True, description="The calling key may use it.")


class AdapterList(BaseModel):
    object: str = "list"
    data: list[AdapterInfo]


class LoadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, max_length=1024, description="Adapter directory on the engine's filesystem "
                             "(default: `<adapters_dir>/<name>`).")


async def adapter_status(ctx: AppContext) -> list[dict[str, Any]]:
    status = getattr(ctx.engine, "adapter_status", None)
    if status is not None:
        return await status()
    return [{"name": name, "loaded": True} for name in await ctx.engine.list_adapters()]


router = APIRouter(tags=["adapters"])


@router.get("/v1/adapters", response_model=AdapterList, summary="LoRA adapters and whether they are loaded",
            responses=openapi_error_responses(401, 403, 503))
async def list_adapters(ctx: AppContext = Depends(app_context), caller: Principal = Depends(principal)):
    data = [AdapterInfo(name=item["name"], loaded=item["loaded"],
                        allowed=caller.may_use_adapter(item["name"])) for item in await adapter_status(ctx)]
    return AdapterList(data=data)


@router.post("/v1/adapters/{name}/load", response_model=AdapterList, summary="Load an adapter (admin)",
             responses=openapi_error_responses())
async def load_adapter(name: str, request: Request, ctx: AppContext = Depends(app_context),
                       _: Principal = Depends(admin)):
    raw = await request.body()
    body = LoadAdapterBody()
    if raw.strip():
        try:
            body = LoadAdapterBody.model_validate_json(raw)
        except ValidationError as exc:
            raise OCRError("validation_error", exc.errors()[0].get("msg", "invalid body")) from None
    await ctx.engine.load_adapter(name, body.path)
    ctx.metrics.adapters_known([name])
    return AdapterList(data=[AdapterInfo(**item) for item in await adapter_status(ctx)])


@router.post("/v1/adapters/{name}/unload", response_model=AdapterList, summary="Unload an adapter (admin)",
             responses=openapi_error_responses())
async def unload_adapter(name: str, ctx: AppContext = Depends(app_context), _: Principal = Depends(admin)):
    await ctx.engine.unload_adapter(name)
    return AdapterList(data=[AdapterInfo(**item) for item in await adapter_status(ctx)])
