"""One document's metrics from its truth and the service's responses (the pages' counts added up).

What a task's response is compared with (docs/EVAL.md, "Which truth a task is scored on"):
- text-producing tasks: `text` → CER/WER in reading order; lines (or the text's lines) → order-free CER;
- `spotting`, `layout`: also the `lines` with boxes → detection, end-to-end, mean IoU, calibration;
- `document`: the markdown → `markdown` (NED) and its HTML tables → `tables` (TEDS); `table`: the HTML → `tables`;
- `extract`: `fields` → exact match and similarity per field, JSON validity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.eval import metrics
from service.eval.client import DocumentOutcome
from service.eval.manifest import ManifestDocument, PageTruth

TEXT_TASKS = frozenset({"spotting", "layout", "text", "subtitles", "formula", "chart", "translate"})
LINE_TASKS = frozenset({"spotting", "layout"})
MARKDOWN_TASKS = frozenset({"document"})
TABLE_TASKS = frozenset({"document", "table"})
FIELD_TASKS = frozenset({"extract"})
# the truth keys each task can be scored on (a run warns about truths its task leaves unscored)
SCORED_TRUTHS = {
    task: tuple(key for key, tasks in (("text", TEXT_TASKS), ("lines", TEXT_TASKS), ("markdown", MARKDOWN_TASKS),
                                       ("tables", TABLE_TASKS), ("fields", FIELD_TASKS)) if task in tasks)
    for task in TEXT_TASKS | MARKDOWN_TASKS | TABLE_TASKS | FIELD_TASKS
}


@dataclass
class ScoreSettings:
    task: str
    iou_threshold: float = metrics.DEFAULT_IOU_THRESHOLD
    ignore_case: bool = False


@dataclass
class DocumentScore:
    id: str
    line: int  # in the manifest
    pages: int
    error: str | None = None
    latency_ms: float | None = None
    retries: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    fields: dict[str, dict[str, float]] = field(default_factory=dict)  # field name → exact, similarity
    calibration: list[tuple[float, int]] = field(default_factory=list)  # (confidence, correct) per predicted line
    model: str | None = None

    def metric(self, name: str) -> float | None:
        return None if self.error else metrics.ratio(self.stats, name)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "line": self.line, "pages": self.pages, "error": self.error,
                "latency_ms": self.latency_ms, "retries": self.retries, "model": self.model, "stats": self.stats,
                "fields": self.fields, "calibration": [list(pair) for pair in self.calibration]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DocumentScore":
        return cls(id=data["id"], line=data["line"], pages=data["pages"], error=data["error"],
                   latency_ms=data["latency_ms"], retries=data["retries"], stats=data["stats"],
                   fields=data["fields"], calibration=[(float(c), int(k)) for c, k in data["calibration"]],
                   model=data.get("model"))


def score_document(doc: ManifestDocument, outcome: DocumentOutcome, settings: ScoreSettings) -> DocumentScore:
    score = DocumentScore(doc.id, doc.line_no, len(doc.pages), outcome.error, outcome.latency_ms, outcome.retries)
    if outcome.error is not None:
        return score
    results = {p.page: p.result for p in outcome.pages}
    for truth in doc.pages:
        result = results[truth.page]
        score.model = score.model or result.get("model")
        _score_page(truth, result, settings, score)
    return score


def _score_page(truth: PageTruth, result: dict[str, Any], settings: ScoreSettings, score: DocumentScore) -> None:
    task, norm = settings.task, _normaliser(settings.ignore_case)
    text = result.get("text") or ""
    predicted = _predicted_lines(result, truth.frame, norm)
    if task in TEXT_TASKS:
        truth_lines = None
        if truth.lines is not None:
            truth_lines = [metrics.Line(norm(t.text), t.box, ignore=t.ignore) for t in truth.lines]
        kept = predicted
        if truth_lines is not None and any(t.ignore for t in truth_lines):
            kept = metrics.drop_dont_care(truth_lines, predicted)[1]
        if task in LINE_TASKS and truth_lines and all(t.box is not None for t in truth_lines):
            lines = metrics.line_stats(truth_lines, predicted, settings.iou_threshold)
            metrics.add_stats(score.stats, lines.stats)
            score.calibration += lines.calibration
        # the text as returned, less what lies in don't-care regions (only a response with lines can say)
        pred_text = "\n".join(p.text for p in kept) if kept is not predicted else text
        reading = truth.reading_text()
        if reading is not None:
            metrics.add_stats(score.stats, metrics.text_stats(norm(reading), norm(pred_text)))
            if truth_lines is not None:
                truth_texts = [t.text for t in truth_lines if not t.ignore]
            else:
                truth_texts = [norm(part) for part in reading.split("\n")]
            pred_texts = [p.text for p in kept] if predicted else [norm(part) for part in text.split("\n")]
            metrics.add_stats(score.stats, metrics.order_free_stats(truth_texts, pred_texts))
    if task in MARKDOWN_TASKS and truth.markdown is not None:
        metrics.add_stats(score.stats, metrics.markdown_stats(norm(truth.markdown), norm(text)))
    if task in TABLE_TASKS and truth.tables is not None:
        truth_tables = [norm(t) for t in truth.tables]
        pred_tables = [norm(t) for t in metrics.find_tables(text)]
        metrics.add_stats(score.stats, metrics.table_stats(truth_tables, pred_tables))
    if task in FIELD_TASKS and truth.fields is not None:
        values = {name: (item or {}).get("value") for name, item in (result.get("fields") or {}).items()}
        counts, detail = metrics.field_stats(truth.fields, values, ignore_case=settings.ignore_case)
        metrics.add_stats(score.stats, counts)
        metrics.add_stats(score.stats, metrics.json_object_stats(text, result.get("errors")))
        for name, value in detail.items():  # a PDF's pages may repeat a field name: keep the page-summed counts
            slot = score.fields.setdefault(name, {"exact": 0, "similarity": 0.0, "count": 0})
            slot["exact"] += value["exact"]
            slot["similarity"] += value["similarity"]
            slot["count"] += 1


def _predicted_lines(result: dict[str, Any], frame: tuple[float, float], norm) -> list[metrics.Line]:
    """The response's lines, boxes moved from the uploaded image's pixels to the truth's frame (the same for an
    image; PDF points for a PDF page, whose pixels depend on the DPI the service rendered it at)."""
    image = result.get("image") or {}
    sx = frame[0] / image["width"] if image.get("width") else 1.0
    sy = frame[1] / image["height"] if image.get("height") else 1.0
    out = []
    for line in result.get("lines") or []:
        box = line.get("box")
        scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy) if box else None
        out.append(metrics.Line(norm(line.get("text") or ""), scaled, line.get("confidence")))
    return out


def _normaliser(ignore_case: bool):
    return lambda text: metrics.normalise(text, ignore_case=ignore_case)
