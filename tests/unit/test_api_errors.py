"""Every documented client error is produced, with its stable code and a 4xx status (never 5xx)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from service.errors import ERROR_CODES, OCRError
from tests.fixtures.api_inprocess import make_client
from service.engine.mock import MockEngine


def png_bytes(size=(64, 32), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, "white").save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def assert_error(resp, status: int, code: str):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"]["code"] == code, body
    assert ERROR_CODES[code][0] == status
    assert body["error"]["message"]


def test_error_codes_are_documented_and_stable():
    with pytest.raises(ValueError):
        OCRError("made_up_code", "x")
    for code, (status, meaning) in ERROR_CODES.items():
        assert 400 <= status < 600 and meaning


async def test_invalid_base64(mock_client):
    for bad in ["!!!!", "a", "abcde", "data:image/png;base64,@@@", "data:image/png,notbase64", "YWJj\x00ZGVm"]:
        resp = await mock_client.post("/v1/ocr", json={"image": bad})
        assert_error(resp, 400, "invalid_base64")


async def test_empty_image(mock_client):
    assert_error(await mock_client.post("/v1/ocr", json={"image": ""}), 400, "empty_image")
    assert_error(await mock_client.post("/v1/ocr", json={"task": "text"}), 400, "empty_image")
    assert_error(await mock_client.post("/v1/ocr", content=b"", headers={"content-type": "application/json"}),
                 400, "empty_image")
    resp = await mock_client.post("/v1/ocr", files={"file": ("a.png", b"")})
    assert_error(resp, 400, "empty_image")


async def test_not_an_image(mock_client):
    resp = await mock_client.post("/v1/ocr", json={"image": b64(b"hello, this is plain text")})
    assert_error(resp, 415, "unsupported_media_type")
    # a PNG signature followed by garbage: sniffed as PNG, fails to decode
    resp = await mock_client.post("/v1/ocr", json={"image": b64(png_bytes()[:40])})
    assert_error(resp, 400, "invalid_image")


async def test_content_type_is_ignored_bytes_decide(embedded_client):
    resp = await embedded_client.post("/v1/ocr", files={"file": ("x.jpg", png_bytes(), "image/jpeg")})
    assert resp.status_code == 200, resp.text


async def test_image_too_large():
    async with make_client(MockEngine(), max_image_pixels=100 * 100) as client:
        resp = await client.post("/v1/ocr", json={"image": b64(png_bytes((200, 200)))})
        assert_error(resp, 413, "image_too_large")


async def test_oversize_body():
    async with make_client(MockEngine(), max_body_bytes=4096) as client:
        big = png_bytes((400, 400), mode="RGB") + b"\x00" * 8000
        assert_error(await client.post("/v1/ocr", json={"image": b64(big)}), 413, "payload_too_large")
        assert_error(await client.post("/v1/ocr", files={"file": ("a.png", big)}), 413, "payload_too_large")


async def test_unknown_task(mock_client):
    resp = await mock_client.post("/v1/ocr", json={"image": b64(png_bytes()), "task": "poetry"})
    assert_error(resp, 400, "unknown_task")


async def test_unsupported_task_names_the_engine(embedded_client):
    resp = await embedded_client.post("/v1/ocr", json={"image": b64(png_bytes()), "task": "document"})
    assert_error(resp, 400, "unsupported_task")
    assert "embedded" in resp.json()["error"]["message"]


async def test_invalid_json_and_fields(mock_client):
    resp = await mock_client.post("/v1/ocr", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(resp, 400, "invalid_request")
    resp = await mock_client.post("/v1/ocr", content=b"[1,2]", headers={"content-type": "application/json"})
    assert_error(resp, 400, "invalid_request")
    resp = await mock_client.post("/v1/ocr", json={"image": b64(png_bytes()), "colour": "blue"})
    assert_error(resp, 422, "validation_error")
    resp = await mock_client.post("/v1/ocr", json={"image": b64(png_bytes()), "max_tokens": 0})
    assert_error(resp, 422, "validation_error")


async def test_task_options_must_match_the_task(mock_client):
    image = b64(png_bytes())
    cases = [
        ({"task": "extract"}, "`fields` or `schema`"),
        ({"task": "translate"}, "needs `target_language`"),
        # options of another task: refused, not silently dropped (a forgotten task=extract gave fields: null)
        ({"fields": ["name"]}, "not 'spotting'"),
        ({"task": "text", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}, "not 'text'"),
        ({"task": "document", "target_language": "en"}, "`target_language` applies to task `translate`"),
    ]
    for extra, message in cases:
        resp = await mock_client.post("/v1/ocr", json={"image": image, **extra})
        assert_error(resp, 400, "invalid_request")
        assert message in resp.json()["error"]["message"], (extra, resp.json())
    resp = await mock_client.post("/v1/ocr", files={"file": ("a.png", png_bytes(), "image/png")},
                                  data={"fields": "name,id_number"})
    assert_error(resp, 400, "invalid_request")
    resp = await mock_client.post("/v1/ocr", json={"image": image, "task": "extract", "fields": ["name"]})
    assert resp.status_code == 200, resp.text


async def test_task_options_are_checked_on_the_embedded_engine_too(embedded_client):
    resp = await embedded_client.post("/v1/ocr", files={"file": ("a.png", png_bytes(), "image/png")},
                                      data={"task": "text", "fields": "total"})
    assert_error(resp, 400, "invalid_request")
    resp = await embedded_client.post("/v1/ocr", files={"file": ("a.png", png_bytes(), "image/png")},
                                      data={"task": "text"})
    assert resp.status_code == 200, resp.text


async def test_wrong_content_type(mock_client):
    resp = await mock_client.post("/v1/ocr", content=b"abc", headers={"content-type": "text/plain"})
    assert_error(resp, 415, "unsupported_media_type")


async def test_routes_and_methods(mock_client):
    assert_error(await mock_client.get("/v1/nothing"), 404, "not_found")
    assert_error(await mock_client.get("/v1/ocr"), 405, "method_not_allowed")


async def test_openapi_documents_both_body_types(mock_client):
    spec = (await mock_client.get("/openapi.json")).json()
    content = spec["paths"]["/v1/ocr"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(content)
