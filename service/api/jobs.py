"""`/v1/jobs`: multi-page OCR (one PDF, or several images) with per-page results streamed in page order.

    POST   /v1/jobs              multipart: `file` (one PDF, or repeated image parts) + task fields, `pages`
                                 ("1-3,5"), `return_page_images` → 202 {id, links}
    GET    /v1/jobs/{id}         status, pages_done/pages_total, results so far (in page order)
    GET    /v1/jobs/{id}/events  SSE: one `page` event per page IN PAGE ORDER (`id:` = page index, so a reconnect
                                 with Last-Event-ID resumes), then one `done` event with the job summary
    DELETE /v1/jobs/{id}         cancel (pages already done stay readable)

Admission happens before the 202, in request order: authenticate → read the form → validate the task → inspect the
PDF in the sandbox (encrypted, page count, page boxes, content streams) or decode the images → pay for the first
page (429 when the tenant's bucket is empty) → store the job → start the runner. Later pages are paid for as they
are dispatched (the job is paced to the tenant's rate instead of failing). An optional `webhook` URL is checked and
its host resolved and pinned right after the form is read (400 `invalid_webhook` for anything but a public http(s)
address or an allow-listed host: service/jobs/webhook.py); the job's final state is POSTed there once it ends.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.admission.auth import Principal
from service.admission.budget import ImagePlan
from service.admission.images import DecodedImage, decode_image, sniff_format
from service.admission.pdf import choose_dpi, inspect_pdf, page_pixel_budget, parse_page_range
from service.api.context import AppContext
from service.api.ocr import admit, rate_limit_cost, request_from_form_fields, validate_task
from service.errors import OCRError, openapi_error_responses
from service.jobs.model import TERMINAL, JobAccepted, JobRecord, JobView
from service.jobs.runner import JobRunner, JobSource
from service.jobs.store import make_store
from service.jobs.webhook import validate_webhook
from service.metrics import STATE_TASK, STATE_TENANT

EVENTS_KEEPALIVE_S = 15.0
JOB_MULTIPART_OVERHEAD_BYTES = 1024 * 1024  # form fields and part headers on top of the files themselves
JOB_FIELDS = ("pages", "webhook", "return_page_images")  # form fields of jobs on top of the /v1/ocr ones


def _multipart_schema() -> dict:
    props: dict[str, Any] = {name: {"type": "string"} for name in ("task", "language", "target_language", "adapter")}
    props.update({
        "file": {"type": "array", "items": {"type": "string", "format": "binary"},
                 "description": "One PDF, or several images (one page each, in order)."},
        "fields": {"type": "string", "description": "Comma-separated field names or a JSON list (extract)."},
        "schema": {"type": "string", "description": "JSON Schema as a JSON string (extract)."},
        "max_tokens": {"type": "integer", "minimum": 1},
        "pages": {"type": "string", "description": "1-based pages to process, e.g. `1-3,5,9-` (default: all)."},
        "return_page_images": {"type": "boolean", "description": "Include a JPEG preview of each page (UI)."},
        "webhook": {"type": "string", "description": "http(s) URL that receives the final job status (POST, "
                    "signed when the service has a webhook secret); non-public hosts answer `invalid_webhook`."},
    })
    return {"type": "object", "properties": props, "required": ["file"]}


JOBS_OPENAPI_EXTRA = {"requestBody": {"required": True,
                                      "content": {"multipart/form-data": {"schema": _multipart_schema()}}}}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


async def _read_form(request: Request, settings) -> tuple[dict[str, str], list[bytes]]:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise OCRError("unsupported_media_type", "POST /v1/jobs takes multipart/form-data with `file` parts")
    try:
        form = await request.form(max_files=settings.max_pdf_pages + 1, max_fields=32)
    except Exception as exc:  # starlette raises various errors for malformed multipart
        if "too many files" in str(exc).lower():
            raise OCRError("too_many_pages", f"at most {settings.max_pdf_pages} images per job") from exc
        raise OCRError("invalid_request", "malformed multipart body") from exc
    fields: dict[str, str] = {}
    files: list[bytes] = []
    total = 0
    for key, value in form.multi_items():
        if key in ("file", "files"):
            if isinstance(value, str):
                raise OCRError("invalid_request", "`file` must be a file part")
            data = await value.read()
            total += len(data)
            if total > settings.max_pdf_bytes:
                raise OCRError("payload_too_large", f"the job's files exceed {settings.max_pdf_bytes} bytes")
            files.append(data)
        elif isinstance(value, str):
            fields[key] = value
        else:
            raise OCRError("invalid_request", f"form field {key!r} must be text")
    if not files or not any(files):
        raise OCRError("empty_image", "the job needs at least one non-empty `file` part")
    return fields, files


def _first_page_cost(ctx: AppContext, width: int, height: int) -> float:
    """What page 1 costs at the bucket (later pages are paid as they are dispatched, from their real plan)."""
    return rate_limit_cost(ctx, ImagePlan(width=width, height=height, scale=1.0, image_tokens=0, max_tokens=0))


def make_router(ctx: AppContext) -> APIRouter:
    settings = ctx.settings
    store = make_store(settings)
    runner = JobRunner(ctx, store)
    ctx.extras["jobs"] = runner  # tests and shutdown hooks reach the runner (and its store) here
    router = APIRouter()

    async def owned(job_id: str, principal: Principal):
        state = await store.get(job_id)
        # another tenant's job is "not found": job ids must not reveal that a job exists
        if state is None or (state[0].tenant != principal.tenant and principal.role != "admin"):
            raise OCRError("not_found", f"no job {job_id!r}")
        return state

    @router.post("/v1/jobs", status_code=202, response_model=JobAccepted, openapi_extra=JOBS_OPENAPI_EXTRA,
                 responses=openapi_error_responses(),
                 summary="Start a multi-page job (one PDF or several images)")
    async def create_job(request: Request):
        principal = ctx.authenticator.authenticate(request.headers)
        setattr(request.state, STATE_TENANT, principal.tenant)
        fields, files = await _read_form(request, settings)
        webhook_url = fields.get("webhook", "").strip()
        webhook = await validate_webhook(webhook_url, settings) if webhook_url else None
        pages_spec = fields.get("pages")
        return_images = _truthy(fields.get("return_page_images"))
        req = request_from_form_fields({k: v for k, v in fields.items() if k not in JOB_FIELDS},
                                       settings.max_json_items)
        setattr(request.state, STATE_TASK, req.task)
        if req.image or req.stream:
            raise OCRError("invalid_request", "jobs take `file` parts (no `image`) and stream via /events")
        await validate_task(ctx, req)
        if not principal.may_use_adapter(req.adapter):
            raise OCRError("forbidden", f"this API key may not use adapter {req.adapter!r}")
        info = await ctx.get_engine_info()

        formats = [sniff_format(data) for data in files]
        if "PDF" in formats:
            if len(files) != 1:
                raise OCRError("invalid_request", "send one PDF per job, or images only")
            pdf_info = await asyncio.to_thread(inspect_pdf, files[0], settings, pages_spec)
            numbers = [p.number for p in pdf_info.pages]
            first = pdf_info.pages[0]
            dpi = choose_dpi(first.width_pt, first.height_pt, max_dpi=settings.max_pdf_dpi,
                             max_pixels=page_pixel_budget(settings, info.name, req.max_tokens),
                             max_side=settings.max_image_side)
            source = JobSource(numbers=numbers, pdf=files[0])
            first_size = (round(first.width_pt * dpi / 72), round(first.height_pt * dpi / 72))
        else:
            numbers = parse_page_range(pages_spec, len(files), settings.max_pdf_pages)

            def decode_all() -> list[DecodedImage]:
                return [decode_image(files[n - 1], allowed_formats=settings.allowed_formats,
                                     max_pixels=settings.max_image_pixels, max_side=settings.max_image_side,
                                     max_frames=settings.max_frames) for n in numbers]

            images = await asyncio.to_thread(decode_all)
            source = JobSource(numbers=numbers, images=images)
            first_size = (images[0].width, images[0].height)
        headers = await admit(ctx, principal, _first_page_cost(ctx, *first_size))

        job_id = "job-" + uuid.uuid4().hex[:24]
        record = JobRecord(id=job_id, tenant=principal.tenant, task=req.task, source="pdf" if source.pdf else "images",
                           options=req.model_dump(mode="json", by_alias=True, exclude_none=True,
                                                  exclude={"image", "stream"}),
                           pages=numbers, return_page_images=return_images)
        await store.create(record)
        runner.start(record, req, source, principal, webhook)
        accepted = JobAccepted(id=job_id, status=record.status, pages_total=len(numbers), pages=numbers,
                               links={"self": f"/v1/jobs/{job_id}", "events": f"/v1/jobs/{job_id}/events"})
        return JSONResponse(accepted.model_dump(mode="json"), status_code=202,
                            headers={**headers, "Location": f"/v1/jobs/{job_id}"})

    @router.get("/v1/jobs/{job_id}", response_model=JobView, summary="Job status and the results so far",
                responses=openapi_error_responses(401, 403, 404))
    async def get_job(job_id: str, request: Request):
        principal = ctx.authenticator.authenticate(request.headers)
        record, done, failed = await owned(job_id, principal)
        pages = await store.pages(job_id)
        return JSONResponse(JobView.of(record, done, failed, pages).model_dump(mode="json"))

    @router.delete("/v1/jobs/{job_id}", response_model=JobView, summary="Cancel a job",
                   responses=openapi_error_responses(401, 403, 404))
    async def cancel_job(job_id: str, request: Request):
        principal = ctx.authenticator.authenticate(request.headers)
        record, _, _ = await owned(job_id, principal)
        if record.status not in TERMINAL:
            await runner.cancel(job_id)
        record, done, failed = await owned(job_id, principal)
        return JSONResponse(JobView.of(record, done, failed, None).model_dump(mode="json"))

    @router.get("/v1/jobs/{job_id}/events", summary="Server-Sent Events: one `page` event per page in page order, "
                "then `done`", response_class=StreamingResponse, responses=openapi_error_responses(401, 403, 404))
    async def job_events(job_id: str, request: Request):
        principal = ctx.authenticator.authenticate(request.headers)
        await owned(job_id, principal)
        start = resume_index(request.headers.get("last-event-id", ""))
        return StreamingResponse(_events(job_id, start, request.headers), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(job_id: str, next_index: int, headers) -> AsyncIterator[str]:
        """Pages strictly in order: page i is sent only after pages 0..i-1, however the engine finished them.
        The key is checked again every round (the authenticator re-reads the key file at most once per
        `api_keys_reload_interval_s`): a stream ends with an `unauthorized` event soon after its key is revoked."""
        last_sent = time.monotonic()
        while True:
            try:
                principal = ctx.authenticator.authenticate(headers)
                state = await store.get(job_id)
                if state is None or (state[0].tenant != principal.tenant and principal.role != "admin"):
                    yield _sse("error", OCRError("not_found", "the job expired or was removed").body())
                    return
                record, done, failed = state
                pending = {p.index: p for p in await store.pages(job_id, next_index)}
            except OCRError as exc:  # key revoked, or store unavailable (the client may reconnect with Last-Event-ID)
                yield _sse("error", exc.body())
                return
            while next_index in pending:
                yield _sse("page", pending.pop(next_index).model_dump(mode="json"), event_id=next_index)
                next_index += 1
                last_sent = time.monotonic()
            if record.status in TERMINAL:
                for index in sorted(pending):  # a cancelled job may have finished pages after a gap
                    yield _sse("page", pending[index].model_dump(mode="json"), event_id=index)
                yield _sse("done", JobView.of(record, done, failed, None).model_dump(mode="json"))
                return
            if time.monotonic() - last_sent >= EVENTS_KEEPALIVE_S:
                yield ": keepalive\n\n"
                last_sent = time.monotonic()
            await store.wait(job_id, EVENTS_KEEPALIVE_S)

    return router


def resume_index(last_event_id: str) -> int:
    """The first page to send after `Last-Event-ID` (the index of the last page event received; absent: 0). Only ids
    the stream could have sent are taken (at most 9 ASCII digits): 400 `invalid_request` otherwise."""
    last_id = last_event_id.strip()
    if not last_id:
        return 0
    if not (len(last_id) <= 9 and last_id.isascii() and last_id.isdigit()):
        raise OCRError("invalid_request", "Last-Event-ID must be the id of a page event (a page index)")
    return int(last_id) + 1


def _sse(event: str, data: Any, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
