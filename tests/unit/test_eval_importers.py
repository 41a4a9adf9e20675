"""`ocr-serve eval import` (FUNSD, ICDAR) on small annotation files written here, and `ocr-serve eval sample`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image, ImageOps

from service.eval import EvalError, sample
from service.eval.cli import main as eval_main
from service.eval.importers import import_dataset
from service.eval.manifest import load_manifest


def _funsd(root: Path) -> None:
    (root / "annotations").mkdir(parents=True)
    (root / "images").mkdir()
    Image.new("RGB", (300, 200), "white").save(root / "images" / "0001.png")
    form = {"form": [
        {"id": 0, "text": "DATE:", "box": [10, 10, 60, 25], "label": "question", "linking": [[0, 1]],
         "words": [{"text": "DATE:", "box": [10, 10, 60, 25]}]},
        {"id": 1, "text": "12/03/98", "box": [70, 10, 140, 25], "label": "answer", "linking": [[0, 1]],
         "words": [{"text": "12/03/98", "box": [70, 10, 140, 25]}]},
        {"id": 2, "text": "", "box": [5, 100, 15, 110], "label": "other", "linking": [], "words": []},  # checkbox
        {"id": 3, "text": "TO: R. Smith", "box": [10, 40, 320, 60], "label": "question", "linking": [],
         "words": [{"text": "TO:", "box": [10, 40, 30, 60]}, {"text": "R. Smith", "box": [35, 40, 320, 60]}]},
    ]}
    (root / "annotations" / "0001.json").write_text(json.dumps(form))


def test_funsd_entities_become_lines(tmp_path, capsys):
    _funsd(tmp_path / "funsd")
    out = tmp_path / "sets" / "funsd.jsonl"
    assert eval_main(["import", "funsd", str(tmp_path / "funsd"), str(out)]) == 0
    assert "1 documents, 3 lines (1 without text or area skipped)" in capsys.readouterr().out
    entry = json.loads(out.read_text())
    assert entry == {"id": "0001", "image": "../funsd/images/0001.png", "lines": [
        {"text": "DATE:", "box": [10, 10, 60, 25]}, {"text": "12/03/98", "box": [70, 10, 140, 25]},
        {"text": "TO: R. Smith", "box": [10, 40, 300, 60]}]}  # clamped to the 300 px wide image
    assert load_manifest(out).documents[0].pages[0].lines[2].text == "TO: R. Smith"


def test_icdar_quads_to_boxes_and_dont_care(tmp_path):
    gt = tmp_path / "gt"
    gt.mkdir()
    Image.new("RGB", (400, 300), "white").save(gt / "img_1.jpg")
    (gt / "gt_img_1.txt").write_text(
        "\ufeff377,117,463,117,465,130,378,130,Genaxis Theatre\n"  # BOM as in ICDAR 2015; x beyond the image
        "10,20,60,15,62,40,12,44,Total, 6.00\n"  # a transcription with a comma; a tilted quad
        "100,100,150,100,150,120,100,120,###\n", encoding="utf-8")
    out = tmp_path / "icdar.jsonl"
    counts = import_dataset("icdar", gt, out)
    assert counts == {"documents": 1, "lines": 2, "skipped": 0}
    entry = json.loads(out.read_text())
    assert entry["id"] == "img_1" and entry["image"] == "gt/img_1.jpg"
    assert entry["lines"] == [
        {"text": "Genaxis Theatre", "box": [377, 117, 400, 130]},
        {"text": "Total, 6.00", "box": [10, 15, 62, 44]},
        {"text": "###", "box": [100, 100, 150, 120], "ignore": True}]
    page = load_manifest(out).documents[0].pages[0]
    assert page.reading_text() == "Genaxis Theatre\nTotal, 6.00"  # don't-care regions are not text truth


def test_import_errors_are_one_line(tmp_path, capsys):
    gt = tmp_path / "gt"
    gt.mkdir()
    Image.new("RGB", (40, 30), "white").save(gt / "img_2.png")
    (gt / "gt_img_2.txt").write_text("1,2,3,4,Total\n")
    assert eval_main(["import", "icdar", str(gt), str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gt_img_2.txt:1: expected x1,y1,x2,y2,x3,y3,x4,y4,transcription" in err
    (gt / "gt_img_2.txt").rename(gt / "gt_img_3.txt")
    with pytest.raises(EvalError, match="no image img_3.png/.jpg"):
        import_dataset("icdar", gt, tmp_path / "o.jsonl")
    with pytest.raises(EvalError, match="not a FUNSD annotation"):
        (tmp_path / "bad.json").write_text('{"lines": []}')
        import_dataset("funsd", tmp_path / "bad.json", tmp_path / "o.jsonl")


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_sample_set_is_deterministic_and_its_truths_are_valid(tmp_path):
    first = sample.write_sample(tmp_path / "one", 6, seed=3)
    sample.write_sample(tmp_path / "two", 6, seed=3)
    assert _digest(tmp_path / "one") == _digest(tmp_path / "two")  # same seed, same bytes (PDFs included)
    sample.write_sample(tmp_path / "other", 6, seed=4)
    assert _digest(tmp_path / "other") != _digest(tmp_path / "one")
    manifest = load_manifest(first)  # every box lies inside its frame
    kinds = [(d.id.split("-")[0], d.id.split("-")[1], d.kind) for d in manifest.documents]
    assert kinds == [("receipt", "en", "image"), ("id_card", "en", "image"), ("letter", "en", "pdf"),
                     ("receipt", "zh", "image"), ("id_card", "zh", "image"), ("letter", "zh", "pdf")]
    receipt, card = manifest.documents[3], manifest.documents[4]
    assert set(receipt.pages[0].fields) == {"merchant", "date", "total"} and receipt.pages[0].tables
    assert set(card.pages[0].fields) == {"name", "id_number", "date_of_birth", "address", "expiry_date"}
    assert manifest.documents[2].pages[0].markdown.startswith("Dear ")


def test_sample_boxes_hold_their_text_in_the_upright_image(tmp_path):
    manifest = load_manifest(sample.write_sample(tmp_path, 2, seed=0))
    card = manifest.documents[1]  # odd index: stored rotated, EXIF orientation 6
    with Image.open(card.path) as stored:
        assert stored.getexif().get(0x0112) == 6 and stored.size == (630, 1000)
        upright = ImageOps.exif_transpose(stored).convert("L")
    assert upright.size == (1000, 630) == card.pages[0].frame
    for line in card.pages[0].lines:
        x1, y1, x2, y2 = (int(v) for v in line.box)
        assert upright.crop((x1, y1, x2, y2)).getextrema()[0] < 100  # dark ink inside the box
        # and the one-pixel frame around it is background: the box is the ink's
        ring = [upright.crop((x1 - 2, y1 - 2, x2 + 2, y1 - 1)), upright.crop((x1 - 2, y2 + 1, x2 + 2, y2 + 2))]
        assert all(part.getextrema()[0] > 150 for part in ring)


def test_sample_refuses_chinese_without_a_cjk_font(tmp_path, monkeypatch):
    monkeypatch.setattr(sample, "font_file", lambda: sample.FONT_CANDIDATES[1])
    with pytest.raises(EvalError, match="need the font .*wqy-microhei"):
        sample.write_sample(tmp_path, 4, seed=0)
    assert load_manifest(sample.write_sample(tmp_path, 3, seed=0, lang="en")).documents
