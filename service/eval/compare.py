"""`ocr-serve eval compare A/summary.json B/summary.json`: what changed from run A to run B, with paired bootstrap
95 % intervals, over the documents both runs scored (docs/EVAL.md, "compare").

Paired bootstrap: draw the common documents with replacement (the same draw for both runs), recompute each metric
of A and of B from the drawn documents exactly as a run does (ratios of summed counts, pooled calibration bins,
latency percentiles), and take the 2.5th and 97.5th percentiles of B − A over the draws. The draws come from
numpy's PCG64 seeded with `--seed`, so a comparison is reproducible. A difference is called a regression (or an
improvement) only when its interval excludes 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from service.eval import EvalError, metrics
from service.eval.report import DOCUMENTS_JSONL, SCHEMA_VERSION, _fmt
from service.eval.score import DocumentScore

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
DEFAULT_TOP = 10
# settings that change what a metric means: runs differing in one are not comparable
COMPARABLE_SETTINGS = ("task", "iou_threshold", "ignore_case", "ece_bins")
# the metric whose most-regressed documents head compare.md (the first one both runs measured)
HEADLINE = ("cer", "e2e_f1", "line_f1", "field_exact", "markdown_ned", "teds", "cer_order_free")


def load_run(summary_path: str | Path) -> tuple[dict[str, Any], list[DocumentScore]]:
    path = Path(summary_path)
    if path.is_dir():
        path = path / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise EvalError(f"{path}: cannot read the run's summary ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise EvalError(f"{path}: not a summary.json of ocr-serve eval ({exc})") from None
    if not isinstance(summary, dict) or summary.get("schema_version") != SCHEMA_VERSION:
        raise EvalError(f"{path}: not a summary.json of ocr-serve eval (schema_version {SCHEMA_VERSION})")
    documents = path.parent / DOCUMENTS_JSONL
    try:
        scores = [DocumentScore.from_json(json.loads(line))
                  for line in documents.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError:
        raise EvalError(f"{documents}: missing; compare needs the run's {DOCUMENTS_JSONL} beside its summary") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise EvalError(f"{documents}: unreadable ({exc})") from None
    return summary, scores


def compare_runs(a_path: str | Path, b_path: str | Path, *, resamples: int = DEFAULT_RESAMPLES,
                 seed: int = DEFAULT_SEED, top: int = DEFAULT_TOP) -> dict[str, Any]:
    summary_a, scores_a = load_run(a_path)
    summary_b, scores_b = load_run(b_path)
    hash_a, hash_b = summary_a["manifest"]["sha256"], summary_b["manifest"]["sha256"]
    if hash_a != hash_b:
        raise EvalError(f"the runs scored different labelled sets (manifest sha256 {hash_a[:12]}… and "
                        f"{hash_b[:12]}…): compare needs two runs of the same manifest and files")
    differing = [f"{k} ({summary_a['settings'].get(k)!r} vs {summary_b['settings'].get(k)!r})"
                 for k in COMPARABLE_SETTINGS if summary_a["settings"].get(k) != summary_b["settings"].get(k)]
    if differing:
        raise EvalError(f"the runs were scored differently: {', '.join(differing)}; compare runs made with the same "
                        "task and scoring options")
    by_id_b = {s.id: s for s in scores_b}
    pairs = [(a, by_id_b[a.id]) for a in scores_a
             if a.id in by_id_b and a.error is None and by_id_b[a.id].error is None]
    excluded = sorted({s.id for s in scores_a + scores_b} - {a.id for a, _ in pairs})
    if not pairs:
        raise EvalError("no document was scored in both runs (every one failed in A or in B)")
    docs_a, docs_b = [a for a, _ in pairs], [b for _, b in pairs]
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(pairs), size=(resamples, len(pairs)))
    weights = np.zeros((resamples, len(pairs)))
    np.add.at(weights, (np.arange(resamples)[:, None], draws), 1.0)
    results: dict[str, dict[str, Any]] = {}
    for name, (num, den, _) in metrics.RATIO_METRICS.items():
        na, da = _column(docs_a, num), _column(docs_a, den)
        nb, db = _column(docs_b, num), _column(docs_b, den)
        if not da.sum() or not db.sum():
            continue
        boot_a = _ratio(weights @ na, weights @ da)
        boot_b = _ratio(weights @ nb, weights @ db)
        results[name] = _difference(name, na.sum() / da.sum(), nb.sum() / db.sum(), boot_b - boot_a)
    bins = int(summary_a["settings"].get("ece_bins", metrics.DEFAULT_ECE_BINS))
    cal_a = np.stack([metrics.calibration_bins(s.calibration, bins) for s in docs_a])
    cal_b = np.stack([metrics.calibration_bins(s.calibration, bins) for s in docs_b])
    if cal_a[..., 0].sum() and cal_b[..., 0].sum():
        boot = (metrics.ece_from_bins(np.einsum("rn,nbk->rbk", weights, cal_b))
                - metrics.ece_from_bins(np.einsum("rn,nbk->rbk", weights, cal_a)))
        results["ece"] = _difference("ece", metrics.ece_from_bins(cal_a.sum(0)), metrics.ece_from_bins(cal_b.sum(0)),
                                     boot)
    lat_a = np.array([s.latency_ms if s.latency_ms is not None else np.nan for s in docs_a])
    lat_b = np.array([s.latency_ms if s.latency_ms is not None else np.nan for s in docs_b])
    if not np.isnan(lat_a).all() and not np.isnan(lat_b).all():
        for q in (50, 95):
            boot = np.nanpercentile(lat_b[draws], q, axis=1) - np.nanpercentile(lat_a[draws], q, axis=1)
            results[f"latency_p{q}_ms"] = _difference(f"latency_p{q}_ms", float(np.nanpercentile(lat_a, q)),
                                                      float(np.nanpercentile(lat_b, q)), boot)
    speed_a, speed_b = summary_a["metrics"].get("docs_per_s"), summary_b["metrics"].get("docs_per_s")
    if speed_a and speed_b:  # one number per run: no interval
        results["docs_per_s"] = {"a": speed_a, "b": speed_b, "difference": round(speed_b - speed_a, 6),
                                 "ci95": None, "better": "higher", "verdict": "not resampled (one value per run)"}
    return {
        "schema_version": SCHEMA_VERSION,
        "a": {"summary": str(a_path), "settings": summary_a["settings"], "models": summary_a.get("models", [])},
        "b": {"summary": str(b_path), "settings": summary_b["settings"], "models": summary_b.get("models", [])},
        "manifest": summary_a["manifest"],
        "documents": len(pairs),
        "excluded": {"count": len(excluded), "ids": excluded[:50],
                     "why": "missing from a run, or failed in A or B"},
        "bootstrap": {"resamples": resamples, "seed": seed, "interval": "percentile, 95 %"},
        "metrics": results,
        "most_regressed": _most_regressed(pairs, top),
    }


def _column(scores: list[DocumentScore], key: str) -> np.ndarray:
    return np.array([float(s.stats.get(key, 0.0)) for s in scores])


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)


def _difference(name: str, a: float | None, b: float | None, boot: np.ndarray) -> dict[str, Any]:
    lo, hi = (float(v) for v in np.nanpercentile(boot, [2.5, 97.5]))
    better = metrics.BETTER[name]
    if lo > 0 or hi < 0:
        worse = (lo > 0) == (better == "lower")
        verdict = "regressed" if worse else "improved"
    else:
        verdict = "no significant change"
    return {"a": _r(a), "b": _r(b), "difference": _r(b - a), "ci95": [_r(lo), _r(hi)], "better": better,
            "verdict": verdict}


def _most_regressed(pairs: list[tuple[DocumentScore, DocumentScore]], top: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for name in metrics.RATIO_METRICS:
        rows = []
        for a, b in pairs:
            va, vb = a.metric(name), b.metric(name)
            if va is None or vb is None:
                continue
            worse_by = (vb - va) if metrics.BETTER[name] == "lower" else (va - vb)
            if worse_by > 0:
                rows.append({"id": a.id, "a": _r(va), "b": _r(vb), "difference": _r(vb - va), "_worse": worse_by})
        rows.sort(key=lambda r: (-r["_worse"], r["id"]))
        if rows:
            out[name] = [{k: v for k, v in r.items() if k != "_worse"} for r in rows[:top]]
    return out


def render_compare(result: dict[str, Any]) -> str:
    boot = result["bootstrap"]
    lines = ["# Comparison of two eval runs", "",
             f"A: `{result['a']['summary']}` ({', '.join(result['a']['models']) or 'unknown model'}); "
             f"B: `{result['b']['summary']}` ({', '.join(result['b']['models']) or 'unknown model'}).",
             f"Manifest `{result['manifest']['path']}` (sha256 `{result['manifest']['sha256'][:16]}…`); "
             f"{result['documents']} documents scored in both runs"
             + (f", {result['excluded']['count']} left out ({result['excluded']['why']})"
                if result["excluded"]["count"] else "") + ".",
             f"Intervals: paired bootstrap over documents, {boot['resamples']} resamples, seed {boot['seed']}, "
             "95 % percentile interval of B − A.", "",
             "| metric | A | B | B − A | 95 % interval | verdict |", "|---|---|---|---|---|---|"]
    for name, r in result["metrics"].items():
        arrow = "↓" if r["better"] == "lower" else "↑"
        digits = 1 if name.endswith("_ms") else 4
        ci = "–" if r["ci95"] is None else f"[{_signed(r['ci95'][0], digits)}, {_signed(r['ci95'][1], digits)}]"
        lines.append(f"| {name} {arrow} | {_fmt(r['a'], digits)} | {_fmt(r['b'], digits)} | "
                     f"{_signed(r['difference'], digits)} | {ci} | {r['verdict']} |")
    regressed = result["most_regressed"]
    # the first headline metric that regressed significantly, else the first with any regressed document
    significant = [n for n in HEADLINE if n in regressed and result["metrics"].get(n, {}).get("verdict") == "regressed"]
    headline = next(iter(significant), None) or next((name for name in HEADLINE if name in regressed), None)
    if headline:
        lines += ["", f"## Documents that regressed most ({headline})", "", "| id | A | B | B − A |",
                  "|---|---|---|---|"]
        lines += [f"| {r['id']} | {_fmt(r['a'])} | {_fmt(r['b'])} | {_signed(r['difference'])} |"
                  for r in regressed[headline]]
        others = [name for name in regressed if name != headline]
        if others:
            lines += ["", f"Other metrics' regressed documents are in compare.json (`most_regressed`): "
                      f"{', '.join(others)}."]
    else:
        lines += ["", "No document regressed on any metric."]
    return "\n".join(lines) + "\n"


def write_compare(out: Path, result: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "compare.json", out / "compare.md"
    json_path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md_path.write_text(render_compare(result), encoding="utf-8")
    return [json_path, md_path]


def _signed(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def _r(value: float | None) -> float | None:
    return None if value is None or np.isnan(value) else round(float(value), 6)
