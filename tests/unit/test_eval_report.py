"""Run outputs (summary.json schema, documents.csv worst first, report.md, plots) and `compare`'s paired bootstrap."""

from __future__ import annotations

import builtins
import csv
import json
from pathlib import Path

import numpy as np
import pytest

from service.eval import EvalError, metrics
from service.eval.cli import main as eval_main
from service.eval.compare import compare_runs
from service.eval.report import summarise, write_outputs
from service.eval.score import DocumentScore

SETTINGS = {"url": "http://svc", "task": "spotting", "adapter": None, "iou_threshold": 0.5, "ignore_case": False,
            "ece_bins": 10}


def _score(doc_id: str, edits: int, chars: int = 10, matched: int = 4, latency: float = 100.0,
           error: str | None = None, calibration=((0.9, 1),)) -> DocumentScore:
    stats = {"char_edits": edits, "chars": chars, "truth_lines": 5, "pred_lines": 5, "truth_pred_lines": 10,
             "matched": matched, "matched2": 2 * matched, "e2e_matched": matched, "e2e_matched2": 2 * matched,
             "iou_sum": 0.8 * matched}
    return DocumentScore(doc_id, line=1, pages=1, error=error, latency_ms=latency, stats={} if error else stats,
                         calibration=[] if error else list(calibration), model="m")


def _write_run(folder: Path, scores, sha="a" * 64, settings=None) -> Path:
    summary = summarise(scores, wall_s=2.0, settings=settings or SETTINGS, ece_bins=10,
                        manifest={"path": "m.jsonl", "sha256": sha, "documents": len(scores)})
    write_outputs(folder, summary, scores)
    return folder / "summary.json"


def test_summary_schema_and_values(tmp_path):
    scores = [_score("a", 1), _score("b", 3, calibration=[(0.9, 0), (0.2, 0)]), _score("c", 0, error="504 timeout")]
    summary = json.loads(_write_run(tmp_path, scores).read_text())
    assert set(summary) >= {"schema_version", "documents", "errors", "metrics", "settings", "manifest",
                            "calibration", "coverage", "per_field"}
    assert list(summary["metrics"]) == list(metrics.METRIC_NAMES)  # every key, null when not measured
    m = summary["metrics"]
    assert (summary["documents"], summary["errors"]) == (3, 1)
    assert m["cer"] == pytest.approx(4 / 20)  # Σ edits / Σ chars over the scored documents
    assert m["line_f1"] == pytest.approx(0.8) and m["mean_iou"] == pytest.approx(0.8)
    assert m["field_exact"] is None and m["teds"] is None
    # lines (0.9, 1), (0.9, 0), (0.2, 0): bins 9 → |1 − 1.8|, bin 2 → |0 − 0.2|; / 3
    assert m["ece"] == pytest.approx(1.0 / 3)
    assert m["docs_per_s"] == 1.0 and m["latency_p50_ms"] == 100.0
    assert summary["calibration"]["lines"] == 3 and summary["coverage"]["cer"] == 2


def test_documents_csv_worst_first_and_report(tmp_path):
    scores = [_score("good", 0), _score("bad", 5), _score("failed", 0, error="504 timeout"), _score("mid", 2)]
    _write_run(tmp_path, scores)
    rows = list(csv.DictReader((tmp_path / "documents.csv").open()))
    assert [r["id"] for r in rows] == ["failed", "bad", "mid", "good"]
    assert rows[0]["error"] == "504 timeout" and rows[1]["cer"] == "0.5"
    report = (tmp_path / "report.md").read_text()
    assert "| cer ↓ | 0.2333 | 3 |" in report and "| bad |  | 0.5000 |" in report
    assert (tmp_path / "reliability.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "cer.png").exists() and (tmp_path / "latency.png").exists()


def test_without_matplotlib_the_report_says_so(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    _write_run(tmp_path, [_score("a", 1)])
    assert not list(tmp_path.glob("*.png"))
    assert "Plots skipped: matplotlib is not installed" in (tmp_path / "report.md").read_text()


def test_compare_detects_a_regression_with_an_interval_excluding_zero(tmp_path):
    a = [_score(f"d{i}", edits=i % 3, matched=5) for i in range(20)]
    b = [_score(f"d{i}", edits=i % 3 + 2, matched=3, latency=100.0 + i) for i in range(20)]
    result = compare_runs(_write_run(tmp_path / "a", a), _write_run(tmp_path / "b", b), resamples=500, seed=1)
    cer, f1 = result["metrics"]["cer"], result["metrics"]["line_f1"]
    assert cer["difference"] == pytest.approx(0.2) and cer["ci95"][0] > 0 and cer["verdict"] == "regressed"
    assert f1["difference"] == pytest.approx(-0.4) and f1["ci95"][1] < 0 and f1["verdict"] == "regressed"
    assert result["most_regressed"]["cer"][0]["difference"] == pytest.approx(0.2)
    assert result["bootstrap"] == {"resamples": 500, "seed": 1, "interval": "percentile, 95 %"}
    # the same seed gives the same intervals
    again = compare_runs(tmp_path / "a" / "summary.json", tmp_path / "b" / "summary.json", resamples=500, seed=1)
    assert again["metrics"] == result["metrics"]


def test_bootstrap_matches_a_plain_resampling_loop(tmp_path):
    rng = np.random.default_rng(7)
    a = [_score(f"d{i}", edits=int(rng.integers(0, 5)), chars=int(rng.integers(5, 30))) for i in range(15)]
    b = [_score(s.id, edits=int(rng.integers(0, 5)), chars=int(s.stats["chars"])) for s in a]
    result = compare_runs(_write_run(tmp_path / "a", a), _write_run(tmp_path / "b", b), resamples=300, seed=3)
    draws = np.random.default_rng(3).integers(0, 15, size=(300, 15))
    diffs = []
    for row in draws:
        cer_a = sum(a[i].stats["char_edits"] for i in row) / sum(a[i].stats["chars"] for i in row)
        cer_b = sum(b[i].stats["char_edits"] for i in row) / sum(b[i].stats["chars"] for i in row)
        diffs.append(cer_b - cer_a)
    assert result["metrics"]["cer"]["ci95"] == pytest.approx(list(np.percentile(diffs, [2.5, 97.5])), abs=1e-6)


def test_identical_runs_show_no_change_and_failed_documents_are_left_out(tmp_path):
    a = [_score(f"d{i}", edits=i % 4) for i in range(8)]
    b = [_score(f"d{i}", edits=i % 4, error="504 timeout" if i == 0 else None) for i in range(8)]
    result = compare_runs(_write_run(tmp_path / "a", a), _write_run(tmp_path / "b", b), resamples=200)
    assert result["documents"] == 7 and result["excluded"]["ids"] == ["d0"]
    assert result["metrics"]["cer"]["ci95"] == [0.0, 0.0]
    assert result["metrics"]["cer"]["verdict"] == "no significant change"


def test_compare_refuses_runs_of_different_manifests_or_scoring(tmp_path, capsys):
    a = _write_run(tmp_path / "a", [_score("d", 1)])
    b = _write_run(tmp_path / "b", [_score("d", 1)], sha="b" * 64)
    with pytest.raises(EvalError, match="different labelled sets"):
        compare_runs(a, b)
    c = _write_run(tmp_path / "c", [_score("d", 1)], settings=SETTINGS | {"iou_threshold": 0.7})
    with pytest.raises(EvalError, match=r"iou_threshold \(0.5 vs 0.7\)"):
        compare_runs(a, c)
    assert eval_main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_compare_cli_writes_json_and_markdown(tmp_path, capsys):
    a = _write_run(tmp_path / "a", [_score(f"d{i}", 0) for i in range(5)])
    b = _write_run(tmp_path / "b", [_score(f"d{i}", 3) for i in range(5)])
    assert eval_main(["compare", str(a), str(b.parent), "--out", str(tmp_path / "cmp"), "--resamples", "100"]) == 0
    out = capsys.readouterr().out
    assert "| cer ↓ | 0.0000 | 0.3000 | +0.3000 | [+0.3000, +0.3000] | regressed |" in out
    assert "## Documents that regressed most (cer)" in out
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["metrics"]["cer"]["verdict"] == "regressed"
    assert (tmp_path / "cmp" / "compare.md").read_text() in out
