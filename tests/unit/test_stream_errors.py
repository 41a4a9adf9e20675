"""A streamed request (`stream: true`, on /v1/ocr and the OpenAI endpoints) that fails before any output gets the
status and error body it would get without `stream`; only a failure after output arrived is an `error` event inside
the 200 (service.http.sse.first_event_then_rest)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from PIL import Image

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.errors import OCRError
from service.config import Settings


def make_client(engine, **settings) -> httpx.AsyncClient:
    """The app in-process, answering 500s as a server would (Starlette re-raises after sending them)."""
    app = create_app(AppContext(settings=Settings(**settings), engine=engine))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test", timeout=60)


def page_b64() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 32), "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class FailingEngine(MockEngine):
    """Raises `error` after `after` deltas of the mock's output."""

    def __init__(self, error: BaseException, after: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.error, self.after = error, after

    async def stream(self, request):
        sent = 0
        async for delta in super().stream(request):
            if sent == self.after:
                raise self.error
            sent += 1
            yield delta


STREAMS = {
    "ocr": ("/v1/ocr", lambda image: {"image": image, "task": "text", "stream": True}),
    "chat": ("/v1/chat/completions", lambda image: {"stream": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
        {"type": "text", "text": "Read it."}]}]}),
    "completions": ("/v1/completions", lambda image: {"stream": True, "prompt": "Read it.", "image": image}),
}


@pytest.mark.parametrize("endpoint", sorted(STREAMS))
@pytest.mark.parametrize("error, status, code", [
    (OCRError("overloaded", "busy", headers={"Retry-After": "2"}), 503, "overloaded"),
    (OCRError("engine_unavailable", "gone"), 503, "engine_unavailable"),
    (OCRError("unknown_adapter", "no such adapter"), 404, "unknown_adapter"),
    (RuntimeError("engine bug"), 500, "internal_error"),
], ids=["overloaded", "engine_unavailable", "unknown_adapter", "engine_bug"])
async def test_a_failure_before_any_output_is_the_answers_status(endpoint, error, status, code):
    path, body = STREAMS[endpoint]
    async with make_client(FailingEngine(error)) as client:
        resp = await client.post(path, json=body(page_b64()))
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["error"]["code"] == code
    if code == "overloaded":
        assert resp.headers["retry-after"] == "2"


@pytest.mark.parametrize("endpoint", sorted(STREAMS))
async def test_a_failure_after_output_is_an_error_event_in_the_200(endpoint):
    path, body = STREAMS[endpoint]
    async with make_client(FailingEngine(OCRError("engine_unavailable", "gone"), after=2)) as client:
        resp = await client.post(path, json=body(page_b64()))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    payloads = [json.loads(line[6:]) for line in resp.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(payloads) >= 3  # two pieces of output, then the error
    assert payloads[-1] == {"error": {"code": "engine_unavailable", "message": "gone", "type": "server_error",
                                      "param": None}}


@pytest.mark.parametrize("endpoint", sorted(STREAMS))
async def test_no_output_within_the_request_timeout_is_a_504(endpoint):
    path, body = STREAMS[endpoint]
    async with make_client(MockEngine(delay_s=5), request_timeout_s=0.5) as client:
        resp = await client.post(path, json=body(page_b64()))
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout", resp.text


@pytest.mark.parametrize("endpoint", sorted(STREAMS))
async def test_a_healthy_stream_still_streams(endpoint):
    path, body = STREAMS[endpoint]
    async with make_client(MockEngine()) as client:
        resp = await client.post(path, json=body(page_b64()))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert "event: error" not in resp.text and '"error": {' not in resp.text
    assert "event: result" in resp.text or "data: [DONE]" in resp.text
