"""Engine output → API response: lines in pixels of the uploaded image, text, confidences, extraction fields.

Coordinates: engines that detect lines themselves (embedded) return polygons in pixels of the image they were sent;
those are scaled back by uploaded/engine size per axis. HunyuanOCR returns boxes normalised to 0-1000 of the image it
saw, which is the whole (resized) upload, so they map to uploaded pixels as value/1000 · uploaded size.
"""

from __future__ import annotations

import logging

from service.admission.schemas import DEFAULT_VALIDATION_STEPS
from service.engine.protocol import EngineLine, EngineResult
from service.engine.repetition import REPETITION_WARNING
from service.parsing.page import PageGeometry, ParsedOutput, clamp_box
from service.parsing.vlm import parse_vlm_output
from service.schema import ImageInfo, Line, OCRResponse, RawOutput, RawToken, Usage

log = logging.getLogger(__name__)


def lines_from_engine(engine_lines: list[EngineLine], geom: PageGeometry) -> tuple[list[Line], list[str]]:
    """Embedded-engine polygons (engine pixels) → lines in uploaded pixels."""
    sx = geom.width / geom.engine_width
    sy = geom.height / geom.engine_height
    lines: list[Line] = []
    warnings: list[str] = []
    for eline in engine_lines:
        pts = [[x * sx, y * sy] for x, y in eline.polygon]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        box = clamp_box(min(xs), min(ys), max(xs), max(ys), geom.width, geom.height)
        if box is None:
            warnings.append("dropped a line with a degenerate box")
            continue
        polygon = [[max(0, min(geom.width, round(x))), max(0, min(geom.height, round(y)))] for x, y in pts]
        lines.append(Line(text=eline.text, box=box, polygon=polygon, confidence=eline.confidence))
    return lines, warnings


def parse_engine_output(task: str, result: EngineResult, geom: PageGeometry, *, fields: list[str] | None = None,
                        schema: dict | None = None,
                        max_validation_steps: int = DEFAULT_VALIDATION_STEPS) -> ParsedOutput:
    """Task-specific parsing of one engine result (CPU work: an extraction is validated against the tenant's schema
    in up to `max_validation_steps`)."""
    if result.lines is not None:  # engine detected lines itself
        lines, warnings = lines_from_engine(result.lines, geom)
        confs = [ln.confidence for ln in lines if ln.confidence is not None]
        doc_conf = sum(confs) / len(confs) if confs else None
        return ParsedOutput(text="\n".join(ln.text for ln in lines), lines=lines, confidence=doc_conf,
                            warnings=warnings)
    return parse_vlm_output(task, result, geom, fields=fields, schema=schema,
                            max_validation_steps=max_validation_steps)


def build_response(*, request_id: str, model: str, task: str, result: EngineResult, geom: PageGeometry,
                   parsed: ParsedOutput, timings_ms: dict[str, float], adapter: str | None = None,
                   extra_warnings: list[str] | None = None, include_raw: bool = False) -> OCRResponse:
    warnings = list(parsed.warnings) + list(extra_warnings or [])
    if result.finish_reason == "length":
        warnings.append("output hit max_tokens; the result may be incomplete")
    elif result.finish_reason == "repetition":
        warnings.append(REPETITION_WARNING)
    raw = None
    if include_raw:
        tokens = [RawToken(token=t.token, logprob=t.logprob) for t in result.tokens] if result.tokens else None
        raw = RawOutput(text=result.text, tokens=tokens, rendered_prompt=result.rendered_prompt)
    return OCRResponse(
        id=request_id,
        model=model,
        task=task,
        text=parsed.text,
        lines=parsed.lines,
        fields=parsed.fields,
        errors=parsed.errors,
        confidence=parsed.confidence,
        image=ImageInfo(width=geom.width, height=geom.height, engine_width=geom.engine_width,
                        engine_height=geom.engine_height, scale=round(geom.scale, 6)),
        usage=Usage(prompt_tokens=result.prompt_tokens, image_tokens=result.image_tokens,
                    output_tokens=result.output_tokens),
        timings_ms={k: round(v, 2) for k, v in timings_ms.items()},
        finish_reason=result.finish_reason,
        warnings=warnings,
        adapter=adapter,
        raw=raw,
    )
