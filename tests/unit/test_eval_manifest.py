"""Manifest validation: every mistake is one line naming the manifest line, never a traceback."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from service.eval.cli import main as eval_main
from service.eval.manifest import ManifestError, load_manifest


def _png(path: Path, size=(200, 100)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, "white").save(path)


def _write(tmp_path: Path, entries: list) -> Path:
    manifest = tmp_path / "set.jsonl"
    manifest.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return manifest


@pytest.fixture
def folder(tmp_path) -> Path:
    _png(tmp_path / "imgs" / "a.png")
    return tmp_path


GOOD = {"id": "a", "image": "imgs/a.png", "lines": [{"text": "TOTAL 6.00", "box": [10, 10, 190, 40]}],
        "text": "TOTAL 6.00", "fields": {"total": "6.00"}, "markdown": "TOTAL 6.00",
        "tables": ["<table><tr><td>6.00</td></tr></table>"]}


def test_good_manifest_loads(folder):
    manifest = load_manifest(_write(folder, [GOOD, "", {"id": "b", "image": "imgs/a.png"}]))
    assert [d.id for d in manifest.documents] == ["a", "b"]
    assert [d.line_no for d in manifest.documents] == [1, 3]  # blank lines are skipped, numbering kept
    page = manifest.documents[0].pages[0]
    assert page.frame == (200.0, 100.0) and page.lines[0].box == (10.0, 10.0, 190.0, 40.0)
    assert manifest.counts["fields"] == 1 and len(manifest.sha256) == 64


@pytest.mark.parametrize("entry, expected", [
    ("{not json", ":2: not valid JSON"),
    ("[1, 2]", ":2: a document must be a JSON object"),
    ({"id": "b", "image": "imgs/missing.png"}, ":2: document 'b': file imgs/missing.png not found"),
    ({"id": "b", "image": "imgs/a.png", "colour": "red"}, ":2: document 'b': unknown document key 'colour'"),
    ({"id": "b", "image": "imgs/a.png", "lines": [{"text": "x", "box": [0, 0, 10, 10], "conf": 1}]},
     "lines[0]: unknown line key 'conf'"),
    ({"id": "b", "image": "imgs/a.png", "lines": [{"text": "x", "box": [150, 10, 201, 40]}]},
     ":2: document 'b': lines[0]: box [150, 10, 201, 40] lies outside the image (200×100 px after EXIF"),
    ({"id": "b", "image": "imgs/a.png", "lines": [{"text": "x", "box": [10, 10, 5, 40]}]}, "is empty"),
    ({"id": "b", "image": "imgs/a.png", "lines": [{"text": "x", "box": [1, 2, 3]}]}, "four numbers"),
    ({"id": "b", "image": "imgs/a.png", "lines": [{"text": "x", "box": [0, 0, 9, 9]}, {"text": "y"}]},
     "lines[1] has no \"box\" while other lines have one"),
    ({"id": "b", "image": "imgs/a.png", "fields": {"total": {"v": 1}}}, "fields['total'] must be a string"),
    ({"id": "b", "image": "imgs/a.png", "tables": ["just text"]}, "\"tables\" must be a list of HTML strings"),
    ({"id": "b", "image": "imgs/a.png", "pages": [{"page": 1}]}, "\"pages\" is for PDF documents"),
    ({"id": "", "image": "imgs/a.png"}, ":2: \"id\" must be a non-empty string"),
    ({"id": "a", "image": "imgs/a.png"}, ":2: document id 'a' repeats line 1"),
])
def test_bad_manifest_lines(folder, entry, expected):
    with pytest.raises(ManifestError) as err:
        load_manifest(_write(folder, [GOOD, entry]))
    message = str(err.value)
    assert expected in message and "\n" not in message
    assert message.startswith(str(folder / "set.jsonl") + ":")


def test_boxes_are_checked_in_the_exif_oriented_frame(tmp_path):
    # stored 200×100, EXIF orientation 6: the upright image the API answers for is 100×200
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("RGB", (200, 100), "white").save(buf, format="JPEG", exif=exif.tobytes())
    (tmp_path / "r.jpg").write_bytes(buf.getvalue())
    ok = {"id": "r", "image": "r.jpg", "lines": [{"text": "x", "box": [0, 0, 90, 190]}]}
    assert load_manifest(_write(tmp_path, [ok])).documents[0].pages[0].frame == (100.0, 200.0)
    outside = {"id": "r", "image": "r.jpg", "lines": [{"text": "x", "box": [0, 0, 190, 90]}]}
    with pytest.raises(ManifestError, match="outside the image \\(100×200 px after EXIF orientation\\)"):
        load_manifest(_write(tmp_path, [outside]))


def _pdf(path: Path, pages: int = 2) -> None:
    images = [Image.new("RGB", (1240, 1754), "white") for _ in range(pages)]
    images[0].save(path, format="PDF", save_all=True, append_images=images[1:], resolution=150.0)


def test_pdf_pages_in_points(tmp_path):
    _pdf(tmp_path / "l.pdf")
    entry = {"id": "l", "image": "l.pdf", "pages": [{"page": 2, "text": "b", "lines": [
        {"text": "b", "box": [10, 10, 590, 830]}]}, {"page": 1, "text": "a"}]}
    doc = load_manifest(_write(tmp_path, [entry])).documents[0]
    assert doc.kind == "pdf" and [p.page for p in doc.pages] == [1, 2]
    assert doc.pages[1].frame == pytest.approx((595.2, 841.92))
    for bad, expected in [
        ({"id": "l", "image": "l.pdf", "text": "a"}, "a PDF's truths go in \"pages\""),
        ({"id": "l", "image": "l.pdf", "pages": [{"page": 3}]}, "\"page\" must be a page number from 1 to 2"),
        ({"id": "l", "image": "l.pdf", "pages": [{"page": 1}, {"page": 1}]}, "page 1 is labelled twice"),
        ({"id": "l", "image": "l.pdf", "pages": [{"lines": [{"text": "x", "box": [0, 0, 600, 10]}]}]},
         "lies outside the page 1 (595.2×841.92 PDF points)"),
    ]:
        with pytest.raises(ManifestError, match=":1: ") as err:
            load_manifest(_write(tmp_path, [bad]))
        assert expected in str(err.value)


def test_cli_prints_one_line_and_no_traceback(folder, capsys):
    outside = {"id": "b", "image": "imgs/a.png", "lines": [{"text": "x", "box": [0, 0, 999, 9]}]}
    manifest = _write(folder, [GOOD, outside])
    code = eval_main([str(manifest), "--url", "http://127.0.0.1:9", "--out", str(folder / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ocr-serve eval: error: ") and ":2: document 'b'" in err
    assert "Traceback" not in err
    assert not (folder / "out").exists()  # nothing was run


def test_cli_missing_manifest(tmp_path, capsys):
    assert eval_main([str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read the manifest" in err
