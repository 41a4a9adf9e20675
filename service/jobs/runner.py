"""Runs a job inside the ingress replica that accepted it, page by page and in page order: each page is paid for at
the tenant's token bucket (waiting for tokens rather than failing), then decoded (an uploaded image) or rendered (a
PDF page, in the job's sandbox session) on the admission pool, then sent to the engine deployment once the replica's
page scheduler grants it a slot. Each page's engine call is retried up to `job_page_retries` times on engine-side
failures (5xx, timeouts, crashes) — never on client errors — and every page ends with exactly one stored
`PageResult`.

Memory: the job keeps its upload as sent (compressed images, or the PDF in its sandbox process) and decodes one page
at a time, when it is dispatched; a page in flight holds only what the engine takes (a PNG, or with
`engine_image_transport: pixels` its RGB rows at the engine's size), never the decoded upload. So a job holds one
decoded page, plus `job_page_concurrency` pages in the engine's form.

Scheduling (docs/JOBS.md): at most `job_pages_in_flight` job pages of this replica are at the engines at once, granted
to the tenants' jobs in turn (service/admission/workpool.py FairSlots); interactive requests do not take these slots,
so they wait behind a few job pages, not behind a backlog.

Cancellation: `DELETE` sets the store's cancel flag (any replica); the runner checks it every `CANCEL_POLL_S` and
also gets cancelled directly when the DELETE lands on its own replica. In-flight engine calls are cancelled with it,
and the PDF sandbox is killed.

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
import uuid
from dataclasses import dataclass
from typing import Any

from service.admission.auth import Principal
from service.imaging import RELEASE_AFTER_PIXELS, DecodedImage, decode_image, release_freed_memory
from service.admission.workpool import FairSlots
from service.jobs.source import JobSource, probe_source
from service.pipeline.admit import Charge
from service.pipeline.page import PreparedPage, prepare_decoded_page, rate_limit_cost
from service.pipeline.run import recognise
from service.engine.protocol import EngineInfo
from service.schema import OCRRequest
from service.errors import OCRError
from service.jobs.backoff import retry_wait_s
from service.jobs.model import HEARTBEAT_S, TERMINAL, ErrorInfo, JobRecord, JobView, PageResult
from service.jobs.store import JobStore
from service.jobs.webhook import WebhookSender, WebhookTarget

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5
RETRY_BACKOFF_S = 0.25  # doubled per attempt, capped at MAX_BACKOFF_S, jittered (service/jobs/backoff.py)
MAX_BACKOFF_S = 2.0
MAX_RATE_WAIT_S = 30.0
JOB_CAP_RETRY_S = 5  # Retry-After of `too_many_jobs`: a job's pages take seconds
OVERLOADED_WAIT_S = 0.5  # a page the admission pool has no room for waits this long, then asks again
PREVIEW_MAX_SIDE = 1600


@dataclass
class StagedPage:
    """A page decoded (or rendered) and prepared for the engine; the decoded pixels are gone by now."""

    number: int
    prepared: PreparedPage
    preview: str | None = None
    dpi: float = 0.0
    render_ms: float = 0.0


class JobRunner:
    def __init__(self, ctx, store: JobStore):
        self.ctx = ctx
        self.store = store
        self._tasks: dict[str, asyncio.Task] = {}
        self.webhooks = WebhookSender(ctx.settings, ctx.metrics)
        # job pages of this replica at the engines, granted to tenants in turn
        self.page_slots = FairSlots(ctx.settings.job_pages_in_flight, what="the engines")

    # --- control ------------------------------------------------------------------------------------------------
    def start(self, record: JobRecord, req: OCRRequest, source: JobSource, principal: Principal,
              first_charge: Charge, webhook: WebhookTarget | None = None) -> None:
        task = asyncio.create_task(self._run_then_notify(record, req, source, principal, first_charge, webhook),
                                   name=f"job-{record.id}")
        self._tasks[record.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(record.id, None))

    async def submit(self, principal: Principal, req: OCRRequest, engine: EngineInfo, files: list[bytes],
                     numbers: list[int] | None, pages_spec: str | None, return_page_images: bool,
                     webhook: WebhookTarget | None) -> tuple[JobRecord, dict[str, str]]:
        """Accept a job whose task `pipeline.admit.admit_task` passed: one of the tenant's running-job slots (429
        `too_many_jobs`), one token (429 on an empty bucket, nothing of the files parsed yet), its pages from their
        headers on the admission pool (service/jobs/source.py), page 1's estimated cost, the stored record; then
        it runs. Returns the record and the rate-limit headers."""
        s = self.ctx.settings
        tenant = principal.tenant
        job_id = "job-" + uuid.uuid4().hex[:24]
        if not await self.store.take_slot(tenant, job_id, s.jobs.max_running_per_tenant):
            raise OCRError("too_many_jobs", f"tenant {tenant!r} already has {s.jobs.max_running_per_tenant} jobs "
                           "running; retry once one has finished", headers={"Retry-After": str(JOB_CAP_RETRY_S)})
        source = None
        try:
            charge = await Charge(self.ctx, principal).raise_to(1.0)
            try:
                source = await self.ctx.work_pool.run(tenant, probe_source, self.ctx, req, engine, files, numbers,
                                                      pages_spec)
            except OCRError as exc:
                if exc.code == "overloaded":
                    await charge.refund()
                raise
            await charge.raise_to(source.costs[0])
            record = JobRecord(id=job_id, tenant=tenant, task=req.task, source="pdf" if source.pdf else "images",
                               options=req.model_dump(mode="json", by_alias=True, exclude_none=True,
                                                      exclude={"image", "stream"}),
                               pages=source.numbers, return_page_images=return_page_images)
            await self.store.create(record)
        except BaseException:
            if source is not None:
                source.close()
            try:
                await self.store.release_slot(tenant, job_id)
            except OCRError:  # the store is away: the slot's lease runs out on its own
                pass
            raise
        self.start(record, req, source, principal, charge, webhook)
        return record, charge.headers

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
                               first_charge: Charge, webhook: WebhookTarget | None) -> None:
        try:
            await self._run(record, req, source, principal, first_charge)
        finally:
            source.close()
            try:
                await self.store.release_slot(record.tenant, record.id)
            except OCRError:  # Redis away: the slot's lease runs out on its own
                log.warning("job %s: could not give back its running-job slot", record.id)
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

    async def _run(self, record: JobRecord, req: OCRRequest, source: JobSource, principal: Principal,
                   first_charge: Charge) -> None:
        job_id = record.id
        now = time.time()
        await self.store.update(job_id, status="running", updated_at=now, heartbeat_at=now)
        lost = asyncio.Event()  # set by the watcher when the store no longer holds the job
        watcher = asyncio.create_task(self._watch(record, asyncio.current_task(), lost))
        page_tasks: list[asyncio.Task] = []
        cancelled = False
        try:
            info = await self.ctx.get_engine_info()
            in_flight = asyncio.Semaphore(self.ctx.settings.jobs.page_concurrency)
            for index in range(len(source.numbers)):
                await in_flight.acquire()
                task = None
                try:
                    charge = first_charge if index == 0 else await self._pay(principal, source.costs[index])
                    staged = await self._stage(record, req, source, principal, index, info, charge)
                    if isinstance(staged, PageResult):  # failed before the engine
                        await self.store.put_page(job_id, staged)
                        continue
                    await self.page_slots.acquire(principal.tenant)
                    task = asyncio.create_task(self._page(record, req, principal, index, staged, info))
                    task.add_done_callback(lambda _: self.page_slots.release(principal.tenant))
                    page_tasks.append(task)
                finally:
                    if task is None:
                        in_flight.release()
                    else:
                        task.add_done_callback(lambda _: in_flight.release())
            await asyncio.gather(*page_tasks)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # a bug must not leave the job "running": the missing pages are reported below
            log.exception("job %s failed", job_id)
        finally:
            watcher.cancel()
            source.close()  # a render in progress stops at once
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
        # the record first (pages are stored only for a job that exists), then its pages, then the end state: a
        # reader never sees the job failed with pages still missing
        await self.store.restore(record.model_copy(update={"updated_at": now, "heartbeat_at": now}))
        await self._fail_missing_pages(record, error)
        await self.store.update(record.id, status="failed", error=error, updated_at=now, finished_at=now)
        self.ctx.metrics.job_lost()
        self.ctx.metrics.job_finished("failed")
        log.warning("job %s: its state vanished from the job store (Redis restart or failover without the data); "
                    "stopped and marked failed `job_lost`", record.id)

    async def _finish(self, record: JobRecord, cancelled: bool) -> None:
        now = time.time()
        if cancelled:
            await self.store.update(record.id, status="cancelled", updated_at=now, finished_at=now)
            self.ctx.metrics.job_finished("cancelled")
            return
        await self._fail_missing_pages(record, ErrorInfo(code="internal_error",
                                                         message="the page was not processed (internal error)"))
        state = await self.store.get(record.id)
        failed = state[2] if state else record.pages_total
        status = "succeeded" if failed == 0 else "failed" if failed >= record.pages_total else "partial"
        await self.store.update(record.id, status=status, updated_at=now, finished_at=now)
        self.ctx.metrics.job_finished(status)

    async def _watch(self, record: JobRecord, job_task: asyncio.Task | None, lost: asyncio.Event) -> None:
        """Heartbeat (and the running-job slot's lease) for readers on other replicas; cancel flag set by a DELETE
        on another replica; the job's record vanishing from the store (`lost`)."""
        job_id = record.id
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
                    await self.store.renew_slot(record.tenant, job_id)
                    last_beat = time.monotonic()
            except OCRError:  # store hiccup: try again next tick
                continue

    # --- one page -----------------------------------------------------------------------------------------------
    async def _pay(self, principal: Principal, cost: float) -> Charge:
        """Jobs count against the tenant's bucket page by page, before each page's decode, at the cost its size
        implies: wait for tokens instead of failing the page."""
        while True:
            try:
                return await Charge(self.ctx, principal).raise_to(cost)
            except OCRError as exc:
                if exc.code != "rate_limited":
                    raise
                wait = float((exc.headers or {}).get("Retry-After", 1))
                await asyncio.sleep(min(MAX_RATE_WAIT_S, max(0.05, wait)))

    async def _stage(self, record: JobRecord, req: OCRRequest, source: JobSource, principal: Principal, index: int,
                     info, charge: Charge) -> StagedPage | PageResult:
        """Decode or render the page and prepare it for the engine on the admission pool (a turn among the
        tenants' work), then settle its cost; a page that cannot be prepared is its failed PageResult."""
        number = source.numbers[index]
        while True:
            try:
                staged = await self.ctx.work_pool.run(principal.tenant, self._stage_blocking, record, req, source,
                                                      index, info)
                break
            except OCRError as exc:
                if exc.code == "overloaded":  # the tenant's own interactive work fills its queue: a job can wait
                    await asyncio.sleep(OVERLOADED_WAIT_S)
                    continue
                return PageResult(index=index, page=number, status="failed", attempts=0,
                                  error=ErrorInfo(code=exc.code, message=exc.message))
        await charge.settle(rate_limit_cost(self.ctx, staged.prepared.plan))
        return staged

    def _stage_blocking(self, record: JobRecord, req: OCRRequest, source: JobSource, index: int, info) -> StagedPage:
        """The page's decoded pixels are gone when it returns, their memory given back for a large page."""
        try:
            return self._decode_and_prepare(record, req, source, index, info)
        finally:
            width, height = source.sizes[index]
            if width * height >= RELEASE_AFTER_PIXELS:
                release_freed_memory()

    def _decode_and_prepare(self, record: JobRecord, req: OCRRequest, source: JobSource, index: int,
                            info) -> StagedPage:
        s = self.ctx.settings
        number = source.numbers[index]
        started = time.perf_counter()
        request_id = f"{record.id}-p{number}"
        dpi = render_ms = 0.0
        if source.pdf is not None:
            rendered = source.pdf.render(number, source.render_pixels)
            if rendered.error is not None:
                raise rendered.error
            decoded = DecodedImage(image=rendered.image, format="PDF", width=rendered.image.width,
                                   height=rendered.image.height)
            dpi, render_ms = rendered.dpi, rendered.render_ms
            started = time.perf_counter()  # `decode` times the preparation; `render` the sandbox's work
        else:
            decoded = decode_image(source.images[index], allowed_formats=s.limits.allowed_formats,
                                   max_pixels=s.limits.max_image_pixels, max_side=s.limits.max_image_side,
                                   max_frames=s.limits.max_frames, defer_pixels=s.engine.png_pixel_check == "engine")
        prepared = prepare_decoded_page(self.ctx, req, decoded, info, request_id, started=started,
                                        source="pdf" if source.pdf is not None else "image")
        preview = _preview(decoded.pixels()) if record.return_page_images else None
        return StagedPage(number, prepared, preview, dpi, render_ms)

    async def _page(self, record: JobRecord, req: OCRRequest, principal: Principal, index: int,
                    staged: StagedPage, info) -> None:
        result = await self._page_result(record, req, index, staged, info)
        await self.store.put_page(record.id, result)

    async def _page_result(self, record: JobRecord, req: OCRRequest, index: int, staged: StagedPage,
                           info) -> PageResult:
        started = time.perf_counter()
        attempts = 0
        last_error = OCRError("internal_error", "the page was not processed")
        for attempt in range(1 + self.ctx.settings.jobs.page_retries):
            attempts += 1
            try:
                response = await self._engine_call(req, staged, info, started, attempt)
                return PageResult(index=index, page=staged.number, status="ok", attempts=attempts,
                                  result=response, dpi=staged.dpi or None, image=staged.preview)
            except OCRError as exc:
                last_error = exc
                if exc.status < 500:
                    break  # the page itself is the problem: retrying cannot help
            except asyncio.TimeoutError:
                last_error = OCRError("timeout", f"the engine did not answer within "
                                      f"{self.ctx.settings.server.request_timeout_s:g}s")
            except Exception as exc:  # engine crash, replica died mid-call: retry on (possibly) another replica
                log.warning("job %s page %s attempt %s failed: %s", record.id, staged.number, attempts,
                            type(exc).__name__)
                last_error = OCRError("engine_unavailable", "the engine failed on this page")
            if attempt < self.ctx.settings.jobs.page_retries:
                await asyncio.sleep(retry_wait_s(attempt, RETRY_BACKOFF_S, MAX_BACKOFF_S))
        return PageResult(index=index, page=staged.number, status="failed", attempts=attempts,
                          dpi=staged.dpi or None, error=ErrorInfo(code=last_error.code, message=last_error.message))

    async def _engine_call(self, req: OCRRequest, staged: StagedPage, info, started: float,
                           attempt: int) -> dict[str, Any]:
        prepared = staged.prepared
        request_id = f"{prepared.engine_request.request_id}-r{attempt}" if attempt else None
        # the page's clock: its preparation and render (before `started`) count into its total
        response = await recognise(self.ctx, req, prepared, model=req.adapter or info.model,
                                   started=started - (prepared.decode_ms + staged.render_ms) / 1000,
                                   extra_timings={"render": staged.render_ms}, request_id=request_id)
        return response.model_dump(mode="json")


def _preview(image) -> str:
    """A small JPEG of the page for the UI (boxes are drawn over it, scaled)."""
    preview = image.copy()
    preview.thumbnail((PREVIEW_MAX_SIDE, PREVIEW_MAX_SIDE))
    buf = io.BytesIO()
    preview.save(buf, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
