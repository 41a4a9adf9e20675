"""OCR quality metrics of one page and their aggregation over a run (docs/EVAL.md defines each one).

Every metric is a ratio of two sums: a page (or document) contributes a numerator and a denominator (`STATS`), a
document's value is its own ratio and a run's value is the ratio of the sums over the documents that have the truth.
The bootstrap in `compare` resamples exactly these per-document pairs, so a run's number and its interval are
computed the same way. Text is normalised identically on both sides first (`normalise`).

Edit distances come from rapidfuzz (bit-parallel Levenshtein, linear memory); one-to-one matchings are optimal
assignments (scipy's `linear_sum_assignment`, Hungarian-type); TEDS is `table_recognition_metric.TEDS` (the
PubTabNet TEDS on the `apted` tree edit distance).
"""

from __future__ import annotations

import importlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from service.eval import EvalError

try:  # the `eval` extra; `require_metric_packages` names what is missing
    from rapidfuzz.distance import Levenshtein
    from rapidfuzz.process import cdist
    from scipy.optimize import linear_sum_assignment
except ImportError:  # pragma: no cover - exercised only without the extra
    Levenshtein = cdist = linear_sum_assignment = None

# name → (numerator, denominator, better): a document's value is num/den, a run's Σnum/Σden
RATIO_METRICS: dict[str, tuple[str, str, str]] = {
    "cer": ("char_edits", "chars", "lower"),
    "wer": ("word_edits", "words", "lower"),
    "cer_order_free": ("line_char_edits", "line_chars", "lower"),
    "line_precision": ("matched", "pred_lines", "higher"),
    "line_recall": ("matched", "truth_lines", "higher"),
    "line_f1": ("matched2", "truth_pred_lines", "higher"),
    "e2e_precision": ("e2e_matched", "pred_lines", "higher"),
    "e2e_recall": ("e2e_matched", "truth_lines", "higher"),
    "e2e_f1": ("e2e_matched2", "truth_pred_lines", "higher"),
    "mean_iou": ("iou_sum", "matched", "higher"),
    "field_exact": ("field_exact", "fields", "higher"),
    "field_similarity": ("field_similarity", "fields", "higher"),
    "json_valid": ("json_valid", "extractions", "higher"),
    "schema_valid": ("schema_valid", "extractions", "higher"),
    "markdown_ned": ("markdown_ned", "markdowns", "lower"),
    "teds": ("teds_sum", "table_slots", "higher"),
}
# metrics that are not a ratio of sums: calibration (binned) and speed (per-document latency, run wall time)
OTHER_METRICS: dict[str, str] = {"ece": "lower", "latency_p50_ms": "lower", "latency_p95_ms": "lower",
                                 "docs_per_s": "higher"}
BETTER: dict[str, str] = {name: spec[2] for name, spec in RATIO_METRICS.items()} | OTHER_METRICS
METRIC_NAMES: tuple[str, ...] = tuple(RATIO_METRICS) + tuple(OTHER_METRICS)

DEFAULT_IOU_THRESHOLD = 0.5
DEFAULT_ECE_BINS = 10
# a detection lying at least this much (share of its own area) inside a don't-care region is ignored (ICDAR rule)
DONT_CARE_AREA_SHARE = 0.5

# Han (with extensions and compatibility ideographs), kana and Hangul: one character is one word for WER
_CJK = ("\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
        "\U00020000-\U0002ebef\U00030000-\U0003134f")
_WORD = re.compile(rf"[{_CJK}]|[^\s{_CJK}]+")
_TABLE = re.compile(r"<table\b.*?</table\s*>", re.IGNORECASE | re.DOTALL)
_TH_OPEN = re.compile(r"<th(?=[\s>/])", re.IGNORECASE)
_TH_CLOSE = re.compile(r"</th\s*>", re.IGNORECASE)


def require_metric_packages() -> None:
    """The metrics need the `eval` extra (rapidfuzz, scipy, table-recognition-metric): one clear error if absent."""
    missing = [name for name, mod in (("rapidfuzz", Levenshtein), ("scipy", linear_sum_assignment)) if mod is None]
    try:
        importlib.import_module("table_recognition_metric")  # with its lxml, Levenshtein and apted
    except ImportError:
        missing.append("table-recognition-metric")
    if missing:
        raise EvalError(f"ocr-serve eval needs {', '.join(missing)}: pip install 'hunyuan-ocr-service[eval]'")


# --- normalisation ------------------------------------------------------------------------------------------------

def normalise(text: str, *, ignore_case: bool = False) -> str:
    """Unicode NFKC, every run of whitespace (newlines included) to one space, no leading/trailing space; with
    `ignore_case`, case-folded. Applied identically to truth and prediction."""
    text = " ".join(unicodedata.normalize("NFKC", text).split())
    return text.casefold() if ignore_case else text


def words(text: str) -> list[str]:
    """WER tokens of normalised text: whitespace-separated words, each CJK character a word of its own."""
    return _WORD.findall(text)


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (unit costs) of two strings or two sequences of hashable items."""
    return int(Levenshtein.distance(a, b))


def similarity(a: str, b: str) -> float:
    """1 − edit distance / length of the longer string; two empty strings are identical (1.0)."""
    longest = max(len(a), len(b))
    return 1.0 - edit_distance(a, b) / longest if longest else 1.0


# --- text ---------------------------------------------------------------------------------------------------------

def text_stats(truth: str, prediction: str) -> dict[str, float]:
    """CER and WER counts of normalised texts, in reading order: edits and truth length."""
    return {"char_edits": edit_distance(truth, prediction), "chars": len(truth),
            "word_edits": edit_distance(words(truth), words(prediction)), "words": len(words(truth))}


def order_free_stats(truth_lines: list[str], pred_lines: list[str]) -> dict[str, float]:
    """Order-free CER counts: truth and predicted lines paired one-to-one to minimise the total edit distance
    (optimal assignment); an unpaired truth line counts as deleted, an unpaired predicted line as inserted.

    Pairing as many lines as possible is always optimal (the distance of a pair never exceeds the two lengths
    added), so a rectangular assignment gives the exact minimum."""
    truth_lines = [t for t in truth_lines if t]
    pred_lines = [p for p in pred_lines if p]
    chars = sum(map(len, truth_lines))
    if not truth_lines or not pred_lines:
        return {"line_char_edits": chars + sum(map(len, pred_lines)), "line_chars": chars}
    cost = cdist(truth_lines, pred_lines, scorer=Levenshtein.distance, dtype=np.int64, workers=1)
    rows, cols = linear_sum_assignment(cost)
    edits = int(cost[rows, cols].sum())
    edits += sum(len(t) for i, t in enumerate(truth_lines) if i not in set(rows.tolist()))
    edits += sum(len(p) for j, p in enumerate(pred_lines) if j not in set(cols.tolist()))
    return {"line_char_edits": edits, "line_chars": chars}


# --- boxes --------------------------------------------------------------------------------------------------------

def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box of `a` (n×4, x1 y1 x2 y2) with every box of `b` (m×4)."""
    a = np.asarray(a, dtype=float).reshape(-1, 4)
    b = np.asarray(b, dtype=float).reshape(-1, 4)
    iw = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    ih = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = iw * ih
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def match_pairs(iou: np.ndarray, allowed: np.ndarray) -> list[tuple[int, int]]:
    """One-to-one matching of rows to columns among the `allowed` pairs: as many pairs as possible, and among those
    the largest total IoU (an optimal assignment whose weights put any extra pair above every IoU sum)."""
    if iou.size == 0 or not allowed.any():
        return []
    bonus = min(iou.shape) + 1.0  # > any achievable IoU sum, so one more pair always wins
    weight = np.where(allowed, bonus + iou, 0.0)
    rows, cols = linear_sum_assignment(weight, maximize=True)
    return [(int(i), int(j)) for i, j in zip(rows, cols) if allowed[i, j]]


@dataclass
class Line:
    text: str  # normalised
    box: tuple[float, float, float, float] | None = None
    confidence: float | None = None
    ignore: bool = False  # truth only: a don't-care region


@dataclass
class LineResult:
    stats: dict[str, float]
    calibration: list[tuple[float, int]] = field(default_factory=list)  # (confidence, correct) per predicted line
    kept_predictions: list[Line] = field(default_factory=list)  # predictions outside don't-care regions


def drop_dont_care(truth: list[Line], predicted: list[Line]) -> tuple[list[Line], list[Line]]:
    """Truth lines to score, and predictions not lying mostly (≥ DONT_CARE_AREA_SHARE of their area) inside a
    don't-care region. Predictions without a box are kept."""
    cared = [t for t in truth if not t.ignore]
    regions = [t.box for t in truth if t.ignore and t.box is not None]
    if not regions:
        return cared, list(predicted)
    kept = []
    for line in predicted:
        if line.box is None:
            kept.append(line)
            continue
        x1, y1, x2, y2 = line.box
        area = max(0.0, x2 - x1) * max(0.0, y2 - y1)
        inside = max((max(0.0, min(x2, r[2]) - max(x1, r[0])) * max(0.0, min(y2, r[3]) - max(y1, r[1]))
                      for r in regions), default=0.0)
        if not (area > 0 and inside / area >= DONT_CARE_AREA_SHARE):
            kept.append(line)
    return cared, kept


def line_stats(truth: list[Line], predicted: list[Line], iou_threshold: float) -> LineResult:
    """Detection and end-to-end counts of one page, whose truth lines all have boxes.

    Detection: one-to-one matching at IoU ≥ threshold (most pairs, then largest IoU sum). End-to-end: its own
    one-to-one matching among pairs at IoU ≥ threshold whose normalised texts are equal. A predicted line is
    "correct" for calibration when it is in the end-to-end matching."""
    truth, predicted = drop_dont_care(truth, predicted)
    boxed = [p for p in predicted if p.box is not None]
    n, m = len(truth), len(boxed)
    iou = iou_matrix([t.box for t in truth], [p.box for p in boxed]) if n and m else np.zeros((n, m))
    overlapping = iou >= iou_threshold
    matches = match_pairs(iou, overlapping)
    same_text = np.array([[t.text == p.text for p in boxed] for t in truth], dtype=bool).reshape(n, m)
    e2e = match_pairs(iou, overlapping & same_text)
    correct = {j for _, j in e2e}
    stats = {"truth_lines": n, "pred_lines": m, "truth_pred_lines": n + m,
             "matched": len(matches), "matched2": 2 * len(matches),
             "iou_sum": float(sum(iou[i, j] for i, j in matches)),
             "e2e_matched": len(e2e), "e2e_matched2": 2 * len(e2e)}
    calibration = [(float(p.confidence), int(j in correct)) for j, p in enumerate(boxed) if p.confidence is not None]
    return LineResult(stats, calibration, predicted)


# --- fields, markdown, tables -------------------------------------------------------------------------------------

def field_text(value: Any) -> str:
    """A field value as text: strings as they are, null as empty, anything else as compact JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def field_stats(truth: dict[str, Any], predicted: dict[str, Any], *, ignore_case: bool) -> tuple[dict, dict]:
    """(counts, per-field detail): exact match and normalised edit similarity of every truth field; a field the
    prediction lacks is compared as empty."""
    detail = {}
    for name, value in truth.items():
        t = normalise(field_text(value), ignore_case=ignore_case)
        p = normalise(field_text(predicted.get(name)), ignore_case=ignore_case)
        detail[name] = {"exact": int(t == p), "similarity": similarity(t, p)}
    counts = {"field_exact": sum(d["exact"] for d in detail.values()),
              "field_similarity": sum(d["similarity"] for d in detail.values()), "fields": len(detail)}
    return counts, detail


def markdown_stats(truth: str, prediction: str) -> dict[str, float]:
    """Normalised edit distance of normalised markdown: distance / length of the longer (0 = identical)."""
    return {"markdown_ned": 1.0 - similarity(truth, prediction), "markdowns": 1}


def find_tables(text: str) -> list[str]:
    """Every `<table>…</table>` of an output (HTML tables in markdown, or a table task's HTML)."""
    return _TABLE.findall(text)


def teds(truth_html: str, pred_html: str) -> float:
    """TEDS in [0, 1] of two `<table>` fragments (1 = same structure and cell text). Header cells count as data
    cells (`th` → `td`), the fragments are wrapped in the html/body the implementation looks for, and a
    prediction it cannot parse scores 0."""
    from table_recognition_metric import TEDS

    def prepared(html: str) -> str:
        return f"<html><body>{_TH_CLOSE.sub('</td>', _TH_OPEN.sub('<td', html))}</body></html>"

    try:
        return float(TEDS()(prepared(pred_html), prepared(truth_html)))
    except Exception:  # malformed prediction HTML (bad colspan, unparsable): no credit, never a crash
        return 0.0


def table_stats(truth_tables: list[str], pred_tables: list[str]) -> dict[str, float]:
    """Truth and predicted tables paired one-to-one for the largest total TEDS; the page's score is that total over
    max(#truth, #predicted) slots, so a missing or an extra table counts 0."""
    slots = max(len(truth_tables), len(pred_tables))
    if not truth_tables or not pred_tables:
        return {"teds_sum": 0.0, "table_slots": slots}
    scores = np.array([[teds(t, p) for p in pred_tables] for t in truth_tables])
    rows, cols = linear_sum_assignment(scores, maximize=True)
    return {"teds_sum": float(scores[rows, cols].sum()), "table_slots": slots}


def json_object_stats(text: str, errors: list[str] | None) -> dict[str, int]:
    """Extraction: `json_valid` — the response's `text` is a JSON object (the service read one from the model's
    output, after its documented repairs); `schema_valid` — and every requested field validated (`errors` empty)."""
    try:
        valid = isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        valid = False
    return {"json_valid": int(valid), "schema_valid": int(valid and not errors), "extractions": 1}


# --- calibration --------------------------------------------------------------------------------------------------

def calibration_bins(pairs: Sequence[tuple[float, int]], bins: int = DEFAULT_ECE_BINS) -> np.ndarray:
    """Per equal-width confidence bin: [count, Σ confidence, Σ correct]; bin b holds [b/B, (b+1)/B), the last
    one includes 1.0."""
    out = np.zeros((bins, 3))
    if not pairs:
        return out
    arr = np.asarray(pairs, dtype=float)
    conf = np.clip(arr[:, 0], 0.0, 1.0)
    index = np.minimum((conf * bins).astype(int), bins - 1)
    np.add.at(out[:, 0], index, 1.0)
    np.add.at(out[:, 1], index, conf)
    np.add.at(out[:, 2], index, arr[:, 1])
    return out


def ece_from_bins(binned: np.ndarray) -> float | None:
    """Expected calibration error Σ_b (n_b/N)·|accuracy_b − mean confidence_b| = Σ_b |Σcorrect_b − Σconf_b| / N
    (of one set of bins, or of each of a stack of them)."""
    total = binned[..., 0].sum(axis=-1)
    gap = np.abs(binned[..., 2] - binned[..., 1]).sum(axis=-1)
    if np.ndim(total) == 0:
        return float(gap / total) if total else None
    return np.divide(gap, total, out=np.full_like(gap, np.nan), where=total > 0)


# --- aggregation --------------------------------------------------------------------------------------------------

def ratio(stats: dict[str, float], name: str) -> float | None:
    """One metric of one document (or of summed stats); None where it has no denominator (no truth for it)."""
    num, den, _ = RATIO_METRICS[name]
    if den not in stats or not stats[den]:
        return None
    return stats.get(num, 0.0) / stats[den]


def add_stats(total: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    for key, value in stats.items():
        total[key] = total.get(key, 0.0) + value
    return total


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None
