"""`POST /v1/ocr`: one image (or single-page PDF) as JSON (`image`: base64 or a data URL) or multipart (`file`).

The handler reads the body, then the pipeline admits the page (service/pipeline/admit.py) and recognises it
(service/pipeline/run.py), or streams its events with `stream: true`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.admission.auth import Principal
from service.config import Settings
from service.errors import OCRError, openapi_error_responses
from service.http.bodies import read_json_model, request_from_form_fields
from service.http.deps import app_context, principal
from service.http.middleware import STATE_TASK
from service.http.sse import first_event_then_rest, sse
from service.pipeline.admit import admit_page
from service.pipeline.context import AppContext
from service.pipeline.run import recognise, stream_page
from service.schema import OCRRequest, OCRResponse

log = logging.getLogger(__name__)
router = APIRouter()


def _multipart_schema() -> dict:
    props = {name: {"type": "string"} for name in ("task", "language", "target_language", "adapter")}
    props.update({
        "file": {"type": "string", "format": "binary", "description": "The image or single-page PDF."},
        "fields": {"type": "string", "description": "Comma-separated field names or a JSON list (extract)."},
        "schema": {"type": "string", "description": "JSON Schema as a JSON string (extract)."},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "confidence": {"type": "boolean"},
        "include_raw": {"type": "boolean"},
    })
    return {"type": "object", "properties": props, "required": ["file"]}


OCR_OPENAPI_EXTRA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/OCRRequest"}},
            "multipart/form-data": {"schema": _multipart_schema()},
        },
    }
}



# `stream: true` answers 200 with Server-Sent Events instead of the JSON body (docs/API.md, "Streaming")
SSE_RESPONSE = {200: {"description": "The OCR result (JSON), or with `stream: true` a `text/event-stream` of "
                                     "`delta`/`line` events and a final `result` (or `error`) event.",
                      "content": {"text/event-stream": {"schema": {
                          "type": "object", "required": ["event", "data"],
                          "properties": {"event": {"type": "string", "enum": ["delta", "line", "result", "error"]},
                                         "data": {"type": "string", "description": "JSON of the event."}}}}}}}



async def read_ocr_request(request: Request, settings: Settings) -> tuple[OCRRequest, bytes | str]:
    """Parse a JSON or multipart body into the request model and the file: its bytes (multipart), or the JSON
    body's base64 string, which admission decodes once the request has paid its first token."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        try:
            form = await request.form(max_files=1, max_fields=32)
        except Exception as exc:  # starlette raises various errors for malformed multipart
            raise OCRError("invalid_request", "malformed multipart body") from exc
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise OCRError("empty_image", "multipart body needs a `file` part")
        data = await upload.read()
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            if key == "file":
                continue
            if not isinstance(value, str):
                raise OCRError("invalid_request", f"form field {key!r} must be text")
            fields[key] = value
        model = request_from_form_fields(fields, settings.limits.max_json_items)
        if model.image:
            raise OCRError("invalid_request", "send the image either as `file` or as `image`, not both")
        if not data:
            raise OCRError("empty_image", "the uploaded file is empty")
        return model, data
    if content_type not in ("application/json", ""):
        raise OCRError("unsupported_media_type", "send application/json or multipart/form-data")
    body = await request.body()
    if not body:
        raise OCRError("empty_image", "the request body is empty")
    model = await read_json_model(body, OCRRequest, settings.limits.max_json_items)  # strict types, work bounded first
    if not model.image:
        raise OCRError("empty_image", "the `image` field is missing or empty")
    return model, model.image


@router.post("/v1/ocr", response_model=OCRResponse, openapi_extra=OCR_OPENAPI_EXTRA,
             responses={**openapi_error_responses(), **SSE_RESPONSE}, summary="Recognise one image (or single-page PDF)")
async def ocr(request: Request, ctx: AppContext = Depends(app_context), caller: Principal = Depends(principal)):
    started = time.perf_counter()
    req, data = await read_ocr_request(request, ctx.settings)
    setattr(request.state, STATE_TASK, req.task)  # metrics label (bounded to the task table by the middleware)
    page, headers = await admit_page(ctx, caller, req, data, "ocr-" + uuid.uuid4().hex[:24])
    model = req.adapter or (await ctx.get_engine_info()).model
    if req.stream:
        events = await first_event_then_rest(_sse_events(stream_page(ctx, req, page, model=model, started=started)),
                                             ctx.settings.server.request_timeout_s)
        return StreamingResponse(events, headers=headers, media_type="text/event-stream")
    response = await recognise(ctx, req, page, model=model, started=started)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


async def _sse_events(events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[str]:
    """The pipeline's (event, data) pairs as SSE frames; a failure once output has gone out becomes an `error`
    event (before it, it is raised: `first_event_then_rest` makes it the response)."""
    sent = False
    try:
        async for event, data in events:
            sent = True
            yield sse(data, event=event)
    except OCRError as exc:
        if not sent:
            raise
        yield sse(exc.body(), event="error")
    except Exception:
        if not sent:
            raise
        log.exception("stream failed")
        yield sse(OCRError("internal_error", "the engine failed while streaming").body(), event="error")
