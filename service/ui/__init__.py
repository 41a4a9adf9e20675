"""The operator page at `/ui`: upload an image or PDF, pick a task, see the page with boxes and confidences drawn,
the text / markdown / JSON result and timings; multi-page jobs fill in page by page from the events stream.

A static page (HTML + vanilla JS + CSS in service/ui/static, no build step, nothing fetched from a CDN) served by the
ingress itself, so it works wherever the API does; it calls the public API (`/v1/ocr`, `/v1/jobs`) with the API key
typed into the page. `ocr-serve ui` prints (and optionally opens) the URL.
"""

from __future__ import annotations

import argparse
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

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
    return resources.files("service.ui").joinpath("static", name).read_bytes()


def make_router(ctx) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/ui")
    @router.get("/ui/")
    async def index():
        return Response(_asset("index.html"), media_type=ASSETS["index.html"], headers=SECURITY_HEADERS)

    @router.get("/ui/config.json")
    async def config():
        """What the page offers: tasks (and which the running engine supports), adapters, job limits."""
        info = await ctx.get_engine_info()
        try:
            adapters = await ctx.engine.list_adapters()
        except Exception:  # adapters are optional in the page
            adapters = []
        tasks = [{"name": t.name, "description": t.description, "output": t.output,
                  "supported": t.name in info.supported_tasks} for t in TASKS.values()]
        return JSONResponse({"engine": info.name, "model": info.model, "tasks": tasks, "adapters": adapters,
                             "max_pdf_pages": ctx.settings.max_pdf_pages,
                             "auth_required": not getattr(ctx.authenticator, "open_mode", False)},
                            headers={"Cache-Control": "no-cache"})

    @router.get("/ui/{name}")
    async def asset(name: str):
        if name not in ASSETS:
            return JSONResponse({"error": {"code": "not_found", "message": "no such UI file"}}, status_code=404)
        return Response(_asset(name), media_type=ASSETS[name], headers=SECURITY_HEADERS)

    return router


def cmd_ui(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/ui"
    print(f"OCR web UI: {url}  (start the service with `ocr-serve serve` if it is not running)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("ui", help="print (or --open) the URL of the web UI served by a running service")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the service")
    p.add_argument("--open", action="store_true", help="open it in the default browser")
    p.set_defaults(func=cmd_ui)
