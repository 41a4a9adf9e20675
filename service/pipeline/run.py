"""From a prepared page to the response: the engine call (bounded by `request_timeout_s`), the repetition guard,
parsing (in a thread: an extraction validates against the tenant's schema), one guided-JSON retry of an extraction
that failed validation, the response and the page's metrics. `recognise` runs a page to its response; `stream_page`
yields its events (`delta`, `line`, then `result`) as the model writes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from service.engine.protocol import EngineRequest, EngineResult
from service.engine.repetition import guard_result
from service.errors import OCRError
from service.parsing.extraction import schema_for_fields
from service.parsing.page import PageGeometry, ParsedOutput
from service.parsing.response import build_response, parse_engine_output
from service.parsing.streaming import OutputStream
from service.pipeline.context import AppContext
from service.pipeline.page import PreparedPage
from service.schema import OCRRequest, OCRResponse

log = logging.getLogger(__name__)


async def parse_output(ctx: AppContext, req: OCRRequest, result: EngineResult, geometry: PageGeometry) -> ParsedOutput:
    """The engine's output parsed for the request's task, in a thread: an extraction is validated against the
    tenant's schema (bounded by `max_schema_validation_steps`, but CPU work all the same)."""
    return await asyncio.to_thread(parse_engine_output, req.task, result, geometry, fields=req.fields,
                                   schema=req.json_schema,
                                   max_validation_steps=ctx.settings.limits.max_schema_validation_steps)


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


async def generate(ctx: AppContext, engine_request: EngineRequest) -> EngineResult:
    """One engine call, counted as waiting for the engine and bounded: a request never waits on the engine longer
    than `request_timeout_s` (504 `timeout`)."""
    with ctx.metrics.waiting_for_engine():
        try:
            return await asyncio.wait_for(ctx.engine.generate(engine_request), ctx.settings.server.request_timeout_s)
        except TimeoutError:
            raise OCRError("timeout", f"no engine result within {ctx.settings.server.request_timeout_s:g}s; "
                           "retry later") from None


async def recognise(ctx: AppContext, req: OCRRequest, page: PreparedPage, *, model: str, started: float,
                    extra_timings: dict[str, float] | None = None, request_id: str | None = None) -> OCRResponse:
    """Run the page through the engine and parse the result into the response. `started`: when the request's
    clock started (the `total` timing); `extra_timings`: stages measured before (a job page's `render`);
    `request_id`: the engine request's id when it differs from the page's (a job page's retry)."""
    engine_request = page.engine_request
    if request_id is not None:
        engine_request = engine_request.model_copy(update={"request_id": request_id})
    engine_started = time.perf_counter()
    result = await generate(ctx, engine_request)
    engine_total_ms = (time.perf_counter() - engine_started) * 1000
    parse_started = time.perf_counter()
    result = guard_result(result, ctx.settings)  # engines that could not cut a loop while generating
    parsed = await parse_output(ctx, req, result, page.geometry)
    if parsed.errors and req.task == "extract" and ctx.settings.parsing.extraction_guided_retry:
        result, parsed = await _guided_extraction_retry(ctx, req, page, result, parsed)
    timings = {
        **(extra_timings or {}),
        "decode": page.decode_ms,
        "queue": max(0.0, engine_total_ms - result.engine_ms),
        "engine": result.engine_ms,
        **engine_stage_timings(result),
        "parse": (time.perf_counter() - parse_started) * 1000,
        "total": (time.perf_counter() - started) * 1000,
    }
    response = build_response(request_id=page.engine_request.request_id, model=model, task=req.task,
                              result=result, geom=page.geometry, parsed=parsed, timings_ms=timings,
                              adapter=req.adapter, include_raw=req.include_raw)
    record_page(ctx, req, page, result, parsed.confidence, timings)
    return response


async def stream_page(ctx: AppContext, req: OCRRequest, page: PreparedPage, *, model: str,
                      started: float) -> AsyncIterator[tuple[str, Any]]:
    """(event, data) pairs (service.parsing.streaming): `delta` and `line` while the model writes, then one
    `result` with the full response. A looping output is cut by the repetition guard. Errors are raised; the HTTP
    layer turns one before the first event into the response and a later one into an `error` event."""
    info = await ctx.get_engine_info()
    output = OutputStream(req.task, page.geometry, ctx.settings, generative=info.name != "embedded")
    final = None
    with ctx.metrics.waiting_for_engine():
        deltas = ctx.engine.stream(page.engine_request)
        try:
            async for delta in deltas:
                if delta.final is not None:
                    final = delta.final
                    break
                for event in output.feed(delta):
                    yield event
                if output.stop_reading:  # looping, and the engine did not cut it itself
                    final = output.cut_result()  # closing the stream aborts the generation
                    break
        finally:
            if hasattr(deltas, "aclose"):
                await deltas.aclose()
    if final is None and output.looping:
        final = output.cut_result()
    if final is None:
        raise RuntimeError("engine stream ended without a final result")
    final = guard_result(final, ctx.settings)  # a loop that closed between two guard checks
    parsed = await parse_output(ctx, req, final, page.geometry)
    timings = {"decode": page.decode_ms, "engine": final.engine_ms, **engine_stage_timings(final),
               "total": (time.perf_counter() - started) * 1000}
    response = build_response(request_id=page.engine_request.request_id, model=model, task=req.task,
                              result=final, geom=page.geometry, parsed=parsed, timings_ms=timings,
                              adapter=req.adapter, include_raw=req.include_raw)
    record_page(ctx, req, page, final, parsed.confidence, timings)
    yield "result", response.model_dump(mode="json")


async def _guided_extraction_retry(ctx: AppContext, req: OCRRequest, page: PreparedPage, result: EngineResult,
                                   parsed: ParsedOutput) -> tuple[EngineResult, ParsedOutput]:
    """Extraction failed validation: run once more with the schema enforced by structured output (guided JSON)."""
    schema = req.json_schema or schema_for_fields(req.fields or [])
    retry_request = page.engine_request.model_copy(update={"guided_json": schema})
    retried = await generate(ctx, retry_request)
    reparsed = await parse_output(ctx, req, retried, page.geometry)
    if reparsed.errors and len(reparsed.errors) >= len(parsed.errors or []):
        parsed.warnings.append("a guided-JSON retry did not validate better; the first answer is kept")
        return result, parsed
    reparsed.warnings.append("the first answer failed validation; this one was generated with guided JSON")
    return retried, reparsed
