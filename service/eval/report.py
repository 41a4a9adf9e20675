"""A run's outputs: summary.json, documents.csv (worst first), documents.jsonl (what `compare` resamples),
responses.jsonl (the service's answers, to look into a bad document), report.md and PNG plots (with the `eval`
extra's matplotlib; without it the report says the plots were skipped).

summary.json (schema version 1, docs/EVAL.md "summary.json"):
    {"schema_version": 1, "documents": N, "errors": N, "pages": N,
     "metrics": {name: value or null for every name of metrics.METRIC_NAMES},
     "per_field": {field: {"exact", "similarity", "count"}},
     "calibration": {"bins": [{"lower", "upper", "lines", "mean_confidence", "accuracy"}], "lines": N},
     "coverage": {metric: documents that have its truth},
     "settings": {...}, "manifest": {"path", "sha256", "documents"}, "wall_s": s}
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from service.eval import metrics
from service.eval.score import DocumentScore

SCHEMA_VERSION = 1
SUMMARY_FILE, DOCUMENTS_CSV, DOCUMENTS_JSONL = "summary.json", "documents.csv", "documents.jsonl"
REPORT_MD, RESPONSES_JSONL = "report.md", "responses.jsonl"
# documents.csv columns after id/error: these metrics, then the counts behind them
CSV_METRICS = ("cer", "wer", "cer_order_free", "line_precision", "line_recall", "line_f1", "e2e_f1", "mean_iou",
               "field_exact", "field_similarity", "json_valid", "markdown_ned", "teds")
CSV_COUNTS = ("chars", "truth_lines", "pred_lines", "fields", "table_slots")
# worst first: errors, then by these metrics in turn (a missing value sorts after every present one)
WORST_FIRST_KEYS = ("cer", "e2e_f1", "line_f1", "field_exact", "markdown_ned", "teds")


def summarise(scores: list[DocumentScore], *, wall_s: float, settings: dict[str, Any], manifest: dict[str, Any],
              ece_bins: int) -> dict[str, Any]:
    ok = [s for s in scores if s.error is None]
    total: dict[str, float] = {}
    for score in ok:
        metrics.add_stats(total, score.stats)
    values: dict[str, float | None] = {name: _round(metrics.ratio(total, name)) for name in metrics.RATIO_METRICS}
    pairs = [pair for s in ok for pair in s.calibration]
    binned = metrics.calibration_bins(pairs, ece_bins)
    values["ece"] = _round(metrics.ece_from_bins(binned))
    latencies = [s.latency_ms for s in ok if s.latency_ms is not None]
    values["latency_p50_ms"] = _round(metrics.percentile(latencies, 50), 1)
    values["latency_p95_ms"] = _round(metrics.percentile(latencies, 95), 1)
    values["docs_per_s"] = _round(len(ok) / wall_s if wall_s > 0 and ok else None, 3)
    per_field: dict[str, dict[str, float]] = {}
    for score in ok:
        for name, detail in score.fields.items():
            metrics.add_stats(per_field.setdefault(name, {}), detail)
    return {
        "schema_version": SCHEMA_VERSION,
        "documents": len(scores),
        "errors": len(scores) - len(ok),
        "pages": sum(s.pages for s in scores),
        "metrics": {name: values[name] for name in metrics.METRIC_NAMES},
        "per_field": {name: {"exact": _round(d["exact"] / d["count"]),
                             "similarity": _round(d["similarity"] / d["count"]), "count": int(d["count"])}
                      for name, d in sorted(per_field.items())},
        "calibration": {"bins": _bins_json(binned), "lines": len(pairs)},
        "coverage": {name: sum(1 for s in ok if s.metric(name) is not None) for name in metrics.RATIO_METRICS},
        "retries": sum(s.retries for s in scores),
        "models": sorted({s.model for s in ok if s.model}),
        "settings": settings,
        "manifest": manifest,
        "wall_s": round(wall_s, 3),
    }


def write_outputs(out: Path, summary: dict[str, Any], scores: list[DocumentScore],
                  responses: list[dict[str, Any]] | None = None) -> list[Path]:
    """Every output file; `responses` (what the service answered, per document) go to responses.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / SUMMARY_FILE, out / DOCUMENTS_CSV, out / DOCUMENTS_JSONL]
    written[0].write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    ordered = worst_first(scores)
    _write_csv(written[1], ordered)
    with written[2].open("w", encoding="utf-8") as fh:
        for score in scores:
            fh.write(json.dumps(score.to_json(), ensure_ascii=False) + "\n")
    if responses is not None:
        written.append(out / RESPONSES_JSONL)
        with written[-1].open("w", encoding="utf-8") as fh:
            for response in responses:
                fh.write(json.dumps(response, ensure_ascii=False) + "\n")
    plots, plot_note = write_plots(out, summary, scores)
    written += plots
    (out / REPORT_MD).write_text(render_report(summary, ordered, plots, plot_note), encoding="utf-8")
    written.append(out / REPORT_MD)
    return written


def worst_first(scores: list[DocumentScore]) -> list[DocumentScore]:
    def key(score: DocumentScore):
        parts: list[tuple[int, float]] = []
        for name in WORST_FIRST_KEYS:
            value = score.metric(name)
            if value is None:
                parts.append((1, 0.0))
            else:  # larger badness first
                parts.append((0, -value if metrics.BETTER[name] == "lower" else value))
        return (0 if score.error else 1, parts, score.id)

    return sorted(scores, key=key)


def _write_csv(path: Path, ordered: list[DocumentScore]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "manifest_line", "error", *CSV_METRICS, "latency_ms", "retries", "pages", *CSV_COUNTS])
        for s in ordered:
            writer.writerow([s.id, s.line, s.error or "", *(_cell(s.metric(name)) for name in CSV_METRICS),
                             _cell(s.latency_ms, 1), s.retries, s.pages,
                             *(_cell(s.stats.get(name), 0) if not s.error else "" for name in CSV_COUNTS)])


def render_report(summary: dict[str, Any], ordered: list[DocumentScore], plots: list[Path], plot_note: str) -> str:
    m, s = summary["metrics"], summary["settings"]
    lines = ["# OCR quality report", "",
             f"Manifest `{summary['manifest']['path']}` ({summary['documents']} documents, {summary['pages']} pages, "
             f"sha256 `{summary['manifest']['sha256'][:16]}…`), service {s['url']}, task `{s['task']}`"
             + (f", adapter `{s['adapter']}`" if s.get("adapter") else "")
             + f", model {', '.join(summary['models']) or 'unknown'}.",
             f"Errors: {summary['errors']}; retries after 429/503: {summary['retries']}. "
             f"Normalisation: NFKC, whitespace collapsed, case {'folded' if s['ignore_case'] else 'kept'}; "
             f"IoU threshold {s['iou_threshold']}.", "",
             "| metric | value | documents with its truth |", "|---|---|---|"]
    for name in metrics.METRIC_NAMES:
        value = m[name]
        if value is None:
            continue
        coverage = summary["coverage"].get(name, "")
        better = "↓" if metrics.BETTER[name] == "lower" else "↑"
        lines.append(f"| {name} {better} | {_fmt(value, 1 if name.endswith('_ms') else 4)} | {coverage} |")
    missing = [name for name in metrics.METRIC_NAMES if m[name] is None]
    if missing:
        lines += ["", f"Not measured (no truth for them, or not this task's output): {', '.join(missing)}."]
    if summary["per_field"]:
        lines += ["", "## Fields", "", "| field | exact | similarity | count |", "|---|---|---|---|"]
        lines += [f"| {name} | {_fmt(d['exact'])} | {_fmt(d['similarity'])} | {d['count']} |"
                  for name, d in summary["per_field"].items()]
    cal = summary["calibration"]
    if cal["lines"]:
        lines += ["", "## Confidence calibration", "",
                  f"{cal['lines']} predicted lines; a line is correct when it matches a truth line (IoU ≥ "
                  f"{s['iou_threshold']}) with the same normalised text. ECE {_fmt(m['ece'])}.", "",
                  "| confidence | lines | mean confidence | accuracy |", "|---|---|---|---|"]
        lines += [f"| {b['lower']:.1f}–{b['upper']:.1f} | {b['lines']} | {_fmt(b['mean_confidence'])} | "
                  f"{_fmt(b['accuracy'])} |" for b in cal["bins"] if b["lines"]]
    lines += ["", "## Worst documents", "", "| id | error | cer | line_f1 | e2e_f1 | field_exact | latency ms |",
              "|---|---|---|---|---|---|---|"]
    for score in ordered[:15]:
        lines.append(f"| {score.id} | {score.error or ''} | {_fmt(score.metric('cer'))} | "
                     f"{_fmt(score.metric('line_f1'))} | {_fmt(score.metric('e2e_f1'))} | "
                     f"{_fmt(score.metric('field_exact'))} | {_fmt(score.latency_ms, 1)} |")
    lines += ["", "Every document: documents.csv (worst first)."]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    elif plot_note:
        lines += ["", plot_note]
    return "\n".join(lines) + "\n"


def write_plots(out: Path, summary: dict[str, Any], scores: list[DocumentScore]) -> tuple[list[Path], str]:
    """reliability.png (calibration), cer.png (per-document CER), latency.png; ([], why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "Plots skipped: matplotlib is not installed (pip install 'hunyuan-ocr-service[eval]')."
    written = []
    cal = summary["calibration"]
    if cal["lines"]:
        written.append(_reliability_plot(plt, out / "reliability.png", cal["bins"], summary["metrics"]["ece"]))
    cer = [s.metric("cer") for s in scores if s.metric("cer") is not None]
    if cer:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(cer, bins=min(30, max(5, len(cer))), color="#4c72b0")
        ax.set(xlabel="CER per document", ylabel="documents", title=f"CER over {len(cer)} documents "
               f"(run CER {_fmt(summary['metrics']['cer'])})")
        written.append(_save(fig, plt, out / "cer.png"))
    latency = [s.latency_ms for s in scores if s.error is None and s.latency_ms is not None]
    if latency:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(latency, bins=min(30, max(5, len(latency))), color="#55a868")
        for q, style in ((50, "--"), (95, ":")):
            ax.axvline(float(np.percentile(latency, q)), color="black", linestyle=style, label=f"p{q}")
        ax.set(xlabel="latency per document (ms)", ylabel="documents", title="Latency")
        ax.legend()
        written.append(_save(fig, plt, out / "latency.png"))
    return written, ""


def _reliability_plot(plt, path: Path, bins: list[dict], ece: float | None) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    width = bins[0]["upper"] - bins[0]["lower"]
    centres = [b["lower"] + width / 2 for b in bins]
    accuracy = [b["accuracy"] if b["lines"] else 0.0 for b in bins]
    confidence = [b["mean_confidence"] if b["lines"] else 0.0 for b in bins]
    top.bar(centres, accuracy, width=width * 0.95, color="#4c72b0", edgecolor="black", label="accuracy")
    top.bar(centres, [c - a for c, a in zip(confidence, accuracy)], bottom=accuracy, width=width * 0.95,
            color="#dd8452", alpha=0.5, edgecolor="#dd8452", label="gap to mean confidence")
    top.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=1, label="perfect calibration")
    top.set(ylabel="fraction of lines correct", xlim=(0, 1), ylim=(0, 1),
            title=f"Reliability of line confidences (ECE {_fmt(ece)})")
    top.legend(loc="upper left", fontsize=8)
    bottom.bar(centres, [b["lines"] for b in bins], width=width * 0.95, color="#8c8c8c")
    bottom.set(xlabel="confidence", ylabel="lines")
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bins_json(binned: np.ndarray) -> list[dict[str, Any]]:
    count = len(binned)
    out = []
    for b, (lines, conf, correct) in enumerate(binned):
        out.append({"lower": round(b / count, 6), "upper": round((b + 1) / count, 6), "lines": int(lines),
                    "mean_confidence": _round(conf / lines if lines else None),
                    "accuracy": _round(correct / lines if lines else None)})
    return out


def _round(value: float | None, digits: int = 6) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return round(float(value), digits)


def _cell(value: float | None, digits: int = 6) -> str:
    if value is None:
        return ""
    return str(int(value)) if digits == 0 else f"{value:.{digits}f}".rstrip("0").rstrip(".") or "0"


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"
