"""`POST /v1/ocr`: router and serving logic, in request order:
read body → authenticate → validate task → one token (429 on an empty bucket) → image header / PDF page count and box
(admission pool) → the estimated cost → decode or render (admission pool) → budget/resize → the real cost → engine →
parse → respond.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
import pydantic_core
from pydantic import ValidationError

from service.admission.auth import Principal
from service.admission.budget import ImagePlan, plan_for_embedded, plan_for_vlm, prompt_token_bound
from service.imaging import (RELEASE_AFTER_PIXELS, DecodedImage, decode_base64_image, decode_image,
                                     encode_png, probe_image, release_freed_memory, resize_to, sniff_format)
from service.admission.limits import check_request_limits
from service.admission.presize import presize, processor_size
from service.admission.prompts import build_prompt, guided_json_for
from service.admission.schemas import check_schema
from service.pipeline.context import AppContext
from service.http.json_body import check_json_items, read_json_model, validation_error
from service.schema import OCRRequest, OCRResponse
from service.engine.protocol import EngineInfo, EngineRequest, EngineResult
from service.errors import OCRError, openapi_error_responses
from service.observability.metrics import STATE_TASK, STATE_TENANT
from service.parsing.extraction import check_named_properties, schema_for_fields
from service.engine.repetition import guard_result
from service.parsing.result import PageGeometry, ParsedOutput, build_response, parse_engine_output
from service.parsing.streaming import OutputStream
from service.tasks import TASKS

log = logging.getLogger(__name__)

# Embedded engine: longest side sent to the engine (the detector itself works at settings.embedded_det_limit_side_len)
EMBEDDED_MAX_SIDE = 4096


@dataclass
class PreparedPage:
    """An admitted page, ready for the engine."""

    engine_request: EngineRequest
    geometry: PageGeometry
    plan: ImagePlan
    decode_ms: float
    source: str = "image"  # image | pdf (metrics label)


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


async def read_ocr_request(request: Request, settings) -> tuple[OCRRequest, bytes]:
    """Parse a JSON or multipart body into the request model and the raw file bytes."""
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
        model = request_from_form_fields(fields, settings.max_json_items)
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
    model = await read_json_model(body, OCRRequest, settings.max_json_items)  # strict types, work bounded first
    if not model.image:
        raise OCRError("empty_image", "the `image` field is missing or empty")
    return model, decode_base64_image(model.image, settings.max_body_bytes)


def request_from_form_fields(fields: dict[str, Any], max_json_items: int) -> OCRRequest:
    """Multipart text fields → OCRRequest (`fields` as a JSON list or comma-separated, `schema` as JSON; either
    bounded like a JSON body)."""
    fields = dict(fields)
    if "fields" in fields:
        raw = fields["fields"].strip()
        check_json_items(raw.encode(), max_json_items, "the `fields` form field")
        fields["fields"] = _json_or(raw, [f.strip() for f in raw.split(",") if f.strip()])
    if "schema" in fields:
        check_json_items(fields["schema"].encode(), max_json_items, "the `schema` form field")
        fields["schema"] = _json_or(fields["schema"], None, "schema must be a JSON object")
    try:
        return OCRRequest.model_validate(fields)  # lax: form fields are text (`max_tokens=10`, `stream=true`)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _json_or(raw: str, default: Any, error: str | None = None) -> Any:
    try:
        return pydantic_core.from_json(raw)  # nesting beyond its limit is a ValueError, never a RecursionError
    except ValueError:
        if error:
            raise OCRError("invalid_request", error) from None
        return default


async def validate_task(ctx: AppContext, req: OCRRequest) -> None:
    check_request_limits(req, ctx.settings)  # sizes first: the same 4xx whatever the engine
    if req.json_schema is not None:  # CPU work (metaschema, references, regexes): off the event loop
        await asyncio.to_thread(check_schema, req.json_schema, ctx.settings)
    if req.task not in TASKS:
        raise OCRError("unknown_task", f"unknown task {req.task!r}; tasks: {', '.join(TASKS)}")
    info = await ctx.get_engine_info()
    if req.task not in info.supported_tasks:
        raise OCRError("unsupported_task", f"task {req.task!r} is not supported by the {info.name} engine "
                       f"(supported: {', '.join(info.supported_tasks)})")
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
    if req.fields is not None and len(req.fields) > ctx.settings.max_fields:
        raise OCRError("validation_error", f"at most {ctx.settings.max_fields} fields")
    if req.json_schema is not None:
        check_named_properties(req.json_schema)
    if req.include_raw and not ctx.settings.include_raw_output:
        raise OCRError("forbidden", "raw model output is disabled on this service (include_raw_output)")


@dataclass
class Upload:
    """What admission knows of an uploaded file before decoding it: its format and size in pixels (an image's
    header; for a PDF its page box at the DPI it would be rendered at), and for a PDF the open sandbox session."""

    data: bytes
    format: str
    width: int
    height: int
    pdf: Any = None  # service.admission.pdf.PdfSession

    def close(self) -> None:
        if self.pdf is not None:
            self.pdf.stop()
            self.pdf.close()


def probe_upload(data: bytes, settings, *, allow_pdf: bool = True) -> Upload:
    """Blocking (admission pool): an image's header, or a single-page PDF opened in the sandbox (its page count and
    box; no page loaded). Nothing is decoded or rendered."""
    s = settings
    if allow_pdf and sniff_format(data) == "PDF":
        from service.admission.pdf import PdfSession, rendered_size, single_page_pixel_budget

        session = PdfSession(data, s, single_page=True)
        try:
            (page,) = session.open().pages
        except BaseException:
            session.close()
            raise
        return Upload(data, "PDF", *rendered_size(page, s, single_page_pixel_budget(s)), pdf=session)
    fmt, width, height = probe_image(data, allowed_formats=s.allowed_formats, max_pixels=s.max_image_pixels,
                                     max_side=s.max_image_side)
    return Upload(data, fmt, width, height)


def decode_and_prepare(ctx: AppContext, req: OCRRequest, upload: Upload, engine: EngineInfo, request_id: str,
                       prompt: str | None = None) -> PreparedPage:
    """Blocking (admission pool): decode the image (or render the PDF's page), then budget, resize, re-encode. The
    decoded pixels are gone when it returns, their memory given back to the system for a large page."""
    try:
        return _decode_and_prepare(ctx, req, upload, engine, request_id, prompt)
    finally:
        if upload.width * upload.height >= RELEASE_AFTER_PIXELS:
            release_freed_memory()


def _decode_and_prepare(ctx: AppContext, req: OCRRequest, upload: Upload, engine: EngineInfo, request_id: str,
                        prompt: str | None) -> PreparedPage:
    s = ctx.settings
    started = time.perf_counter()
    try:
        if upload.pdf is not None:
            from service.admission.pdf import single_page_pixel_budget

            rendered = upload.pdf.render(1, single_page_pixel_budget(s))
            if rendered.error is not None:
                raise rendered.error
            decoded = DecodedImage(image=rendered.image, format="PDF", width=rendered.image.width,
                                   height=rendered.image.height)
        else:
            decoded = decode_image(upload.data, allowed_formats=s.allowed_formats, max_pixels=s.max_image_pixels,
                                   max_side=s.max_image_side, max_frames=s.max_frames,
                                   defer_pixels=s.png_pixel_check == "engine")
    finally:
        upload.close()
    return prepare_decoded_page(ctx, req, decoded, engine, request_id, started=started,
                                source="pdf" if upload.pdf is not None else "image", prompt=prompt)


def prepare_page(ctx: AppContext, req: OCRRequest, data: bytes, engine: EngineInfo,
                 request_id: str) -> PreparedPage:
    """All the CPU work of admitting one upload, in one blocking call (benchmarks): probe, decode, prepare."""
    return decode_and_prepare(ctx, req, probe_upload(data, ctx.settings), engine, request_id)


def plan_page(ctx: AppContext, req: OCRRequest, width: int, height: int, engine: EngineInfo,
              prompt: str | None = None) -> tuple[ImagePlan, str | None, int]:
    """How a page of this size goes to the engine: (plan, the prompt sent, the request's output budget). Only the
    size is needed, so it also prices an upload from its header before it is decoded. `prompt`: user text instead
    of the task's (a chat message)."""
    s = ctx.settings
    if max(width, height) > s.max_image_aspect_ratio * min(width, height):
        raise OCRError("unsupported_aspect_ratio", f"the image is {width}x{height}; sides may differ "
                       f"by at most {s.max_image_aspect_ratio:g}x")
    task = TASKS[req.task]
    max_tokens = min(req.max_tokens or task.default_max_tokens, s.max_output_tokens)
    if engine.name == "embedded":
        return plan_for_embedded(width, height, max_side=EMBEDDED_MAX_SIDE), None, max_tokens  # it takes no prompt
    prompt = build_prompt(req, s) if prompt is None else prompt
    # the engine's own processor limits where it reports them (a real 1.5 checkout allows 4096² pixels)
    processor = engine.image_processor
    plan = plan_for_vlm(width, height, max_model_len=s.max_model_len, max_tokens=max_tokens,
                        min_pixels=processor.min_pixels if processor else s.min_image_pixels,
                        max_pixels=processor.max_pixels if processor else s.max_engine_image_pixels,
                        prompt_overhead=prompt_token_bound(prompt, engine.prompt_template_tokens))
    return plan, prompt, max_tokens


def prepare_decoded_page(ctx: AppContext, req: OCRRequest, decoded: DecodedImage, engine: EngineInfo,
                         request_id: str, *, started: float | None = None, source: str = "image",
                         prompt: str | None = None) -> PreparedPage:
    """Budget, resize and prompt an already decoded page (also used by jobs), in the form the engine takes: pixels
    when it can (settings.engine_image_transport), else PNG, where an upload that already is a bare PNG of the
    planned pixels goes on as it is. `prompt`: user text instead of the task's (a chat message); the page's
    context budget counts whichever is sent."""
    s = ctx.settings
    started = time.perf_counter() if started is None else started
    plan, prompt, max_tokens = plan_page(ctx, req, decoded.width, decoded.height, engine, prompt)
    presizing = s.engine_image_presize and engine.image_processor is not None
    size = (plan.width, plan.height)
    if presizing:
        size = processor_size(*size, engine.image_processor)
    pixels_transport = s.engine_image_transport == "pixels" and "pixels" in engine.image_transports
    if decoded.png is not None and size == (decoded.width, decoded.height) and not pixels_transport:
        # the upload is already the engine's PNG: send it on, decoded here only if admission did not defer that
        page_image, width, height = {"image_png": decoded.png}, decoded.width, decoded.height
    else:
        image = resize_to(decoded.pixels(), plan.width, plan.height)
        if presizing:
            # the engine's processor would resize to multiples of 32 in its busy replica; same kernel, same pixels
            image = presize(image, engine.image_processor)
        if pixels_transport:
            page_image = {"image_rgb": (image if image.mode == "RGB" else image.convert("RGB")).tobytes()}
        else:
            page_image = {"image_png": encode_png(image)}
        width, height = image.width, image.height
    engine_request = EngineRequest(
        request_id=request_id, task=req.task, width=width, height=height, **page_image,
        prompt=prompt, max_tokens=plan.max_tokens or max_tokens, adapter=req.adapter,
        repetition_penalty=s.repetition_penalty, guided_json=guided_json_for(req, s), logprobs=req.confidence,
    )
    if s.bench_fixed_output_tokens:  # benchmarks: fixed output length, whatever the (random) weights emit
        engine_request.min_tokens, engine_request.ignore_eos = engine_request.max_tokens, True
    geometry = PageGeometry(decoded.width, decoded.height, plan.width, plan.height)
    return PreparedPage(engine_request, geometry, plan, (time.perf_counter() - started) * 1000, source)


def rate_limit_cost(ctx: AppContext, plan: ImagePlan, pages: int = 1) -> float:
    mode = ctx.settings.rate_limit_cost
    if mode == "image_tokens":
        # the embedded engine has no image tokens: charge what HunyuanOCR would
        return float(plan.image_tokens or max(1, plan.width * plan.height // 1024))
    if mode == "pages":
        return float(pages)
    return 1.0


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
        if not s.rate_limit_enabled:
            return None
        return self.principal.rate or s.default_rate, self.principal.burst or s.default_burst

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
        self.headers = decision.headers()
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


def probe_and_price(ctx: AppContext, req: OCRRequest, data: bytes, engine: EngineInfo, *,
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


async def admit_upload(ctx: AppContext, principal: Principal, req: OCRRequest, data: bytes, engine: EngineInfo,
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


async def run_ocr(ctx: AppContext, request: Request, principal: Principal) -> tuple[OCRRequest, PreparedPage,
                                                                                      dict[str, str]]:
    """Everything before the engine call; returns the prepared page and rate-limit headers."""
    req, data = await read_ocr_request(request, ctx.settings)
    setattr(request.state, STATE_TASK, req.task)  # metrics label (bounded to the task table by the middleware)
    await validate_task(ctx, req)
    if not principal.may_use_adapter(req.adapter):
        raise OCRError("forbidden", f"this API key may not use adapter {req.adapter!r}")
    info = await ctx.get_engine_info()
    request_id = "ocr-" + uuid.uuid4().hex[:24]
    page, headers = await admit_upload(ctx, principal, req, data, info, request_id)
    return req, page, headers


async def parse_output(ctx: AppContext, req: OCRRequest, result: EngineResult, geometry: PageGeometry) -> ParsedOutput:
    """The engine's output parsed for the request's task, in a thread: an extraction is validated against the
    tenant's schema (bounded by `max_schema_validation_steps`, but CPU work all the same)."""
    return await asyncio.to_thread(parse_engine_output, req.task, result, geometry, fields=req.fields,
                                   schema=req.json_schema,
                                   max_validation_steps=ctx.settings.max_schema_validation_steps)


def engine_stage_timings(result: EngineResult) -> dict[str, float]:
    """The parts of `engine` the engine measured itself (VLM engines): preprocess, time to first token, the engine
    core's first-to-last token time (generate) and how long its last token took to reach the engine (delivery)."""
    stages = {"preprocess": result.preprocess_ms, "first_token": result.first_token_ms,
              "generate": result.generate_ms, "delivery": result.delivery_ms}
    return {name: ms for name, ms in stages.items() if ms is not None}


def record_page(ctx: AppContext, req: OCRRequest, page: PreparedPage, result: EngineResult,
                confidence: float | None, timings_ms: dict[str, float]) -> None:
    """Per-page metrics of a successful page (stage latencies, tokens, confidence, repetition cut-offs)."""
    ctx.metrics.page_done(task=req.task, source=page.source, timings_ms=timings_ms,
                          image_tokens=result.image_tokens or page.plan.image_tokens,
                          output_tokens=result.output_tokens, confidence=confidence,
                          finish_reason=result.finish_reason, adapter=req.adapter)


def make_router(ctx: AppContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/ocr", response_model=OCRResponse, openapi_extra=OCR_OPENAPI_EXTRA,
                 responses={**openapi_error_responses(), **SSE_RESPONSE},
                 summary="Recognise one image (or single-page PDF)")
    async def ocr(request: Request):
        started = time.perf_counter()
        principal = ctx.authenticator.authenticate(request.headers)
        setattr(request.state, STATE_TENANT, principal.tenant)
        req, page, headers = await run_ocr(ctx, request, principal)
        info = await ctx.get_engine_info()
        if req.stream:
            events = await first_event_then_rest(_stream_events(ctx, req, page, info.model, started),
                                                 ctx.settings.request_timeout_s)
            return StreamingResponse(events, headers=headers, media_type="text/event-stream")
        engine_started = time.perf_counter()
        with ctx.metrics.waiting_for_engine():
            try:  # bounded latency: a request never waits on the engine longer than request_timeout_s
                result = await asyncio.wait_for(ctx.engine.generate(page.engine_request),
                                                ctx.settings.request_timeout_s)
            except TimeoutError:
                raise OCRError("timeout", f"no engine result within {ctx.settings.request_timeout_s:g}s; "
                               "retry later") from None
        engine_total_ms = (time.perf_counter() - engine_started) * 1000
        parse_started = time.perf_counter()
        result = guard_result(result, ctx.settings)  # engines that could not cut a loop while generating
        parsed = await parse_output(ctx, req, result, page.geometry)
        if parsed.errors and req.task == "extract" and ctx.settings.extraction_guided_retry:
            result, parsed = await _guided_extraction_retry(ctx, req, page, result, parsed)
        parse_ms = (time.perf_counter() - parse_started) * 1000
        timings = {
            "decode": page.decode_ms,
            "queue": max(0.0, engine_total_ms - result.engine_ms),
            "engine": result.engine_ms,
            **engine_stage_timings(result),
            "parse": parse_ms,
            "total": (time.perf_counter() - started) * 1000,
        }
        response = build_response(request_id=page.engine_request.request_id, model=req.adapter or info.model,
                                  task=req.task, result=result, geom=page.geometry, parsed=parsed,
                                  timings_ms=timings, adapter=req.adapter, include_raw=req.include_raw)
        record_page(ctx, req, page, result, parsed.confidence, timings)
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    return router


async def first_event_then_rest(events: AsyncIterator[str], timeout_s: float) -> AsyncIterator[str]:
    """Waits for a stream's first event before its 200 goes out, so that a request refused or failed before any
    output (a corrupt page, an unknown adapter, all replicas busy, no engine) gets its own 4xx/5xx, as without
    `stream`, instead of a 200 whose only event is the error. The wait is bounded like a whole unstreamed request."""
    try:
        first = await asyncio.wait_for(anext(events), timeout_s)
    except TimeoutError:
        await events.aclose()
        raise OCRError("timeout", f"no engine output within {timeout_s:g}s; retry later") from None
    except BaseException:
        await events.aclose()
        raise

    async def first_then_rest() -> AsyncIterator[str]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()  # a client that went away: the engine stops generating for it

    return first_then_rest()


async def _stream_events(ctx: AppContext, req: OCRRequest, page: PreparedPage, model: str,
                         started: float) -> AsyncIterator[str]:
    """SSE (service.parsing.streaming): `delta` and `line` events while the model writes, then one `result` event
    with the full response (or `error`). A looping output is cut by the repetition guard. A failure before the first
    event is raised, not sent (`first_event_then_rest` turns it into the response)."""
    sent = False
    try:
        final = None
        info = await ctx.get_engine_info()
        output = OutputStream(req.task, page.geometry, ctx.settings, generative=info.name != "embedded")
        with ctx.metrics.waiting_for_engine():
            deltas = ctx.engine.stream(page.engine_request)
            try:
                async for delta in deltas:
                    if delta.final is not None:
                        final = delta.final
                        break
                    for event, data in output.feed(delta):
                        sent = True
                        yield _sse(event, data)
                    if output.stop_reading:  # looping, and the engine did not cut it itself
                        final = output.cut_result()  # closing the stream aborts the generation
                        break
            finally:
                if hasattr(deltas, "aclose"):
                    await deltas.aclose()
        if final is None and output.looping:
            final = output.cut_result()
        assert final is not None, "engine stream ended without a final result"
        final = guard_result(final, ctx.settings)  # a loop that closed between two guard checks
        parsed = await parse_output(ctx, req, final, page.geometry)
        timings = {"decode": page.decode_ms, "engine": final.engine_ms, **engine_stage_timings(final),
                   "total": (time.perf_counter() - started) * 1000}
        response = build_response(request_id=page.engine_request.request_id, model=req.adapter or model,
                                  task=req.task, result=final, geom=page.geometry, parsed=parsed,
                                  timings_ms=timings, adapter=req.adapter, include_raw=req.include_raw)
        record_page(ctx, req, page, final, parsed.confidence, timings)
        sent = True
        yield _sse("result", response.model_dump(mode="json"))
    except OCRError as exc:
        if not sent:
            raise
        yield _sse("error", exc.body())
    except Exception:
        if not sent:
            raise
        log.exception("stream failed")
        yield _sse("error", OCRError("internal_error", "the engine failed while streaming").body())


async def _guided_extraction_retry(ctx: AppContext, req: OCRRequest, page: PreparedPage, result: EngineResult,
                                   parsed: ParsedOutput) -> tuple[EngineResult, ParsedOutput]:
    """Extraction failed validation: run once more with the schema enforced by structured output (guided JSON)."""
    schema = req.json_schema or schema_for_fields(req.fields or [])
    retry_request = page.engine_request.model_copy(update={"guided_json": schema})
    with ctx.metrics.waiting_for_engine():
        retried = await ctx.engine.generate(retry_request)
    reparsed = await parse_output(ctx, req, retried, page.geometry)
    if reparsed.errors and len(reparsed.errors) >= len(parsed.errors or []):
        parsed.warnings.append("a guided-JSON retry did not validate better; the first answer is kept")
        return result, parsed
    reparsed.warnings.append("the first answer failed validation; this one was generated with guided JSON")
    return retried, reparsed


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
