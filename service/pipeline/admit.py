"""Admission: the one sequence every request and job page goes through before the engine, in the order it pays.

    validate the task and its options (sizes first) → the key may use the adapter → the engine can do the task →
    one token (429 on an empty bucket, nothing parsed yet) → header or PDF page count and box, the estimated cost
    (admission pool) → decode or render, budget, resize (admission pool) → the real cost settled

`/v1/ocr` and the OpenAI endpoints call `admit_page`; `/v1/jobs` calls `admit_task` and pays page by page
(service/jobs/runner.py) with a `Charge`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from service.admission.auth import Principal
from service.admission.limits import check_request_limits
from service.admission.schemas import check_schema
from service.engine.protocol import EngineInfo
from service.errors import OCRError
from service.parsing.extraction import check_named_properties
from service.pipeline.context import AppContext
from service.pipeline.page import PreparedPage, Upload, decode_and_prepare, plan_page, probe_upload, rate_limit_cost
from service.schema import OCRRequest
from service.tasks import TASKS


async def validate_task(ctx: AppContext, req: OCRRequest) -> None:
    check_request_limits(req, ctx.settings)  # sizes first: the same 4xx whatever the engine
    if req.json_schema is not None:  # CPU work (metaschema, references, regexes): off the event loop
        await asyncio.to_thread(check_schema, req.json_schema, ctx.settings)
    if req.task not in TASKS:
        raise OCRError("unknown_task", f"unknown task {req.task!r}; tasks: {', '.join(TASKS)}", param="task")
    info = await ctx.get_engine_info()
    if req.task not in info.supported_tasks:
        raise OCRError("unsupported_task", f"task {req.task!r} is not supported by the {info.name} engine "
                       f"(supported: {', '.join(info.supported_tasks)})", param="task")
    if req.task == "extract" and not (req.fields or req.json_schema):
        raise OCRError("invalid_request", "task `extract` needs `fields` or `schema`")
    if req.task == "translate" and not req.target_language:
        raise OCRError("invalid_request", "task `translate` needs `target_language`")
    # Options of another task would be ignored silently: a client that forgot `task=extract` would get a
    # spotting result with `fields: null` and no hint why.
    if req.task != "extract" and (req.fields is not None or req.json_schema is not None):
        raise OCRError("invalid_request", f"`fields` and `schema` apply to task `extract`, not {req.task!r}")
    if req.task != "translate" and req.target_language is not None:
        raise OCRError("invalid_request", f"`target_language` applies to task `translate`, not {req.task!r}")
    if req.fields is not None and len(req.fields) > ctx.settings.limits.max_fields:
        raise OCRError("validation_error", f"at most {ctx.settings.limits.max_fields} fields")
    if req.json_schema is not None:
        check_named_properties(req.json_schema)
    if req.include_raw and not ctx.settings.parsing.include_raw_output:
        raise OCRError("forbidden", "raw model output is disabled on this service (include_raw_output)")


async def admit_task(ctx: AppContext, principal: Principal, req: OCRRequest) -> EngineInfo:
    """The request's task and options are valid, its key may use its adapter, and the engine can do the task: the
    checks that cost nothing but the request's own fields. Returns the engine's facts."""
    await validate_task(ctx, req)
    if not principal.may_use_adapter(req.adapter):
        raise OCRError("forbidden", f"this API key may not use adapter {req.adapter!r}")
    return await ctx.get_engine_info()


@dataclass
class Charge:
    """Tokens one request (or one job page) has taken from its tenant's bucket. Taken before the work from what is
    known then — one token before anything is parsed (an empty bucket answers 429 there), the estimate once an
    image's header or a PDF's page boxes are read — and settled once the real cost is known (ratelimit.adjust)."""

    ctx: AppContext
    principal: Principal
    amount: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)

    def _bucket(self) -> tuple[float, float] | None:
        s = self.ctx.settings
        if not s.rate_limit.enabled:
            return None
        return self.principal.rate or s.rate_limit.default_rate, self.principal.burst or s.rate_limit.default_burst

    async def raise_to(self, cost: float) -> "Charge":
        """Take what `cost` needs beyond what was taken; 429 `rate_limited` (costing the engine nothing) when the
        bucket cannot pay it."""
        bucket = self._bucket()
        if bucket is None:
            return self
        rate, burst = bucket
        cost = min(cost, burst)  # a request never costs more than the whole bucket (it could never pass)
        if cost <= self.amount:
            return self
        decision = await self.ctx.limiter.acquire(self.principal.tenant, cost - self.amount, rate, burst)
        self.headers = decision.headers(self.ctx.settings.rate_limit.cost)
        if not decision.allowed:
            raise OCRError("rate_limited", f"rate limit exceeded for tenant {self.principal.tenant!r}",
                           headers=self.headers)
        self.amount = cost
        return self

    async def settle(self, cost: float) -> None:
        """The real cost: the difference is given back, or taken even when the bucket cannot cover it (the work
        is done; the bucket goes into debt and the tenant's next requests wait)."""
        bucket = self._bucket()
        if bucket is None:
            return
        rate, burst = bucket
        cost = min(cost, burst)
        if cost != self.amount:
            await self.ctx.limiter.adjust(self.principal.tenant, cost - self.amount, rate, burst)
            self.amount = cost

    async def refund(self) -> None:
        """The service refused the work (503 `overloaded`): the tenant gets its tokens back."""
        await self.settle(0.0)


def probe_and_price(ctx: AppContext, req: OCRRequest, data: bytes | str, engine: EngineInfo, *,
                    prompt_for: Callable[[], str] | None = None, allow_pdf: bool = True
                    ) -> tuple[Upload, str | None, float]:
    """Blocking (admission pool): the upload probed (probe_upload), the prompt built (`prompt_for`: a chat message's
    sanitised text instead of the task's), and the cost the page will have at its header's size."""
    upload = probe_upload(data, ctx.settings, allow_pdf=allow_pdf)
    try:
        prompt = prompt_for() if prompt_for is not None else None
        plan, _, _ = plan_page(ctx, req, upload.width, upload.height, engine, prompt)
    except BaseException:
        upload.close()
        raise
    return upload, prompt, rate_limit_cost(ctx, plan)


async def admit_upload(ctx: AppContext, principal: Principal, req: OCRRequest, data: bytes | str, engine: EngineInfo,
                       request_id: str, *, prompt_for: Callable[[], str] | None = None, allow_pdf: bool = True
                       ) -> tuple[PreparedPage, dict[str, str]]:
    """One upload from bytes to a prepared page, paid for before each step of work: one token first (nothing of
    the file parsed yet), then on the admission pool the header (or the PDF's page count and box) and the estimated
    cost, taken before the decode (or render) on the pool, then the real cost settled. Returns the page and the
    rate-limit headers. A request the admission pool has no room for (503 `overloaded`) gets its tokens back."""
    tenant = principal.tenant
    charge = await Charge(ctx, principal).raise_to(1.0)
    try:
        upload, prompt, estimate = await ctx.work_pool.run(tenant, probe_and_price, ctx, req, data, engine,
                                                           prompt_for=prompt_for, allow_pdf=allow_pdf)
        try:
            await charge.raise_to(estimate)
            page = await ctx.work_pool.run(tenant, decode_and_prepare, ctx, req, upload, engine, request_id,
                                           prompt=prompt)
        finally:
            upload.close()  # (already closed by a decode that ran) a cancelled request: the PDF sandbox stops
    except OCRError as exc:
        if exc.code == "overloaded":
            await charge.refund()
        raise
    await charge.settle(rate_limit_cost(ctx, page.plan))
    return page, charge.headers


async def admit_page(ctx: AppContext, principal: Principal, req: OCRRequest, data: bytes | str, request_id: str, *,
                     prompt_for: Callable[[], str] | None = None, allow_pdf: bool = True
                     ) -> tuple[PreparedPage, dict[str, str]]:
    """The whole admission of one page (`data`: the file's bytes, or a JSON body's base64 string, decoded on the
    admission pool once the first token is paid): returns the page ready for the engine and the rate-limit
    headers."""
    engine = await admit_task(ctx, principal, req)
    return await admit_upload(ctx, principal, req, data, engine, request_id, prompt_for=prompt_for,
                              allow_pdf=allow_pdf)
