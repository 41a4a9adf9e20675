"""PDF admission: page ranges, DPI from the image budget, real rasterisation in the PDFium sandbox, and every limit
answered with a stable 4xx code (through the real API, in-process, with the real sandbox subprocess)."""

from __future__ import annotations

import pytest

from service.admission import pdf
from service.engine.mock import MockEngine
from service.errors import OCRError
from service.config import Settings
from tests.fixtures.api_inprocess import make_client
from tests.fixtures.documents import normalise_text
from tests.fixtures.pdfs import (build_pdf, encrypted_pdf, flate_bomb, huge_box_pdf, nested_flate_bomb, page_texts,
                                 text_pdf)


def test_page_range_selection_and_limits():
    assert pdf.parse_page_range(None, 4, 10) == [1, 2, 3, 4]
    assert pdf.parse_page_range("3, 1-2", 4, 10) == [1, 2, 3]
    assert pdf.parse_page_range("2-", 4, 10) == [2, 3, 4]
    assert pdf.parse_page_range("-2,4", 9, 10) == [1, 2, 4]
    with pytest.raises(OCRError) as err:
        pdf.parse_page_range(None, 11, 10)
    assert err.value.code == "too_many_pages"
    assert pdf.parse_page_range("1-3", 11, 3) == [1, 2, 3]  # a range brings a long document under the limit
    for bad in ("0", "3-2", "x", "5"):
        with pytest.raises(OCRError) as err:
            pdf.parse_page_range(bad, 4, 10)
        assert err.value.code == "validation_error", bad


def test_dpi_follows_the_image_budget_and_the_cap():
    a4 = (595.0, 842.0)
    # plenty of budget: the cap decides
    assert pdf.choose_dpi(*a4, max_pixels=100_000_000, max_side=20_000, max_dpi=200) == 200
    # the VLM budget (max_model_len 4096, 1024 output tokens) decides: the page fits the token room
    settings = Settings(engine="mock", max_model_len=4096, max_output_tokens=1024)
    budget = pdf.page_pixel_budget(settings, "vllm")
    dpi = pdf.choose_dpi(*a4, max_pixels=budget, max_side=20_000, max_dpi=200)
    assert dpi < 200
    width, height = a4[0] / 72 * dpi, a4[1] / 72 * dpi
    assert width * height <= budget * 1.001
    from service.admission.budget import PROMPT_OVERHEAD_TOKENS, image_tokens_for

    tokens = image_tokens_for(round(height), round(width), settings.engine.min_image_pixels, settings.engine.max_engine_image_pixels)
    assert tokens + PROMPT_OVERHEAD_TOKENS + 1024 <= 4096 + 64  # within rounding of the 32-px grid


def test_renders_pages_at_the_chosen_dpi():
    settings = Settings(engine="mock", max_pdf_dpi=100)
    data = text_pdf(3)  # A4 at 150 dpi: 1240x1754 px → 595x842 pt
    with pdf.PdfSession(data, settings, pages="2-3") as session:
        info = session.open()
        pages = [session.render(number, 50_000_000) for number in (2, 3)]
    assert info.page_count == 3 and [p.number for p in info.pages] == [2, 3]
    assert info.pages[0].width_pt == pytest.approx(595.2, abs=0.5)
    assert [p.number for p in pages] == [2, 3] and all(p.error is None for p in pages)
    assert pages[0].dpi == 100 and pages[0].image.size == (827, 1170)  # 595.2 x 841.92 pt at 100 dpi, rounded up
    # the text is really there: dark pixels where page_texts put the first line (left margin 100 px at 150 dpi)
    crop = pages[0].image.convert("L").crop((60, 70, 600, 140))
    assert crop.getextrema()[0] < 80


def test_a_bad_page_fails_alone_and_the_others_still_render():
    good = ([0, 0, 300, 300], b"0 0 m 100 100 l S", b"")
    data = build_pdf([good, ([0, 0, 200_000, 10], b"", b""), good])
    with pdf.PdfSession(data, Settings(engine="mock")) as session:
        session.open()
        pages = [session.render(number, 1_000_000) for number in (1, 2, 3)]
    assert [p.error is None for p in pages] == [True, False, True]
    assert pages[1].error.code == "invalid_pdf"


LIMIT_CASES = {
    "too_many_pages": (lambda: text_pdf(4), {"max_pdf_pages": 3}, 413, "too_many_pages"),
    "encrypted": (lambda: encrypted_pdf(""), {}, 400, "invalid_pdf"),
    "encrypted_with_password": (lambda: encrypted_pdf("secret"), {}, 400, "invalid_pdf"),
    "not_a_pdf": (lambda: b"plain text, not a document at all", {}, 415, "unsupported_media_type"),
    "corrupt_pdf": (lambda: b"%PDF-1.7\n1 0 obj << /Type /Catalog >> garbage", {}, 400, "invalid_pdf"),
    "nested_flate_bomb": (nested_flate_bomb, {}, 400, "invalid_pdf"),
    "flate_bomb_memory_bound": (lambda: flate_bomb(1536), {"pdf_render_memory_mb": 512}, 400, "invalid_pdf"),
    "huge_page_box": (huge_box_pdf, {}, 400, "invalid_pdf"),
    "too_many_bytes": (lambda: text_pdf(2), {"max_pdf_bytes": 4096}, 413, "payload_too_large"),
}


@pytest.mark.parametrize("case", list(LIMIT_CASES))
async def test_job_limits_answer_stable_4xx_codes(case):
    make, settings, status, code = LIMIT_CASES[case]
    engine = MockEngine()
    async with make_client(engine, **settings) as client:
        resp = await client.post("/v1/jobs", files={"file": ("doc.pdf", make(), "application/pdf")},
                                 data={"task": "text"})
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["code"] == code
        if case.startswith("encrypted"):
            assert "encrypted" in resp.json()["error"]["message"]
    assert engine.requests == []  # nothing reached the engine


async def test_single_page_pdf_on_v1_ocr_is_recognised(embedded_client):
    lines = page_texts(1)[0]
    resp = await embedded_client.post("/v1/ocr", files={"file": ("one.pdf", text_pdf(1), "application/pdf")},
                                      data={"task": "spotting"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert normalise_text(lines[0]) in normalise_text(body["text"])
    assert body["image"]["width"] > 1000  # rendered from the 595 pt page at up to max_pdf_dpi
    resp = await embedded_client.post("/v1/ocr", files={"file": ("two.pdf", text_pdf(2), "application/pdf")},
                                      data={"task": "spotting"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_many_pages"
