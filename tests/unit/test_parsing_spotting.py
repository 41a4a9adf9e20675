"""Spotting/layout parser over a generated corpus: random line sets rendered in every HunyuanOCR format (plus
truncations, unicode, Chinese, parentheses in text) → exact text round-trip and ≤ 1 px box error after mapping
0-1000 coordinates to pixels of the uploaded image. Every case must pass."""

from __future__ import annotations

import json
import random

import pytest

from service.engine.protocol import EngineResult
from service.parsing.page import PageGeometry
from service.parsing.spotting import IncrementalSpotting, parse_spotting
from service.parsing.vlm import parse_vlm_output

WORDS = ["Invoice", "total", "amount", "Room 101", "1,234.56", "EUR", "No.", "ACME Corp.", "x > y", "a<b", "50%",
         "e-mail: a@b.c", "#42", "it's", 'say "hi"', "back\\slash", "tab\there"]
CHINESE = ["发票号码", "合同编号", "金额", "甲乙丙丁", "二零二六年", "上车时间", "里程数", "总金额：", "，", "。"]
UNICODE = ["Ünïcødé", "naïve café", "Ελληνικά", "русский", "العربية", "日本語テキスト", "한국어", "😀", "e\u0301", "ß"]
PARENS = ["(AP)", "(小写)", "f(x)", "(12)", "(1,2)", "(a, b)", "((nested))", "(", ")", ":)", "[1]", "{k}",
          "（全角）", "ATLANTA (AP) —", "(1)(2)"]
FORMATS = ["ref_quad", "quad_ref", "quad_pos", "bare", "json", "bare_quad_first"]
TRUNCATABLE = ["ref_quad", "quad_ref", "quad_pos", "bare", "json"]


def random_text(rng: random.Random) -> str:
    pools = [WORDS, CHINESE, UNICODE, PARENS]
    parts = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 5))]
    text = "".join(p if rng.random() < 0.3 else p + " " for p in parts).strip()
    return text or "x"


def random_lines(rng: random.Random, width: int, height: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    """Lines with pixel boxes in the uploaded image (sides ≥ 4 px and ≥ 10 units of 0-1000)."""
    lines = []
    min_w, min_h = max(4, width // 100), max(4, height // 100)
    for _ in range(rng.randint(1, 12)):
        x1 = rng.randint(0, width - min_w)
        y1 = rng.randint(0, height - min_h)
        x2 = rng.randint(x1 + min_w, min(width, x1 + min_w + width // 2))
        y2 = rng.randint(y1 + min_h, min(height, y1 + min_h + height // 8))
        lines.append((random_text(rng), (x1, y1, x2, y2)))
    return lines


def normalised(box, width, height) -> tuple[int, int, int, int]:
    """What a perfect HunyuanOCR writes: 0-1000 of the image."""
    x1, y1, x2, y2 = box
    return (round(x1 / width * 1000), round(y1 / height * 1000), round(x2 / width * 1000), round(y2 / height * 1000))


def render_item(fmt: str, text: str, n: tuple[int, int, int, int], rng: random.Random) -> str:
    x1, y1, x2, y2 = n
    quad = f"({x1},{y1}),({x2},{y2})"
    if fmt == "ref_quad":
        return f"<ref>{text}</ref><quad>{quad}</quad>"
    if fmt == "quad_ref":
        return f"<quad>{quad}</quad><ref>{text}</ref>"
    if fmt == "quad_pos":
        return f"<quad><pos_{x1}><pos_{y1}><pos_{x2}><pos_{y2}></quad><ref>{text}</ref>"
    if fmt == "bare":
        return f"{text}{quad}"
    if fmt == "bare_quad_first":
        return f"{quad}{text}"
    raise ValueError(fmt)


def render(fmt: str, items: list[tuple[str, tuple]], rng: random.Random) -> tuple[str, list[int]]:
    """The raw output and the end offset of every item in it."""
    if fmt == "json":
        ascii_only = rng.random() < 0.5
        head = "```json\n[" if rng.random() < 0.3 else "["
        out, ends = head, []
        for i, (text, n) in enumerate(items):
            sep = "" if i == 0 else rng.choice([",", ", ", ",\n  "])
            out += sep + json.dumps({"box": list(n), "text": text}, ensure_ascii=ascii_only)
            ends.append(len(out))
        out += "]" + ("\n```" if head.startswith("```") else "")
        return out, ends
    out, ends = "", []
    separator = rng.choice(["", "\n"]) if fmt not in ("bare_quad_first",) else ""
    for i, (text, n) in enumerate(items):
        out += (separator if i else "") + render_item(fmt, text, n, rng)
        ends.append(len(out))
    return out, ends


def check_lines(parsed_lines, expected, width, height, pixel_truth: bool):
    assert [ln.text for ln in parsed_lines] == [t for t, _ in expected]
    for line, (_, box) in zip(parsed_lines, expected):
        if pixel_truth:  # the box the text was "drawn" at: ≤ 1 px after 0-1000 quantisation and mapping
            assert all(abs(a - b) <= 1 for a, b in zip(line.box, box)), (line.box, box)
        else:  # large images: the exact mapping of the 0-1000 values, ± rounding
            n = normalised(box, width, height)
            exact = (n[0] * width / 1000, n[1] * height / 1000, n[2] * width / 1000, n[3] * height / 1000)
            assert all(abs(a - b) <= 0.5 + 1e-9 for a, b in zip(line.box, exact)), (line.box, exact)
        x1, y1, x2, y2 = line.box
        assert line.polygon == [[x1, y1], [x2, y1], [x2, y2], [x1, y2]]


def corpus(count: int):
    for seed in range(count):
        rng = random.Random(seed)
        large = seed % 4 == 3
        width = rng.randint(2001, 9000) if large else rng.randint(200, 2000)
        height = rng.randint(2001, 9000) if large else rng.randint(200, 2000)
        yield seed, rng, width, height, random_lines(rng, width, height), not large


@pytest.mark.parametrize("fmt", FORMATS)
def test_corpus_round_trip(fmt):
    cases = 0
    for seed, rng, width, height, lines, pixel_truth in corpus(250):
        items = [(text, normalised(box, width, height)) for text, box in lines]
        raw, _ = render(fmt, items, rng)
        scale = rng.choice([1.0, 0.5, 0.37, 2.0])  # the engine's resize must not change the mapping
        geom = PageGeometry(width, height, max(1, round(width * scale)), max(1, round(height * scale)))
        parsed = parse_vlm_output("spotting", EngineResult(text=raw), geom)
        assert parsed.warnings == [], (seed, raw)
        check_lines(parsed.lines, lines, width, height, pixel_truth)
        assert parsed.text == "\n".join(t for t, _ in lines)
        cases += 1
    assert cases == 250


@pytest.mark.parametrize("fmt", TRUNCATABLE)
def test_corpus_truncated(fmt):
    """Cut anywhere: every item completed before the cut comes back exactly, the cut one is dropped."""
    for seed, rng, width, height, lines, pixel_truth in corpus(150):
        items = [(text, normalised(box, width, height)) for text, box in lines]
        raw, ends = render(fmt, items, rng)
        for cut in sorted({rng.randint(0, len(raw)) for _ in range(6)} | {ends[0] - 1, ends[-1] - 1}):
            cut_raw = raw[:cut]
            complete = sum(1 for end in ends if end <= cut)
            parsed = parse_vlm_output("spotting", EngineResult(text=cut_raw, finish_reason="length"),
                                      PageGeometry(width, height, width, height))
            check_lines(parsed.lines, lines[:complete], width, height, pixel_truth)
            partial_left = cut_raw[ends[complete - 1] if complete else 0:].strip(" \n,[]`json")
            if partial_left:
                assert any("incomplete" in w for w in parsed.warnings), (seed, cut_raw)


def test_special_tokens_stripped_leave_bare_format():
    """The detokenizer drops <ref>/<quad> when they are special tokens: the bare format remains."""
    raw = "<ref>金额(小写)</ref><quad>(10,20),(300,40)</quad><ref>ATLANTA (AP)</ref><quad>(10,50),(500,90)</quad>"
    stripped = raw.replace("<ref>", "").replace("</ref>", "").replace("<quad>", "").replace("</quad>", "")
    for text in (raw, stripped, "<｜hy_place▁holder▁no▁8｜>" + stripped):
        got = parse_spotting(text)
        assert [i.text for i in got.items] == ["金额(小写)", "ATLANTA (AP)"]
        assert [i.points for i in got.items] == [[(10, 20), (300, 40)], [(10, 50), (500, 90)]]


def test_json_aliases_and_polygons():
    raw = ('[{"bbox": [1, 2, 300, 40], "text": "a"}, {"box": [[10, 10], [200, 10], [200, 50], [10, 50]], '
           '"text": "quad"}, {"box": "(5,5),(9,9)", "text": "string box"}, {"box": [1, 2], "text": "bad"}]')
    got = parse_spotting(raw)
    assert [i.text for i in got.items] == ["a", "quad", "string box"]
    assert got.dropped == 1 and got.warnings
    lines = parse_vlm_output("spotting", EngineResult(text=raw), PageGeometry(1000, 1000, 500, 500)).lines
    assert lines[1].polygon == [[10, 10], [200, 10], [200, 50], [10, 50]]


def test_layout_formats_keep_categories():
    hymeta = ("# Title<hy-meta><layout>title</layout><quad>(100,50),(900,90)</quad></hy-meta>\n"
              "<table><tr><td>1</td></tr></table><hy-meta><layout>table</layout>"
              "<poly>(100,100),(900,100),(900,400),(100,400)</poly></hy-meta>")
    geom = PageGeometry(2000, 1000, 1000, 500)
    lines = parse_vlm_output("layout", EngineResult(text=hymeta), geom).lines
    assert [(ln.category, ln.text) for ln in lines] == [("title", "# Title"),
                                                        ("table", "<table><tr><td>1</td></tr></table>")]
    assert lines[1].box == [200, 100, 1800, 400]
    as_json = json.dumps([{"layout_type": "figure", "bbox": "(0,0),(500,0),(500,500),(0,500)"},
                          {"layout_type": "text", "bbox": [[0, 600], [1000, 600], [1000, 700], [0, 700]],
                           "text": "body"}])
    lines = parse_vlm_output("layout", EngineResult(text=as_json), geom).lines
    assert [(ln.category, ln.text, ln.box) for ln in lines] == [("figure", "", [0, 0, 1000, 500]),
                                                                ("text", "body", [0, 600, 2000, 700])]


def test_clamp_and_degenerate_boxes():
    raw = ("<ref>inside</ref><quad>(100,100),(200,200)</quad>"
           "<ref>overflow</ref><quad>(900,900),(1300,1100)</quad>"
           "<ref>flat</ref><quad>(500,500),(600,500)</quad>"
           "<ref>outside</ref><quad>(1200,1200),(1300,1300)</quad>"
           "<ref>swapped</ref><quad>(300,300),(250,250)</quad>")
    parsed = parse_vlm_output("spotting", EngineResult(text=raw), PageGeometry(640, 480, 640, 480))
    assert [(ln.text, ln.box) for ln in parsed.lines] == [
        ("inside", [64, 48, 128, 96]), ("overflow", [576, 432, 640, 480]), ("swapped", [160, 120, 192, 144])]
    assert any("dropped 2 line" in w for w in parsed.warnings)


def test_unparseable_output_is_reported_not_fatal():
    for raw in ("", "no coordinates here", "<ref>only text</ref>", "[{\"box\": [1,2", "((((", "}{][", "\x00\ufffd"):
        parsed = parse_vlm_output("spotting", EngineResult(text=raw), PageGeometry(100, 100, 100, 100))
        assert parsed.lines == []
        if raw.strip():
            assert parsed.warnings


@pytest.mark.parametrize("fmt", TRUNCATABLE + ["bare_quad_first"])
def test_incremental_lines_match_the_final_parse(fmt):
    """Streaming: lines emitted as they complete equal the final parse, whatever the delta boundaries."""
    for seed, rng, width, height, lines, _ in corpus(60):
        items = [(text, normalised(box, width, height)) for text, box in lines]
        raw, _ = render(fmt, items, rng)
        inc = IncrementalSpotting()
        emitted = []
        pos = 0
        while pos < len(raw):
            step = rng.randint(1, 6)
            emitted += inc.feed(raw[pos:pos + step])
            pos += step
        final = parse_spotting(raw).items
        assert [(i.text, i.points, i.span) for i in emitted] == [(i.text, i.points, i.span) for i in final[:len(emitted)]]
        assert len(emitted) >= len(final) - 1
