"""The operator page at `/ui`: upload an image or PDF, pick a task, see the page with boxes and confidences drawn,
the text / markdown / JSON result and timings; multi-page jobs fill in page by page from the events stream.

A static page (HTML + vanilla JS + CSS in service/http/static, no build step, nothing fetched from a CDN) served by the
ingress itself, so it works wherever the API does; it calls the public API (`/v1/ocr`, `/v1/jobs`) with the API key
typed into the page. `ocr-serve ui` (service/cli/ui.py) prints (and optionally opens) the URL.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from service.admission.auth import key_from_headers
from service.errors import OCRError
from service.http.deps import app_context
from service.pipeline.context import AppContext
from service.tasks import TASKS

ASSETS = {  # the only files served: name → media type
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Everything comes from this origin; images are the uploaded file (blob:) or page previews (data:).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
                               "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> bytes:
    return resources.files("service.http").joinpath("static", name).read_bytes()


router = APIRouter(include_in_schema=False)


@router.get("/ui")
@router.get("/ui/")
async def index():
    return Response(_asset("index.html"), media_type=ASSETS["index.html"], headers=SECURITY_HEADERS)


@router.get("/ui/config.json")
async def config(request: Request, ctx: AppContext = Depends(app_context)):
    """What the page offers: tasks (and which the running engine supports), `features` (the engine serves adapters),
    whether keys are required (the key field shows only then), job limits, and the adapters the typed key may use. The page loads before a key is typed, so without a key this answers what /readyz and
    the API docs show anyway (engine kind, base model, tasks) and no adapters: their names are tenants'
    business. A key that is sent must be valid (401 otherwise, so the page can say so)."""
    auth_required = not getattr(ctx.authenticator, "open_mode", False)
    principal = None
    if not auth_required or key_from_headers(request.headers) is not None:
        principal = ctx.authenticator.authenticate(request.headers)
    info = await ctx.get_engine_info()
    adapters: list[str] = []
    if principal is not None:
        try:
            adapters = [name for name in await ctx.engine.list_adapters() if principal.may_use_adapter(name)]
        except Exception:  # adapters are optional in the page
            adapters = []
    tasks = [{"name": t.name, "description": t.description, "output": t.output,
              "supported": t.name in info.supported_tasks} for t in TASKS.values()]
    # the controls the page shows: only what this engine can do
    features = {"adapters": info.adapters_supported}
    return JSONResponse({"engine": info.name, "model": info.model, "tasks": tasks, "features": features,
                         "adapters": adapters,
                         "max_pdf_pages": ctx.settings.jobs.max_pages, "auth_required": auth_required,
                         "authenticated": principal is not None},
                        headers={"Cache-Control": "no-cache"})


@router.get("/ui/{name}")
async def asset(name: str):
    if name not in ASSETS:
        return JSONResponse(OCRError("not_found", "no such UI file").body(), status_code=404)
    return Response(_asset(name), media_type=ASSETS[name], headers=SECURITY_HEADERS)
