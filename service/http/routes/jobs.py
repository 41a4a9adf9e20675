"""`/v1/jobs`: multi-page OCR (one PDF, or several images) with per-page results streamed in page order.

    POST   /v1/jobs              multipart: `file` (one PDF, or repeated image parts) + task fields, `pages`
                                 ("1-3,5"), `return_page_images` → 202 {id, links}
    GET    /v1/jobs/{id}         status, pages_done/pages_total, results so far (in page order)
    GET    /v1/jobs/{id}/events  SSE: one `page` event per page IN PAGE ORDER (`id:` = page index, so a reconnect
                                 with Last-Event-ID resumes), then one `done` event with the job summary
    DELETE /v1/jobs/{id}         cancel (pages already done stay readable)

Admission happens before the 202, in request order: authenticate → read the form → validate the task → take one of
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

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.admission.auth import Principal
from service.imaging import probe_image, sniff_format
from service.admission.pdf import PdfSession, check_page_box, page_pixel_budget, parse_page_range, rendered_size
from service.admission.prompts import build_prompt
from service.pipeline.context import AppContext
from service.http.routes.ocr import Charge, plan_page, rate_limit_cost, request_from_form_fields, validate_task
from service.schema import OCRRequest
from service.engine.protocol import EngineInfo
from service.errors import OCRError, openapi_error_responses
from service.jobs.model import TERMINAL, JobAccepted, JobRecord, JobView
from service.jobs.runner import JobRunner, JobSource
from service.jobs.store import make_store
from service.jobs.webhook import validate_webhook
from service.observability.metrics import STATE_TASK, STATE_TENANT

EVENTS_KEEPALIVE_S = 15.0
JOB_MULTIPART_OVERHEAD_BYTES = 1024 * 1024  # form fields and part headers on top of the files themselves
JOB_FIELDS = ("pages", "webhook", "return_page_images")  # form fields of jobs on top of the /v1/ocr ones
JOB_CAP_RETRY_S = 5  # Retry-After of `too_many_jobs`: a job's pages take seconds


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


def probe_source(ctx: AppContext, req: OCRRequest, engine: EngineInfo, files: list[bytes], numbers: list[int] | None,
                 pages_spec: str | None) -> JobSource:
    """Blocking (admission pool): what the job's pages are, from headers only. Images: each selected one's header
    (format, size limits). A PDF: opened in the sandbox, page count and boxes read, the first page loaded (its
    content streams parsed: a bomb there is this request's 400); the session stays open for the runner. Either way the
    pages' decoded pixels together must fit `max_request_pixels`, and each page is priced at its size."""
    s = ctx.settings
    if numbers is None:  # one PDF
        render_pixels = page_pixel_budget(s, engine.name, req.max_tokens)
        session = PdfSession(files[0], s, pages=pages_spec)
        try:
            info = session.open()
            for page in info.pages:
                check_page_box(page.number, page.width_pt, page.height_pt)
            sizes = [rendered_size(page, s, render_pixels) for page in info.pages]
            _check_pixels(sizes, s, "PDF pages at the resolution they are rendered at")
            session.load(info.pages[0].number)
            costs = _page_costs(ctx, req, engine, sizes)
        except BaseException:
            session.close()
            raise
        return JobSource(numbers=[p.number for p in info.pages], sizes=sizes, costs=costs, pdf=session,
                         render_pixels=render_pixels)
    images = [files[n - 1] for n in numbers]
    sizes = []
    for data in images:
        _, width, height = probe_image(data, allowed_formats=s.allowed_formats, max_pixels=s.max_image_pixels,
                                       max_side=s.max_image_side)
        sizes.append((width, height))
    _check_pixels(sizes, s, "images")
    return JobSource(numbers=numbers, sizes=sizes, costs=_page_costs(ctx, req, engine, sizes), images=images)


def _page_costs(ctx: AppContext, req: OCRRequest, engine: EngineInfo, sizes: list[tuple[int, int]]) -> list[float]:
    """What each page costs at the bucket, from its size. A page its plan refuses (aspect ratio, a prompt too long
    for it) costs one token until it fails at its turn."""
    prompt = None if engine.name == "embedded" else build_prompt(req, ctx.settings)  # one prompt for every page
    costs = []
    for width, height in sizes:
        try:
            plan, _, _ = plan_page(ctx, req, width, height, engine, prompt)
            costs.append(rate_limit_cost(ctx, plan))
        except OCRError:
            costs.append(1.0)
    return costs


def _check_pixels(sizes: list[tuple[int, int]], settings, what: str) -> None:
    total = sum(width * height for width, height in sizes)
    if total > settings.max_request_pixels:
        raise OCRError("too_many_pixels", f"the job's {what} have {total} pixels in all; at most "
                       f"{settings.max_request_pixels} per request — send fewer or smaller pages")


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
        numbers = None  # a PDF's pages are known once it is opened
        if "PDF" in formats:
            if len(files) != 1:
                raise OCRError("invalid_request", "send one PDF per job, or images only")
        else:
            numbers = parse_page_range(pages_spec, len(files), settings.max_pdf_pages)

        tenant = principal.tenant
        job_id = "job-" + uuid.uuid4().hex[:24]
        if not await store.take_slot(tenant, job_id, settings.max_running_jobs_per_tenant):
            raise OCRError("too_many_jobs", f"tenant {tenant!r} already has {settings.max_running_jobs_per_tenant} "
                           "jobs running; retry once one has finished", headers={"Retry-After": str(JOB_CAP_RETRY_S)})
        source = None
        try:
            charge = await Charge(ctx, principal).raise_to(1.0)  # an empty bucket: 429 before any file is parsed
            try:
                source = await ctx.work_pool.run(tenant, probe_source, ctx, req, info, files, numbers, pages_spec)
            except OCRError as exc:
                if exc.code == "overloaded":
                    await charge.refund()
                raise
            await charge.raise_to(source.costs[0])
            record = JobRecord(id=job_id, tenant=tenant, task=req.task, source="pdf" if source.pdf else "images",
                               options=req.model_dump(mode="json", by_alias=True, exclude_none=True,
                                                      exclude={"image", "stream"}),
                               pages=source.numbers, return_page_images=return_images)
            await store.create(record)
        except BaseException:
            if source is not None:
                source.close()
            try:
                await store.release_slot(tenant, job_id)
            except OCRError:  # the store is away: the slot's lease runs out on its own
                pass
            raise
        runner.start(record, req, source, principal, charge, webhook)
        accepted = JobAccepted(id=job_id, status=record.status, pages_total=len(source.numbers),
                               pages=source.numbers,
                               links={"self": f"/v1/jobs/{job_id}", "events": f"/v1/jobs/{job_id}/events"})
        return JSONResponse(accepted.model_dump(mode="json"), status_code=202,
                            headers={**charge.headers, "Location": f"/v1/jobs/{job_id}"})

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
