"""The Serve application with the embedded engine, end to end over HTTP: real text, real boxes in the uploaded
image's pixel coordinates (also when the upload is resized internally), JSON/base64 and multipart."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.fixtures.documents import iou, normalise_text, render_document

pytestmark = pytest.mark.ray


def assert_lines_match(result: dict, doc, scale: float = 1.0) -> None:
    got = result["lines"]
    assert len(got) == len(doc.lines), [g["text"] for g in got]
    for expected, line in zip(doc.lines, got):  # reading order = top to bottom
        assert normalise_text(line["text"]) == normalise_text(expected.text)
        box = [v * scale for v in expected.box]
        assert iou(line["box"], box) >= 0.5, (line["box"], box)
        assert 0 < line["confidence"] <= 1
        xs = [p[0] for p in line["polygon"]]
        ys = [p[1] for p in line["polygon"]]
        assert len(line["polygon"]) == 4
        assert iou([min(xs), min(ys), max(xs), max(ys)], line["box"]) > 0.8


def test_json_base64_spotting(embedded_url):
    doc = render_document()
    resp = httpx.post(embedded_url + "/v1/ocr", json={"image": doc.b64(), "task": "spotting"}, timeout=120)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["task"] == "spotting" and result["id"].startswith("ocr-")
    assert result["image"] == {"width": 1240, "height": 1754, "engine_width": 1240, "engine_height": 1754,
                               "scale": 1.0}
    assert_lines_match(result, doc)
    assert normalise_text(result["text"]) == normalise_text("".join(line.text for line in doc.lines))
    assert set(result["timings_ms"]) >= {"decode", "engine", "total"}


def test_multipart_text_task_with_data_url_and_jpeg(embedded_url):
    doc = render_document(["Receipt 0042", "Coffee 3.50", "收据 编号"], size=(900, 600), top=60, gap=150)
    resp = httpx.post(embedded_url + "/v1/ocr", files={"file": ("receipt.jpg", doc.jpeg(), "image/jpeg")},
                      data={"task": "text"}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert_lines_match(resp.json(), doc)
    data_url = "data:image/jpeg;base64," + base64.b64encode(doc.jpeg()).decode()
    resp = httpx.post(embedded_url + "/v1/ocr", json={"image": data_url, "task": "text"}, timeout=120)
    assert resp.status_code == 200
    assert normalise_text(resp.json()["text"]) == normalise_text("".join(line.text for line in doc.lines))


def test_large_upload_is_resized_and_boxes_map_back(embedded_url):
    # 2.5x an A4 page at 150 dpi: the ingress downscales it for the engine; boxes come back in upload pixels
    doc = render_document(["Large scan line one", "第二行 文字", "Amount 99.99"], size=(3100, 4385), font_size=100,
                          top=300, gap=350, left=250)
    resp = httpx.post(embedded_url + "/v1/ocr", files={"file": ("scan.png", doc.png(), "image/png")},
                      timeout=180)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["image"]["width"] == 3100 and result["image"]["height"] == 4385
    assert result["image"]["engine_height"] < 4385 and result["image"]["scale"] < 1
    assert_lines_match(result, doc)


def test_health_ready_models_openapi(embedded_url):
    assert httpx.get(embedded_url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(embedded_url + "/readyz", timeout=60)
    assert ready.status_code == 200 and ready.json()["engine"] == "embedded"
    models = httpx.get(embedded_url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"]
    spec = httpx.get(embedded_url + "/openapi.json").json()
    assert "/v1/ocr" in spec["paths"]


def test_bad_input_through_serve_is_4xx(embedded_url):
    resp = httpx.post(embedded_url + "/v1/ocr", json={"image": "not base64 !"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_base64"
    resp = httpx.post(embedded_url + "/v1/ocr", json={"image": render_document(["x"]).b64(), "task": "formula"},
                      timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported_task"


def test_openai_client_through_serve_model_errors_and_instructions(embedded_url):
    """The official client against the Serve app with the embedded engine: plain OCR text for no instruction, a 404
    naming the served model for an unknown one, and 400 `unsupported_task` for an instruction the engine cannot
    follow, each with OpenAI's `type` and `param`."""
    import openai

    doc = render_document(["Invoice 4711", "Total 99.50"], size=(640, 240), font_size=36, top=40, gap=90)
    client = openai.OpenAI(base_url=embedded_url + "/v1", api_key="unused-in-open-mode", max_retries=0,
                           timeout=120)
    base = client.models.list().data[0].id
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + doc.b64()}}
    answer = client.chat.completions.create(model=base, messages=[{"role": "user", "content": [image]}])
    assert normalise_text(answer.choices[0].message.content) == normalise_text("Invoice 4711\nTotal 99.50")

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": [image]}])
    assert err.value.body == {"code": "model_not_found", "type": "not_found_error", "param": "model",
                              "message": f"model 'gpt-4o' is not served; available: {base}"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=base, messages=[{"role": "user", "content": [
            image, {"type": "text", "text": "Translate this invoice into German."}]}])
    assert err.value.body["code"] == "unsupported_task" and err.value.body["param"] == "messages"
    assert err.value.body["type"] == "invalid_request_error"
