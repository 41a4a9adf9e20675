"""`ocr-serve eval` metrics against values computed by hand (docs/EVAL.md has the worked example)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.eval import metrics
from service.eval.metrics import Line
from service.eval.score import ScoreSettings, score_document
from service.eval.client import DocumentOutcome, PageOutcome
from service.eval.manifest import ManifestDocument, PageTruth, TruthLine


def test_normalise_nfkc_whitespace_and_case():
    # fullwidth → ASCII, every whitespace run → one space
    assert metrics.normalise("  Ｔｏｔａｌ\u3000 6.00\n\tEUR ") == "Total 6.00 EUR"
    assert metrics.normalise("ﬁle：１") == "file:1"  # ligature and fullwidth colon/digit (NFKC)
    assert metrics.normalise("Straße ABC") == "Straße ABC"
    assert metrics.normalise("Straße ABC", ignore_case=True) == "strasse abc"  # case folding, not lower()


def test_words_split_cjk_per_character():
    assert metrics.words("发票 total 12.5") == ["发", "票", "total", "12.5"]
    assert metrics.words("合计53.45") == ["合", "计", "53.45"]


def test_cer_and_wer_counts():
    stats = metrics.text_stats("kitten", "sitting")
    assert (stats["char_edits"], stats["chars"]) == (3, 6)  # k→s, e→i, +g
    assert metrics.ratio(stats, "cer") == 0.5
    stats = metrics.text_stats("the cat sat", "the bat sat on")
    assert (stats["word_edits"], stats["words"]) == (2, 3)  # cat→bat, +on
    assert metrics.ratio(stats, "wer") == pytest.approx(2 / 3)
    assert metrics.text_stats("", "abc")["char_edits"] == 3  # insertions on an empty truth still count
    assert metrics.ratio(metrics.text_stats("", "abc"), "cer") is None  # but a per-document CER is undefined


def test_order_free_cer_pairs_lines_optimally():
    # reading order swapped: in order it costs a lot, line by line only abc→abd
    assert metrics.text_stats("abc xyz", "xyz abd")["char_edits"] == 6
    assert metrics.order_free_stats(["abc", "xyz"], ["xyz", "abd"]) == {"line_char_edits": 1, "line_chars": 6}
    # an unpaired truth line is deleted, an unpaired prediction inserted
    assert metrics.order_free_stats(["abc", "de"], ["abc"]) == {"line_char_edits": 2, "line_chars": 5}
    assert metrics.order_free_stats(["abc"], ["abc", "zz"]) == {"line_char_edits": 2, "line_chars": 3}
    assert metrics.order_free_stats([], ["zz"]) == {"line_char_edits": 2, "line_chars": 0}


def test_iou_matrix():
    iou = metrics.iou_matrix([[0, 0, 10, 10]], [[5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 10, 10]])
    assert iou.tolist() == [[pytest.approx(1 / 3), 0.0, 1.0]]  # 50 / (100 + 100 - 50)


def test_matching_maximises_pairs_where_greedy_would_not():
    # greedy by IoU takes A-P (0.9) and leaves B and Q unmatched; the optimal matching pairs both
    iou = np.array([[0.9, 0.6], [0.6, 0.0]])
    assert sorted(metrics.match_pairs(iou, iou >= 0.5)) == [(0, 1), (1, 0)]
    # more pairs beat a larger IoU sum: 0.35 + 0.35 < 0.95, still two matches at threshold 0.3
    iou = np.array([[0.95, 0.35], [0.35, 0.0]])
    assert sorted(metrics.match_pairs(iou, iou >= 0.3)) == [(0, 1), (1, 0)]
    # with equal counts possible, the larger IoU sum wins
    iou = np.array([[0.9, 0.6], [0.6, 0.8]])
    assert sorted(metrics.match_pairs(iou, iou >= 0.5)) == [(0, 0), (1, 1)]


def test_line_stats_detection_end_to_end_and_calibration():
    truth = [Line("Invoice", (0, 0, 100, 20)), Line("Total", (0, 40, 100, 60)), Line("Missed", (0, 80, 100, 100))]
    predicted = [
        Line("Invoice", (0, 0, 100, 20), confidence=0.99),     # exact box and text
        Line("Tota1", (10, 40, 110, 60), confidence=0.90),     # IoU 1800/2200, wrong text
        Line("Noise", (300, 300, 350, 320), confidence=0.40),  # false detection
    ]
    result = metrics.line_stats(truth, predicted, 0.5)
    s = result.stats
    assert (s["truth_lines"], s["pred_lines"], s["matched"], s["e2e_matched"]) == (3, 3, 2, 1)
    assert metrics.ratio(s, "line_precision") == metrics.ratio(s, "line_recall") == pytest.approx(2 / 3)
    assert metrics.ratio(s, "line_f1") == pytest.approx(2 / 3)
    assert metrics.ratio(s, "e2e_f1") == pytest.approx(1 / 3)
    assert metrics.ratio(s, "mean_iou") == pytest.approx((1 + 1800 / 2200) / 2)
    assert result.calibration == [(0.99, 1), (0.90, 0), (0.40, 0)]
    # a stricter threshold turns the shifted box into a miss and a false detection
    assert metrics.line_stats(truth, predicted, 0.9).stats["matched"] == 1


def test_end_to_end_matching_is_its_own_one_to_one_matching():
    # detection pairs T0-P1 and T1-P0 (more IoU); end-to-end may still pair T0 with P0, the same text
    truth = [Line("a", (0, 0, 100, 20)), Line("b", (0, 4, 100, 24))]
    predicted = [Line("a", (0, 3, 100, 23), confidence=0.5), Line("x", (0, 1, 100, 21), confidence=0.5)]
    stats = metrics.line_stats(truth, predicted, 0.5).stats
    assert stats["matched"] == 2 and stats["e2e_matched"] == 1


def test_dont_care_regions_are_neither_missed_nor_false():
    truth = [Line("Total", (0, 0, 100, 20)), Line("###", (0, 100, 100, 120), ignore=True)]
    predicted = [Line("Total", (0, 0, 100, 20), confidence=0.9),
                 Line("blur", (10, 100, 90, 120), confidence=0.3)]  # wholly inside the don't-care box
    result = metrics.line_stats(truth, predicted, 0.5)
    assert (result.stats["truth_lines"], result.stats["pred_lines"], result.stats["matched"]) == (1, 1, 1)
    assert result.calibration == [(0.9, 1)]


def test_ece_equal_width_bins():
    pairs = [(0.95, 1), (0.95, 0), (0.15, 0), (0.05, 0)]
    binned = metrics.calibration_bins(pairs, 10)
    assert binned[9].tolist() == [2, pytest.approx(1.9), 1]
    # (|1 − 1.9| + |0 − 0.15| + |0 − 0.05|) / 4
    assert metrics.ece_from_bins(binned) == pytest.approx(0.275)
    assert metrics.calibration_bins([(1.0, 1)], 10)[9][0] == 1  # 1.0 falls in the last bin
    assert metrics.ece_from_bins(metrics.calibration_bins([], 10)) is None
    perfectly = [(0.75, 1)] * 3 + [(0.75, 0)]
    assert metrics.ece_from_bins(metrics.calibration_bins(perfectly, 10)) == pytest.approx(0.0)


def test_fields_exact_and_similarity():
    counts, detail = metrics.field_stats({"total": "6.00", "name": "Alice", "date": None},
                                         {"total": 6.0, "name": "alice"}, ignore_case=False)
    assert detail["total"] == {"exact": 0, "similarity": pytest.approx(0.75)}  # "6.00" vs "6.0"
    assert detail["name"] == {"exact": 0, "similarity": pytest.approx(0.8)}
    assert detail["date"] == {"exact": 1, "similarity": 1.0}  # null vs missing: both empty
    assert counts == {"field_exact": 1, "field_similarity": pytest.approx(2.55), "fields": 3}
    _, detail = metrics.field_stats({"name": "Alice"}, {"name": "ALICE"}, ignore_case=True)
    assert detail["name"]["exact"] == 1


def test_json_validity():
    assert metrics.json_object_stats('{"a": 1}', []) == {"json_valid": 1, "schema_valid": 1, "extractions": 1}
    assert metrics.json_object_stats('{"a": 1}', ["b: missing"])["schema_valid"] == 0
    assert metrics.json_object_stats("no json here", ["the model output holds no JSON object"])["json_valid"] == 0
    assert metrics.json_object_stats("[1, 2]", [])["json_valid"] == 0  # JSON, but not an object


def test_markdown_ned():
    assert metrics.markdown_stats("# Title", "# Titel")["markdown_ned"] == pytest.approx(2 / 7)
    assert metrics.markdown_stats("", "")["markdown_ned"] == 0.0


TABLE = "<table><tr><td>a</td><td>b</td></tr></table>"


def test_teds_known_values():
    assert metrics.teds(TABLE, TABLE) == 1.0  # bare fragments are wrapped (the implementation wants html/body)
    assert metrics.teds(TABLE, "<table><tr><th>a</th><th>b</th></tr></table>") == 1.0  # th counts as td
    # table, tr, td, td: one cell's text fully renamed costs 1 of 4 nodes
    assert metrics.teds(TABLE, "<table><tr><td>a</td><td>c</td></tr></table>") == pytest.approx(0.75)
    assert metrics.teds(TABLE, '<table><tr><td colspan="x">a</td></tr></table>') == 0.0  # unparsable: no credit
    assert metrics.find_tables(f"# Doc\n\n{TABLE}\n\ntext <TABLE><tr><td>z</td></tr></TABLE>") == [
        TABLE, "<TABLE><tr><td>z</td></tr></TABLE>"]


def test_table_pairing_and_missing_tables():
    other = "<table><tr><td>x</td></tr></table>"
    assert metrics.table_stats([TABLE, other], [other]) == {"teds_sum": 1.0, "table_slots": 2}
    assert metrics.table_stats([TABLE], []) == {"teds_sum": 0.0, "table_slots": 1}
    assert metrics.table_stats([TABLE], [TABLE, other])["table_slots"] == 2  # an extra table costs a slot


def test_run_value_is_ratio_of_sums_not_mean_of_ratios():
    total: dict = {}
    metrics.add_stats(total, metrics.text_stats("ab", "xb"))  # CER 1/2
    metrics.add_stats(total, metrics.text_stats("abcdefgh", "abcdefgh"))  # CER 0/8
    assert metrics.ratio(total, "cer") == pytest.approx(1 / 10)


def _doc(pages, kind="image"):
    return ManifestDocument("d", path=None, line_no=1, kind=kind, pages=pages)


def test_pdf_page_boxes_are_compared_in_points():
    # a page of 595.2×841.92 points the service rendered at 1240×1754 px: px × 0.48 = points
    truth = PageTruth(1, (595.2, 841.92), lines=[TruthLine("Total", (48.0, 48.0, 96.0, 57.6))])
    result = {"text": "Total", "image": {"width": 1240, "height": 1754},
              "lines": [{"text": "Total", "box": [100, 100, 200, 120], "confidence": 0.9}]}
    outcome = DocumentOutcome("d", [PageOutcome(1, result)], latency_ms=5.0)
    score = score_document(_doc([truth], "pdf"), outcome, ScoreSettings("spotting"))
    assert score.metric("e2e_f1") == 1.0
    assert score.metric("mean_iou") == pytest.approx(1.0, abs=1e-3)
    assert score.metric("cer") == 0.0


def test_task_decides_what_is_scored():
    truth = PageTruth(1, (100, 100), text="Hello", markdown="# Hello", fields={"greeting": "Hello"},
                      tables=[TABLE])
    spotting = {"text": "Hallo", "lines": [], "image": {"width": 100, "height": 100}}
    score = score_document(_doc([truth]), DocumentOutcome("d", [PageOutcome(1, spotting)]), ScoreSettings("spotting"))
    assert score.metric("cer") == pytest.approx(0.2) and score.metric("markdown_ned") is None
    assert score.metric("field_exact") is None and score.metric("teds") is None
    document = {"text": f"# Hello\n\n{TABLE}", "image": {"width": 100, "height": 100}}
    score = score_document(_doc([truth]), DocumentOutcome("d", [PageOutcome(1, document)]), ScoreSettings("document"))
    assert score.metric("teds") == 1.0 and score.metric("cer") is None
    assert score.metric("markdown_ned") == pytest.approx(1 - metrics.similarity("# Hello", f"# Hello {TABLE}"))
    extract = {"text": '{"greeting": "Hello"}', "errors": [], "fields": {"greeting": {"value": "Hello"}},
               "image": {"width": 100, "height": 100}}
    score = score_document(_doc([truth]), DocumentOutcome("d", [PageOutcome(1, extract)]), ScoreSettings("extract"))
    assert (score.metric("field_exact"), score.metric("json_valid"), score.metric("schema_valid")) == (1.0, 1.0, 1.0)
    assert score.fields == {"greeting": {"exact": 1, "similarity": 1.0, "count": 1}}


def test_failed_document_has_no_metrics():
    truth = PageTruth(1, (100, 100), text="Hello")
    score = score_document(_doc([truth]), DocumentOutcome("d", error="503 overloaded: busy"), ScoreSettings("text"))
    assert score.error and score.metric("cer") is None and not math.isnan(score.retries)


def test_worked_example_of_docs_eval_md():
    truth = PageTruth(1, (300, 300), lines=[TruthLine("TOTAL 6.00", (10, 10, 110, 30)),
                                            TruthLine("Coffee", (10, 40, 70, 60))])
    result = {"text": "TOTAL 6.0O\nCoffee\nx", "image": {"width": 300, "height": 300}, "lines": [
        {"text": "TOTAL 6.0O", "box": [12, 10, 110, 32], "confidence": 0.98},
        {"text": "Coffee", "box": [10, 41, 70, 60], "confidence": 0.95},
        {"text": "x", "box": [200, 200, 210, 210], "confidence": 0.30}]}
    score = score_document(_doc([truth]), DocumentOutcome("d", [PageOutcome(1, result)]), ScoreSettings("spotting"))
    assert score.metric("cer") == pytest.approx(3 / 17) and score.metric("wer") == pytest.approx(2 / 3)
    assert score.metric("cer_order_free") == pytest.approx(0.125)
    assert (score.metric("line_precision"), score.metric("line_recall")) == (pytest.approx(2 / 3), 1.0)
    assert score.metric("line_f1") == pytest.approx(0.8) and score.metric("e2e_f1") == pytest.approx(0.4)
    assert score.metric("mean_iou") == pytest.approx((1960 / 2196 + 0.95) / 2)
    assert metrics.ece_from_bins(metrics.calibration_bins(score.calibration)) == pytest.approx(0.41)
