"""`/v1/jobs`: multi-page OCR (one PDF, or several images) with per-page results streamed in page order.

    POST   /v1/jobs              multipart: `file` (one PDF, or repeated image parts) + task fields, `pages`
                                 ("1-3,5"), `return_page_images` → 202 {id, links}
    GET    /v1/jobs/{id}         status, pages_done/pages_total, results so far (in page order)
    GET    /v1/jobs/{id}/events  SSE: one `page` event per page IN PAGE ORDER (`id:` = page index, so a reconnect
                                 with Last-Event-ID resumes), then one `done` event with the job summary
    DELETE /v1/jobs/{id}         cancel (pages already done stay readable)

Admission happens before the 202 (service/jobs/runner.py `submit`), in request order: authenticate → read the form → validate the task → take one of
the tenant's running-job slots (429 `too_many_jobs` past `max_running_jobs_per_tenant`) → one token (429
`rate_limited` when the tenant's bucket is empty; nothing of the files parsed yet) → on the admission pool, the images'
headers or the PDF's page count and boxes in the sandbox (its first page loaded too: a content-stream bomb on it is a
400 here), the decoded-pixel total checked against `max_request_pixels` (413 `too_many_pixels`) → the first page's
estimated cost → store the job → start the runner. Nothing is decoded or rendered before the 202: the job keeps the
upload, and later pages are paid for and decoded one at a time as they are dispatched (the job is paced to the
tenant's rate instead of failing). An optional `webhook` URL is checked and its host resolved and pinned right after
the form is read (400 `invalid_webhook` for anything but a public http(s) address or an allow-listed host:
service/jobs/webhook.py); the job's final state is POSTed there once it ends.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.admission.auth import Authenticator, Principal
from service.admission.pdf import parse_page_range
from service.config import Settings
from service.errors import OCRError, openapi_error_responses
from service.http.bodies import request_from_form_fields
from service.http.deps import app_context, principal
from service.http.middleware import STATE_TASK
from service.http.sse import KEEPALIVE, sse
from service.imaging import sniff_format
from service.jobs.model import TERMINAL, JobAccepted, JobView
from service.jobs.runner import JobRunner
from service.jobs.store import JobStore
from service.jobs.webhook import validate_webhook
from service.pipeline.admit import admit_task
from service.pipeline.context import AppContext

EVENTS_KEEPALIVE_S = 15.0
JOB_MULTIPART_OVERHEAD_BYTES = 1024 * 1024  # form fields and part headers on top of the files themselves
JOB_FIELDS = ("pages", "webhook", "return_page_images")  # form fields of jobs on top of the /v1/ocr ones

router = APIRouter()


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


async def _read_form(request: Request, settings: Settings) -> tuple[dict[str, str], list[bytes]]:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise OCRError("unsupported_media_type", "POST /v1/jobs takes multipart/form-data with `file` parts")
    try:
        form = await request.form(max_files=settings.jobs.max_pages + 1, max_fields=32)
    except Exception as exc:  # starlette raises various errors for malformed multipart
        if "too many files" in str(exc).lower():
            raise OCRError("too_many_pages", f"at most {settings.jobs.max_pages} images per job") from exc
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
            if total > settings.jobs.max_bytes:
                raise OCRError("payload_too_large", f"the job's files exceed {settings.jobs.max_bytes} bytes")
            files.append(data)
        elif isinstance(value, str):
            fields[key] = value
        else:
            raise OCRError("invalid_request", f"form field {key!r} must be text")
    if not files or not any(files):
        raise OCRError("empty_image", "the job needs at least one non-empty `file` part")
    return fields, files


def job_runner(request: Request) -> JobRunner:
    return request.app.state.jobs


async def owned(store: JobStore, job_id: str, caller: Principal):
    """The job's (record, done, failed), if the caller may see it: another tenant's job is "not found" (job ids must
    not reveal that a job exists)."""
    state = await store.get(job_id)
    if state is None or (state[0].tenant != caller.tenant and caller.role != "admin"):
        raise OCRError("not_found", f"no job {job_id!r}")
    return state


@router.post("/v1/jobs", status_code=202, response_model=JobAccepted, openapi_extra=JOBS_OPENAPI_EXTRA,
             responses=openapi_error_responses(), summary="Start a multi-page job (one PDF or several images)")
async def create_job(request: Request, ctx: AppContext = Depends(app_context), caller: Principal = Depends(principal),
                     runner: JobRunner = Depends(job_runner)):
    settings = ctx.settings
    fields, files = await _read_form(request, settings)
    webhook_url = fields.get("webhook", "").strip()
    webhook = await validate_webhook(webhook_url, settings) if webhook_url else None
    pages_spec = fields.get("pages")
    req = request_from_form_fields({k: v for k, v in fields.items() if k not in JOB_FIELDS}, settings.limits.max_json_items)
    setattr(request.state, STATE_TASK, req.task)
    if req.image or req.stream:
        raise OCRError("invalid_request", "jobs take `file` parts (no `image`) and stream via /events")
    engine = await admit_task(ctx, caller, req)
    numbers = None  # a PDF's pages are known once it is opened
    if "PDF" in (sniff_format(data) for data in files):
        if len(files) != 1:
            raise OCRError("invalid_request", "send one PDF per job, or images only")
    else:
        numbers = parse_page_range(pages_spec, len(files), settings.jobs.max_pages)
    record, headers = await runner.submit(caller, req, engine, files, numbers, pages_spec,
                                          _truthy(fields.get("return_page_images")), webhook)
    accepted = JobAccepted(id=record.id, status=record.status, pages_total=len(record.pages), pages=record.pages,
                           links={"self": f"/v1/jobs/{record.id}", "events": f"/v1/jobs/{record.id}/events"})
    return JSONResponse(accepted.model_dump(mode="json"), status_code=202,
                        headers={**headers, "Location": f"/v1/jobs/{record.id}"})


@router.get("/v1/jobs/{job_id}", response_model=JobView, summary="Job status and the results so far",
            responses=openapi_error_responses(401, 403, 404))
async def get_job(job_id: str, caller: Principal = Depends(principal), runner: JobRunner = Depends(job_runner)):
    record, done, failed = await owned(runner.store, job_id, caller)
    pages = await runner.store.pages(job_id)
    return JSONResponse(JobView.of(record, done, failed, pages).model_dump(mode="json"))


@router.delete("/v1/jobs/{job_id}", response_model=JobView, summary="Cancel a job",
               responses=openapi_error_responses(401, 403, 404))
async def cancel_job(job_id: str, caller: Principal = Depends(principal), runner: JobRunner = Depends(job_runner)):
    record, _, _ = await owned(runner.store, job_id, caller)
    if record.status not in TERMINAL:
        await runner.cancel(job_id)
    record, done, failed = await owned(runner.store, job_id, caller)
    return JSONResponse(JobView.of(record, done, failed, None).model_dump(mode="json"))


@router.get("/v1/jobs/{job_id}/events", summary="Server-Sent Events: one `page` event per page in page order, then "
            "`done`", response_class=StreamingResponse, responses=openapi_error_responses(401, 403, 404))
async def job_events(job_id: str, request: Request, ctx: AppContext = Depends(app_context),
                     caller: Principal = Depends(principal), runner: JobRunner = Depends(job_runner)):
    await owned(runner.store, job_id, caller)
    start = resume_index(request.headers.get("last-event-id", ""))
    return StreamingResponse(_events(ctx.authenticator, runner.store, job_id, start, request.headers),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(authenticator: Authenticator, store: JobStore, job_id: str, next_index: int,
                  headers: Any) -> AsyncIterator[str]:
    """Pages strictly in order: page i is sent only after pages 0..i-1, however the engine finished them. The key is
    checked again every round (the authenticator re-reads the key file at most once per
    `api_keys_reload_interval_s`): a stream ends with an `unauthorized` event soon after its key is revoked."""
    last_sent = time.monotonic()
    while True:
        try:
            caller = authenticator.authenticate(headers)
            state = await store.get(job_id)
            if state is None or (state[0].tenant != caller.tenant and caller.role != "admin"):
                yield sse(OCRError("not_found", "the job expired or was removed").body(), event="error")
                return
            record, done, failed = state
            pending = {p.index: p for p in await store.pages(job_id, next_index)}
        except OCRError as exc:  # key revoked, or store unavailable (the client may reconnect with Last-Event-ID)
            yield sse(exc.body(), event="error")
            return
        while next_index in pending:
            yield sse(pending.pop(next_index).model_dump(mode="json"), event="page", event_id=next_index)
            next_index += 1
            last_sent = time.monotonic()
        if record.status in TERMINAL:
            for index in sorted(pending):  # a cancelled job may have finished pages after a gap
                yield sse(pending[index].model_dump(mode="json"), event="page", event_id=index)
            yield sse(JobView.of(record, done, failed, None).model_dump(mode="json"), event="done")
            return
        if time.monotonic() - last_sent >= EVENTS_KEEPALIVE_S:
            yield KEEPALIVE
            last_sent = time.monotonic()
        await store.wait(job_id, EVENTS_KEEPALIVE_S)


def resume_index(last_event_id: str) -> int:
    """The first page to send after `Last-Event-ID` (the index of the last page event received; absent: 0). Only ids
    the stream could have sent are taken (at most 9 ASCII digits): 400 `invalid_request` otherwise."""
    last_id = last_event_id.strip()
    if not last_id:
        return 0
    if not (len(last_id) <= 9 and last_id.isascii() and last_id.isdigit()):
        raise OCRError("invalid_request", "Last-Event-ID must be the id of a page event (a page index)")
    return int(last_id) + 1
