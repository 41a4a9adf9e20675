"""The web UI at /ui in headless Chromium against the deployed app with the embedded engine: upload a generated
image, run spotting, see the recognised text and the boxes drawn on the canvas; drop a file on the page, hover a box
for its confidence (nothing drawn over the text), copy the text and download the JSON; upload a PDF and see its pages
arrive one by one; the API key field follows the service's mode and lasts as long as the tab; controls the engine
does not support are hidden. Screenshots: tests/artifacts/ui_*.png."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
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


# Coloured pixels farther than `tolerance` canvas pixels from every line's outline (its polygon's edges): a label,
# a fill or a badge drawn over the page. 0 means only outlines are drawn.
COLOURED_OFF_OUTLINES = """(canvas, [lines, pageWidth, tolerance]) => {
  const s = canvas.width / pageWidth;
  const segments = [];
  for (const l of lines) {
    const pts = (l.polygon && l.polygon.length ? l.polygon
      : [[l.box[0], l.box[1]], [l.box[2], l.box[1]], [l.box[2], l.box[3]], [l.box[0], l.box[3]]])
      .map(([x, y]) => [x * s, y * s]);
    pts.forEach((p, k) => segments.push([p, pts[(k + 1) % pts.length]]));
  }
  const near = (x, y) => segments.some(([[ax, ay], [bx, by]]) => {
    const dx = bx - ax, dy = by - ay, len = dx * dx + dy * dy;
    const t = len ? Math.max(0, Math.min(1, ((x - ax) * dx + (y - ay) * dy) / len)) : 0;
    return Math.hypot(x - (ax + t * dx), y - (ay + t * dy)) <= tolerance;
  });
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let off = 0;
  for (let i = 0; i < data.length; i += 4) {
    const r = data[i], g = data[i + 1], b = data[i + 2];
    if (Math.max(r, g, b) - Math.min(r, g, b) <= 80) continue;
    if (!near((i / 4) % canvas.width, Math.floor(i / 4 / canvas.width))) off++;
  }
  return off;
}"""

# A DataTransfer holding one file, as a drop from the desktop carries it.
DATA_TRANSFER = """([b64, name, type]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const transfer = new DataTransfer();
  transfer.items.add(new File([bytes], name, { type }));
  return transfer;
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
        assert config["features"] == {"adapters": False}
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
    # confidences never cover the text: the canvas holds the page and the outlines only
    assert canvas.evaluate(COLOURED_OFF_OUTLINES, [result["lines"], result["image"]["width"], 4]) == 0
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


def open_ui(page, url: str) -> None:
    page.goto(url + "/ui")
    page.wait_for_selector("#task option", state="attached")  # config loaded (the CSP forbids wait_for_function)


def test_ui_drop_hover_copy_and_download(embedded_url, browser_page, browser_context, tmp_path):
    document = render_document(["Invoice number 20261130", "Total amount due: 1,234.56 EUR"], size=(900, 420),
                               top=70, gap=150)
    page = browser_page.page
    browser_context.grant_permissions(["clipboard-read", "clipboard-write"], origin=embedded_url)
    open_ui(page, embedded_url)
    # drag and drop: a file dropped on the page becomes the upload
    transfer = page.evaluate_handle(DATA_TRANSFER, [base64.b64encode(document.png()).decode(), "dropped.png",
                                                    "image/png"])
    page.dispatch_event("#drop", "dragover", {"dataTransfer": transfer})
    assert "dragging" in page.get_attribute("#drop", "class")
    page.dispatch_event("#drop", "drop", {"dataTransfer": transfer})
    assert page.evaluate("document.getElementById('file').files[0].name") == "dropped.png"
    assert "dropped.png" in page.inner_text("#drop-hint")
    assert page.locator("#result-actions").is_hidden()
    page.click("#run")
    page.wait_for_selector(".page canvas[data-boxes]", timeout=RESULT_TIMEOUT_MS)
    result = page.evaluate("JSON.parse(document.querySelector('.page-json').textContent)")
    assert result["text"] and len(result["lines"]) >= 2

    # the side list links each line's confidence to its box; hovering a box shows its confidence below it
    items = page.locator(".line-list li")
    assert items.count() == len(result["lines"])
    index, line = next((i, l) for i, l in enumerate(result["lines"]) if "Invoice" in l["text"])
    assert items.nth(index).locator(".conf").inner_text() == f"{line['confidence']:.2f}"
    canvas = page.locator(".page canvas")
    box = canvas.bounding_box()
    factor = box["width"] / result["image"]["width"]  # page pixels → screen pixels
    x0, y0, x1, y1 = line["box"]
    page.mouse.move(box["x"] + (x0 + x1) / 2 * factor, box["y"] + (y0 + y1) / 2 * factor)
    tip = page.locator(".box-tip")
    assert tip.is_visible()
    assert f"confidence {line['confidence']:.3f}" in tip.inner_text() and line["text"] in tip.inner_text()
    assert tip.bounding_box()["y"] >= box["y"] + y1 * factor  # below the line, not over it
    assert canvas.get_attribute("data-highlight") == str(index)
    assert "active" in items.nth(index).get_attribute("class")
    browser_page.screenshot("ui_hover.png")
    other = 1 - index if index < 2 else 0
    items.nth(other).hover()  # and the list highlights the box
    assert canvas.get_attribute("data-highlight") == str(other)
    assert canvas.evaluate(COLOURED_OFF_OUTLINES, [result["lines"], result["image"]["width"], 6]) == 0

    page.click("#copy-text")
    expect(page.locator("#status")).to_have_text(re.compile(r"^Copied \d+ characters"))
    assert page.evaluate("navigator.clipboard.readText()") == result["text"]
    with page.expect_download() as download:
        page.click("#download-json")
    assert download.value.suggested_filename == f"{result['id']}.json"
    assert json.loads(Path(download.value.path()).read_text()) == result
    assert same_origin(browser_page.requests, embedded_url) == []
    assert browser_page.console_errors == []


def test_ui_controls_follow_the_engine_and_the_key_mode(embedded_url, browser_page, browser_context):
    page = browser_page.page
    open_ui(page, embedded_url)
    # open mode (no key file): no key field to fill; the embedded engine: its two tasks, no adapter field
    assert page.locator("#api-key-control").is_hidden() and page.locator("#api-key").is_disabled()
    assert page.locator("#open-mode").is_visible()
    assert page.locator("#task option").all_inner_texts() == ["spotting", "text"]
    assert "Not on the embedded engine: document" in page.inner_text("#unsupported-tasks")
    assert page.locator("#adapter-control").is_hidden()
    browser_page.screenshot("ui_open_mode.png")

    # a service that asks for keys and serves adapters (its config answer, as such a service gives it)
    config = httpx.get(embedded_url + "/ui/config.json", timeout=30).json()
    keyed = {**config, "auth_required": True, "authenticated": False, "features": {"adapters": True}}
    sent_keys: list[str | None] = []

    def answer(route):
        sent_keys.append(route.request.headers.get("authorization"))
        route.fulfill(status=200, content_type="application/json", body=json.dumps(keyed))

    browser_context.route("**/ui/config.json", answer)
    try:
        open_ui(page, embedded_url)
        assert page.locator("#api-key-control").is_visible() and page.locator("#api-key").is_enabled()
        assert page.locator("#open-mode").is_hidden() and page.locator("#adapter-control").is_visible()
        page.fill("#api-key", "tab-key-123")
        page.dispatch_event("#api-key", "change")
        expect(page.locator("#api-key")).to_have_value("tab-key-123")
        page.reload()  # the same tab keeps the key, and sends it
        page.wait_for_selector("#task option", state="attached")
        expect(page.locator("#api-key")).to_have_value("tab-key-123")
        assert sent_keys[-1] == "Bearer tab-key-123"
        browser_page.screenshot("ui_key_mode.png")
        other_tab = browser_context.new_page()  # a new tab starts without it
        try:
            open_ui(other_tab, embedded_url)
            expect(other_tab.locator("#api-key")).to_have_value("")
        finally:
            other_tab.close()
    finally:
        browser_context.unroute("**/ui/config.json", answer)
    assert browser_page.console_errors == []
