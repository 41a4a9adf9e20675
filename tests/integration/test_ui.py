"""The web UI at /ui in headless Chromium against the deployed app with the embedded engine: upload a generated
image, run spotting, see the recognised text and the boxes drawn on the canvas; upload a PDF and see its pages
arrive one by one. Screenshots: tests/artifacts/ui_spotting.png, tests/artifacts/ui_pdf_job.png."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import expect

from tests.fixtures.documents import normalise_text, render_document
from tests.fixtures.pdfs import page_texts, text_pdf

pytestmark = pytest.mark.ray
RESULT_TIMEOUT_MS = 180_000

# Coloured pixels on the canvas: the document is black on white, so any saturated pixel is a drawn box or label.
COUNT_COLOURED_PIXELS = """(canvas) => {
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let coloured = 0;
  for (let i = 0; i < data.length; i += 4) {
    const r = data[i], g = data[i + 1], b = data[i + 2];
    if (Math.max(r, g, b) - Math.min(r, g, b) > 80) coloured++;
  }
  return coloured;
}"""

# The colour at the middle of a box's top edge, in canvas pixels (scaled like the page drawing).
EDGE_PIXEL = """(canvas, [box, pageWidth]) => {
  const s = canvas.width / pageWidth;
  const x = Math.round((box[0] + box[2]) / 2 * s), y = Math.round(box[1] * s);
  let best = [0, 0, 0];
  for (let dy = -2; dy <= 2; dy++) {
    const [r, g, b] = canvas.getContext('2d').getImageData(x, y + dy, 1, 1).data;
    if (Math.max(r, g, b) - Math.min(r, g, b) > Math.max(...best) - Math.min(...best)) best = [r, g, b];
  }
  return best;
}"""


def same_origin(urls: list[str], base: str) -> list[str]:
    origin = urlsplit(base).netloc
    return [u for u in urls if not u.startswith(("blob:", "data:")) and urlsplit(u).netloc != origin]


def test_ui_assets_are_local_with_a_strict_csp(embedded_url):
    with httpx.Client(base_url=embedded_url, timeout=30) as client:
        page = client.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp
        for asset in ("app.js", "style.css"):
            assert client.get(f"/ui/{asset}").status_code == 200
        assert client.get("/ui/../settings.py").status_code == 404
        assert client.get("/ui/secret.txt").status_code == 404
        config = client.get("/ui/config.json").json()
        assert config["engine"] == "embedded"
        assert {t["name"] for t in config["tasks"] if t["supported"]} == {"spotting", "text"}
    assert "http" not in page.text.replace('href="/ui/', "").replace('src="/ui/', "")  # no CDN


def test_ui_spotting_draws_boxes_over_the_image(embedded_url, browser_page, tmp_path):
    document = render_document(["Invoice number 20261130", "Total amount due: 1,234.56 EUR",
                                "Customer: ACME Corporation"], size=(1000, 560), top=80, gap=150)
    image_path = tmp_path / "invoice.png"
    document.image.save(image_path)
    page = browser_page.page
    page.goto(embedded_url + "/ui")
    page.wait_for_selector("#task option", state="attached")  # config loaded (no wait_for_function: the CSP
    # forbids eval, which Playwright's predicate polling needs — the page runs under its real CSP)
    assert page.locator("#task").input_value() == "spotting"
    page.set_input_files("#file", str(image_path))
    page.click("#run")
    page.wait_for_selector(".page canvas[data-boxes]", timeout=RESULT_TIMEOUT_MS)

    text = page.inner_text(".page-text")
    for line in document.lines:
        assert normalise_text(line.text) in normalise_text(text)
    canvas = page.locator(".page canvas")
    assert int(canvas.get_attribute("data-boxes")) >= 3
    assert canvas.evaluate(COUNT_COLOURED_PIXELS) > 1000
    # a box edge is drawn where the API says the line is (confidence colour: green above 0.9)
    result = page.evaluate("JSON.parse(document.querySelector('.page-json').textContent)")
    first = next(line for line in result["lines"] if "Invoice" in line["text"])
    r, g, b = canvas.evaluate(EDGE_PIXEL, [first["box"], result["image"]["width"]])
    assert g > r + 60 and g > b + 40, (r, g, b)
    assert "Done in" in page.inner_text("#status")
    assert page.locator(".timings th", has_text="engine").count() == 1
    browser_page.screenshot("ui_spotting.png")
    assert same_origin(browser_page.requests, embedded_url) == []
    assert browser_page.console_errors == []


def test_ui_pdf_job_shows_pages_as_they_arrive(embedded_url, browser_page, tmp_path):
    pdf_path = tmp_path / "two.pdf"
    pdf_path.write_bytes(text_pdf(2))
    page = browser_page.page
    page.goto(embedded_url + "/ui")
    page.wait_for_selector("#task option", state="attached")  # config loaded (no wait_for_function: the CSP
    # forbids eval, which Playwright's predicate polling needs — the page runs under its real CSP)
    page.set_input_files("#file", str(pdf_path))
    page.click("#run")
    expect(page.locator("#status")).to_have_text(re.compile(r"^Job succeeded"), timeout=RESULT_TIMEOUT_MS)
    cards = page.locator("article.page")
    assert cards.count() == 2
    assert [cards.nth(i).get_attribute("data-page") for i in range(2)] == ["1", "2"]
    for i, lines in enumerate(page_texts(2)):
        text = normalise_text(cards.nth(i).locator(".page-text").inner_text())
        assert all(normalise_text(line) in text for line in lines)
        canvas = cards.nth(i).locator("canvas")
        assert int(canvas.get_attribute("data-boxes")) >= 2
        assert canvas.evaluate(COUNT_COLOURED_PIXELS) > 500
        # the page preview (rendered PDF page) is drawn under the boxes: dark text pixels exist
        dark = canvas.evaluate("""(c) => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] + d[i+1] + d[i+2] < 150) n++; return n; }""")
        assert dark > 500
    assert page.locator("#progress").evaluate("p => [p.value, p.max]") == [2, 2]
    browser_page.screenshot("ui_pdf_job.png")
    assert same_origin(browser_page.requests, embedded_url) == []
    assert browser_page.console_errors == []


def test_ocr_serve_ui_prints_the_url(capsys):
    from service.cli.main import main

    assert main(["ui", "--url", "http://127.0.0.1:9999/"]) == 0
    assert "http://127.0.0.1:9999/ui" in capsys.readouterr().out
