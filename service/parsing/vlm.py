"""HunyuanOCR raw output → the API's structured result, per task kind (service.tasks `output`).

* `lines` (spotting, layout): items from service.parsing.spotting; 0-1000 coordinates → pixels of the UPLOADED
  image (value / 1000 · uploaded width|height: the model saw the whole upload, only resized), rounded and clamped to
  the image; boxes with no area left are dropped with a warning. `text` = the lines' text joined by newlines.
* `json` (extract): service.parsing.extraction (fields, errors, per-field confidence).
* text kinds (text, document, table, formula, chart, translate, subtitles): the output as is, minus a code fence
  wrapping the whole output.
Confidence: per line / field from the tokens that wrote it, per document from all tokens (service.parsing.confidence).
"""

from __future__ import annotations

import re

from service.admission.schemas import DEFAULT_VALIDATION_STEPS
from service.schema import Line
from service.engine.protocol import EngineResult, TokenLogprob
from service.parsing.confidence import document_confidence, span_confidence, token_spans
from service.parsing.extraction import extract_fields
from service.parsing.page import PageGeometry, ParsedOutput, box_polygon, clamp_box
from service.parsing.spotting import SpottedItem, parse_spotting
from service.tasks import TASKS

NORMALISED = 1000.0  # HunyuanOCR coordinates are 0-1000 of the image it saw
_WHOLE_FENCE = re.compile(r"\A\s*```[\w-]*[ \t]*\n(.*?)\n?[ \t]*```\s*\Z", re.DOTALL)
_SPECIAL = re.compile(r"<[｜|][^<>]{0,128}?[｜|]>|</?(?:ref|quad|box|poly|hy-meta|layout)>|<pos_\d+>")


def strip_fence(text: str) -> str:
    """Unwrap an output that is one fenced block (```html … ```); anything else unchanged (minus outer blanks)."""
    m = _WHOLE_FENCE.match(text)
    if m and "```" not in m.group(1):
        return m.group(1)
    return text.strip()


def to_pixels(item: SpottedItem, geom: PageGeometry) -> tuple[list[int], list[list[int]]] | None:
    """Box and polygon of an item in uploaded pixels; None when the box is degenerate after clamping."""
    sx, sy = geom.width / NORMALISED, geom.height / NORMALISED
    points = [(x * sx, y * sy) for x, y in item.points]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    box = clamp_box(min(xs), min(ys), max(xs), max(ys), geom.width, geom.height)
    if box is None:
        return None
    if len(points) == 2:
        return box, box_polygon(box)
    polygon = [[max(0, min(geom.width, round(x))), max(0, min(geom.height, round(y)))] for x, y in points]
    return box, polygon


def lines_from_items(items: list[SpottedItem], geom: PageGeometry, tokens: list[TokenLogprob] | None,
                     spans: list[tuple[int, int]] | None) -> tuple[list[Line], int]:
    """Lines in uploaded pixels with confidences, and how many degenerate boxes were dropped."""
    lines: list[Line] = []
    degenerate = 0
    for item in items:
        mapped = to_pixels(item, geom)
        if mapped is None:
            degenerate += 1
            continue
        confidence = span_confidence(spans, tokens, *item.span) if tokens and spans is not None else None
        lines.append(Line(text=item.text, box=mapped[0], polygon=mapped[1], confidence=confidence,
                          category=item.category))
    return lines, degenerate


def parse_lines_output(raw: str, tokens: list[TokenLogprob] | None, geom: PageGeometry) -> ParsedOutput:
    parse = parse_spotting(raw)
    spans = token_spans(raw, tokens) if tokens else None
    lines, degenerate = lines_from_items(parse.items, geom, tokens, spans)
    warnings = list(parse.warnings)
    if degenerate:
        warnings.append(f"dropped {degenerate} line(s) whose box has no area inside the image")
    text = "\n".join(line.text for line in lines if line.text)
    if not parse.items and raw.strip():
        warnings.append("no text lines with coordinates could be read from the model output; `text` holds it as is")
        text = _SPECIAL.sub("", raw).strip()
    return ParsedOutput(text=text, lines=lines, confidence=document_confidence(tokens), warnings=warnings)


def parse_vlm_output(task: str, result: EngineResult, geom: PageGeometry, *, fields: list[str] | None = None,
                     schema: dict | None = None,
                     max_validation_steps: int = DEFAULT_VALIDATION_STEPS) -> ParsedOutput:
    """Task-specific parsing of a VLM engine's raw text (engines that return lines use result.lines instead)."""
    kind = TASKS[task].output if task in TASKS else "text"
    raw = result.text
    if kind == "lines":
        return parse_lines_output(raw, result.tokens, geom)
    if kind == "json":
        extraction = extract_fields(raw, fields=fields, schema=schema, tokens=result.tokens,
                                    max_validation_steps=max_validation_steps)
        return ParsedOutput(text=extraction.text, fields=extraction.fields, errors=extraction.errors,
                            confidence=document_confidence(result.tokens), warnings=extraction.warnings)
    return ParsedOutput(text=strip_fence(raw), confidence=document_confidence(result.tokens))
