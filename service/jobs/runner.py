"""Runs a job inside the ingress replica that accepted it: pages are rasterised (PDF sandbox) or taken from the
uploaded images, paid for at the tenant's token bucket, and fanned out to the engine deployment with at most
`job_page_concurrency` pages in flight (Serve spreads them over the engine replicas). Each page's engine call is
retried up to `job_page_retries` times on engine-side failures (5xx, timeouts, crashes) — never on client errors —
and every page ends with exactly one stored `PageResult`.

Cancellation: `DELETE` sets the store's cancel flag (any replica); the runner checks it every `CANCEL_POLL_S` and
also gets cancelled directly when the DELETE lands on its own replica. In-flight engine calls are cancelled with it.

Lost state: at every heartbeat the runner checks that the job's record is still stored. When Redis restarted or
failed over without its data (or evicted the job), the results of the pages done so far are gone: the runner stops
the job and writes it back as failed `job_lost`, every page without a stored result failed with the same code, so
clients and the webhook learn why instead of finding a 404 (counted in `ocr_jobs_lost_total`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from service.admission.auth import Principal
from service.admission.images import DecodedImage
from service.admission.pdf import PageRenderer, RenderedPage, page_pixel_budget
from service.api.ocr import (PreparedPage, admit, build_response, parse_output, prepare_decoded_page,
                             rate_limit_cost, record_page)
from service.api.protocol import OCRRequest
from service.errors import OCRError
from service.jobs.model import HEARTBEAT_S, TERMINAL, ErrorInfo, JobRecord, JobView, PageResult
from service.jobs.store import JobStore
from service.jobs.webhook import WebhookSender, WebhookTarget

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5
RETRY_BACKOFF_S = 0.25  # doubled per attempt, capped at MAX_BACKOFF_S
MAX_BACKOFF_S = 2.0
MAX_RATE_WAIT_S = 30.0
PREVIEW_MAX_SIDE = 1600


@dataclass
class JobSource:
    """The pages of a job: one PDF (rendered lazily, in the sandbox) or already decoded images."""

    numbers: list[int]
    pdf: bytes | None = None
    images: list[DecodedImage] = field(default_factory=list)  # aligned with `numbers` when not a PDF


class JobRunner:
    def __init__(self, ctx, store: JobStore):
        self.ctx = ctx
        self.store = store
        self._tasks: dict[str, asyncio.Task] = {}
        self.webhooks = WebhookSender(ctx.settings, ctx.metrics)

    # --- control ------------------------------------------------------------------------------------------------
    def start(self, record: JobRecord, req: OCRRequest, source: JobSource, principal: Principal,
              webhook: WebhookTarget | None = None) -> None:
        task = asyncio.create_task(self._run_then_notify(record, req, source, principal, webhook),
                                   name=f"job-{record.id}")
        self._tasks[record.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(record.id, None))

    async def cancel(self, job_id: str) -> None:
        await self.store.request_cancel(job_id)
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    def running(self) -> list[str]:
        return list(self._tasks)

    async def wait_all(self) -> None:
        """Tests and shutdown: until every job of this replica has finished."""
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # --- one job ------------------------------------------------------------------------------------------------
    async def _run_then_notify(self, record: JobRecord, req: OCRRequest, source: JobSource, principal: Principal,
                               webhook: WebhookTarget | None) -> None:
        try:
            await self._run(record, req, source, principal)
        finally:
            if webhook is not None:  # in the background: a slow or failing receiver never holds up the job
                self.webhooks.send(webhook, record.id, lambda: self._final_view(record.id))

    async def _final_view(self, job_id: str) -> dict[str, Any] | None:
        """The webhook body: what `GET /v1/jobs/{id}` answers, without page previews (no document bytes)."""
        state = await self.store.get(job_id)
        if state is None or state[0].status not in TERMINAL:
            log.warning("job %s: no final state to send to its webhook", job_id)
            return None
        record, done, failed = state
        pages = [page.model_copy(update={"image": None}) for page in await self.store.pages(job_id)]
        return JobView.of(record, done, failed, pages).model_dump(mode="json")

    async def _run(self, record: JobRecord, req: OCRRequest, source: JobSource, principal: Principal) -> None:
        job_id = record.id
        now = time.time()
        await self.store.update(job_id, status="running", updated_at=now, heartbeat_at=now)
        lost = asyncio.Event()  # set by the watcher when the store no longer holds the job
        watcher = asyncio.create_task(self._watch(job_id, asyncio.current_task(), lost))
        page_tasks: list[asyncio.Task] = []
        cancelled = False
        try:
            info = await self.ctx.get_engine_info()
            slots = asyncio.Semaphore(self.ctx.settings.job_page_concurrency)
            async for index, rendered in self._pages(source, info.name, req):
                await slots.acquire()
                page_tasks.append(asyncio.create_task(
                    self._page(record, req, principal, index, rendered, info, slots)))
            await asyncio.gather(*page_tasks)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # a bug must not leave the job "running": the missing pages are reported below
            log.exception("job %s failed", job_id)
        finally:
            watcher.cancel()
            for task in page_tasks:
                task.cancel()
            await asyncio.gather(*page_tasks, return_exceptions=True)
        try:
            if lost.is_set():
                await self._record_lost(record)
            else:
                await self._finish(record, cancelled or await self.store.cancel_requested(job_id))
        except Exception:
            log.exception("could not record the end of job %s", job_id)

    async def _fail_missing_pages(self, record: JobRecord, error: ErrorInfo) -> None:
        """Never lose a page silently: every page without a stored result gets a failed one."""
        stored = {p.index for p in await self.store.pages(record.id)}
        for index, number in enumerate(record.pages):
            if index not in stored:
                await self.store.put_page(record.id, PageResult(index=index, page=number, status="failed",
                                                                attempts=0, error=error))

    async def _record_lost(self, record: JobRecord) -> None:
        now = time.time()
        error = ErrorInfo(code="job_lost", message="the job store (Redis) lost this job's state (restart or "
                          "failover without its data); the results of its pages are gone: resubmit the job")
        await self.store.restore(record.model_copy(update={"status": "failed", "error": error, "updated_at": now,
                                                           "heartbeat_at": now, "finished_at": now}))
        await self._fail_missing_pages(record, error)
        self.ctx.metrics.job_lost()
        log.warning("job %s: its state vanished from the job store (Redis restart or failover without the data); "
                    "stopped and marked failed `job_lost`", record.id)

    async def _finish(self, record: JobRecord, cancelled: bool) -> None:
        now = time.time()
        if cancelled:
            await self.store.update(record.id, status="cancelled", updated_at=now, finished_at=now)
            return
        await self._fail_missing_pages(record, ErrorInfo(code="internal_error",
                                                         message="the page was not processed (internal error)"))
        state = await self.store.get(record.id)
        failed = state[2] if state else record.pages_total
        status = "succeeded" if failed == 0 else "failed" if failed >= record.pages_total else "partial"
        await self.store.update(record.id, status=status, updated_at=now, finished_at=now)

    async def _watch(self, job_id: str, job_task: asyncio.Task | None, lost: asyncio.Event) -> None:
        """Heartbeat for readers on other replicas; cancel flag set by a DELETE on another replica; the job's
        record vanishing from the store (`lost`)."""
        last_beat = time.monotonic()
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            try:
                if await self.store.cancel_requested(job_id):
                    if job_task is not None:
                        job_task.cancel()
                    return
                if time.monotonic() - last_beat >= HEARTBEAT_S:
                    if not await self.store.exists(job_id):
                        lost.set()
                        if job_task is not None:
                            job_task.cancel()
                        return
                    await self.store.update(job_id, heartbeat_at=time.time())
                    last_beat = time.monotonic()
            except OCRError:  # store hiccup: try again next tick
                continue

    async def _pages(self, source: JobSource, engine_name: str, req: OCRRequest
                     ) -> AsyncIterator[tuple[int, RenderedPage]]:
        if source.pdf is None:
            for index, (number, image) in enumerate(zip(source.numbers, source.images)):
                yield index, RenderedPage(number=number, image=image.image)
            return
        budget = page_pixel_budget(self.ctx.settings, engine_name, req.max_tokens)
        renderer = PageRenderer(source.pdf, self.ctx.settings, source.numbers, budget)
        pages = iter(renderer)
        try:
            for index in range(len(source.numbers)):
                rendered = await asyncio.to_thread(next, pages, None)
                if rendered is None:
                    break
                yield index, rendered
        finally:
            renderer.stop()  # cancelled mid-document: kill the sandbox, do not wait for it

    # --- one page -----------------------------------------------------------------------------------------------
    async def _page(self, record: JobRecord, req: OCRRequest, principal: Principal, index: int,
                    rendered: RenderedPage, info, slots: asyncio.Semaphore) -> None:
        try:
            result = await self._page_result(record, req, principal, index, rendered, info)
            await self.store.put_page(record.id, result)
        finally:
            slots.release()

    async def _page_result(self, record: JobRecord, req: OCRRequest, principal: Principal, index: int,
                           rendered: RenderedPage, info) -> PageResult:
        def failed(error: OCRError, attempts: int = 0) -> PageResult:
            return PageResult(index=index, page=rendered.number, status="failed", attempts=attempts,
                              dpi=rendered.dpi or None, error=ErrorInfo(code=error.code, message=error.message))

        if rendered.error is not None:
            return failed(rendered.error)
        started = time.perf_counter()
        request_id = f"{record.id}-p{rendered.number}"
        decoded = DecodedImage(image=rendered.image, format="PDF" if record.source == "pdf" else "IMAGE",
                               width=rendered.image.width, height=rendered.image.height)
        try:
            prepared = await asyncio.to_thread(prepare_decoded_page, self.ctx, req, decoded, info, request_id,
                                               source="pdf" if record.source == "pdf" else "image")
            preview = await asyncio.to_thread(_preview, rendered.image) if record.return_page_images else None
            rendered.image = None  # only the engine copy is kept from here on
            if index > 0:  # page 1 was paid for when the job was accepted
                await self._pay(principal, rate_limit_cost(self.ctx, prepared.plan))
        except OCRError as exc:
            return failed(exc)
        attempts = 0
        last_error = OCRError("internal_error", "the page was not processed")
        for attempt in range(1 + self.ctx.settings.job_page_retries):
            attempts += 1
            try:
                response = await self._engine_call(req, prepared, info, started, rendered, attempt)
                return PageResult(index=index, page=rendered.number, status="ok", attempts=attempts,
                                  result=response, dpi=rendered.dpi or None, image=preview)
            except OCRError as exc:
                last_error = exc
                if exc.status < 500:
                    break  # the page itself is the problem: retrying cannot help
            except asyncio.TimeoutError:
                last_error = OCRError("timeout", f"the engine did not answer within "
                                      f"{self.ctx.settings.request_timeout_s:g}s")
            except Exception as exc:  # engine crash, replica died mid-call: retry on (possibly) another replica
                log.warning("job %s page %s attempt %s failed: %s", record.id, rendered.number, attempts,
                            type(exc).__name__)
                last_error = OCRError("engine_unavailable", "the engine failed on this page")
            if attempt < self.ctx.settings.job_page_retries:
                await asyncio.sleep(min(MAX_BACKOFF_S, RETRY_BACKOFF_S * 2 ** attempt))
        return failed(last_error, attempts)

    async def _engine_call(self, req: OCRRequest, prepared: PreparedPage, info, started: float,
                           rendered: RenderedPage, attempt: int) -> dict[str, Any]:
        ctx = self.ctx
        engine_request = prepared.engine_request
        if attempt:
            engine_request = engine_request.model_copy(update={"request_id": f"{engine_request.request_id}-r{attempt}"})
        engine_started = time.perf_counter()
        with ctx.metrics.waiting_for_engine():
            result = await asyncio.wait_for(ctx.engine.generate(engine_request), ctx.settings.request_timeout_s)
        engine_total_ms = (time.perf_counter() - engine_started) * 1000
        parse_started = time.perf_counter()
        parsed = await parse_output(ctx, req, result, prepared.geometry)
        timings = {
            "render": rendered.render_ms,
            "decode": prepared.decode_ms,
            "queue": max(0.0, engine_total_ms - result.engine_ms),
            "engine": result.engine_ms,
            "parse": (time.perf_counter() - parse_started) * 1000,
            "total": (time.perf_counter() - started) * 1000 + rendered.render_ms,
        }
        response = build_response(request_id=prepared.engine_request.request_id, model=req.adapter or info.model,
                                  task=req.task, result=result, geom=prepared.geometry, parsed=parsed,
                                  timings_ms=timings, adapter=req.adapter)
        record_page(ctx, req, prepared, result, parsed.confidence, timings)
        return response.model_dump(mode="json")

    async def _pay(self, principal: Principal, cost: float) -> None:
        """Jobs count against the tenant's bucket page by page: wait for tokens instead of failing the page."""
        cost = min(cost, principal.burst or self.ctx.settings.default_burst)  # a page never costs more than a bucket
        while True:
            try:
                await admit(self.ctx, principal, cost)
                return
            except OCRError as exc:
                if exc.code != "rate_limited":
                    raise
                wait = float((exc.headers or {}).get("Retry-After", 1))
                await asyncio.sleep(min(MAX_RATE_WAIT_S, max(0.05, wait)))


def _preview(image) -> str:
    """A small JPEG of the page for the UI (boxes are drawn over it, scaled)."""
    preview = image.copy()
    preview.thumbnail((PREVIEW_MAX_SIDE, PREVIEW_MAX_SIDE))
    buf = io.BytesIO()
    preview.save(buf, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
