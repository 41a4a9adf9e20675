"""The eval client against a scripted service (httpx MockTransport): retries, concurrency bound, jobs, fatal codes,
and one clear line for a service that is down."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from service.eval import EvalError
from service.eval.cli import main as eval_main
from service.eval.client import EvalClient, RequestOptions, retry_after_s
from service.eval.manifest import load_manifest

RESULT = {"model": "scripted", "text": "Hello", "image": {"width": 40, "height": 20},
          "lines": [{"text": "Hello", "box": [0, 0, 40, 20], "confidence": 0.9}]}


def _error(status: int, code: str, headers: dict | None = None) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": code}}, headers=headers or {})


def _manifest(tmp_path: Path, n: int = 1, pdf_pages: int = 0) -> Path:
    Image.new("RGB", (40, 20), "white").save(tmp_path / "a.png")
    entries = [{"id": f"d{i}", "image": "a.png", "lines": [{"text": "Hello", "box": [0, 0, 40, 20]}]}
               for i in range(n)]
    if pdf_pages:
        images = [Image.new("RGB", (40, 20), "white") for _ in range(pdf_pages)]
        images[0].save(tmp_path / "p.pdf", format="PDF", save_all=True, append_images=images[1:], resolution=72.0)
        entries.append({"id": "pdf", "image": "p.pdf", "pages": [{"page": p + 1, "text": "Hello"}
                                                                  for p in range(pdf_pages)]})
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def _run(tmp_path, handler, *, n=1, pdf_pages=0, concurrency=2, retries=3):
    manifest = load_manifest(_manifest(tmp_path, n, pdf_pages))
    client = EvalClient("http://svc", api_key="k", timeout_s=10, retries=retries, max_wait_s=5,
                        concurrency=concurrency, transport=httpx.MockTransport(handler))

    async def go():
        try:
            return await client.run(manifest.documents, RequestOptions("spotting"), progress=io.StringIO())
        finally:
            await client.close()

    return asyncio.run(go())


def test_retry_after_parsing():
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "2"})) == 2.0
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "0.25"})) == 0.25
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0
    assert retry_after_s(httpx.Response(429)) is None
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "soon"})) is None


def test_429_and_503_with_retry_after_are_retried_after_the_asked_time(tmp_path):
    answers = [_error(429, "rate_limited", {"Retry-After": "0.2"}),
               _error(503, "overloaded", {"Retry-After": "0.2"}), httpx.Response(200, json=RESULT)]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((time.monotonic(), request.headers.get("authorization")))
        return answers[len(seen) - 1]

    outcomes, _ = _run(tmp_path, handler)
    assert outcomes[0].error is None and outcomes[0].retries == 2
    assert outcomes[0].pages[0].result["text"] == "Hello"
    assert seen[1][0] - seen[0][0] >= 0.19 and seen[2][0] - seen[1][0] >= 0.19  # waited as asked
    assert {auth for _, auth in seen} == {"Bearer k"}


def test_503_without_retry_after_and_exhausted_retries_fail_the_document_only(tmp_path):
    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) == 1:
            return _error(503, "engine_unavailable")  # no Retry-After: not retried
        return _error(429, "rate_limited", {"Retry-After": "0"})  # always limited: gives up after the retries

    outcomes, _ = _run(tmp_path, handler, n=2, concurrency=1, retries=2)
    assert outcomes[0].error.startswith("503 engine_unavailable")
    assert outcomes[1].error.startswith("429 rate_limited") and outcomes[1].retries == 2
    assert len(calls) == 1 + 3


@pytest.mark.parametrize("status, code", [(401, "unauthorized"), (400, "unsupported_task"),
                                          (404, "unknown_adapter")])
def test_codes_that_fail_every_document_stop_the_run(tmp_path, status, code):
    with pytest.raises(EvalError, match=f"the service refused the run: {status} {code}"):
        _run(tmp_path, lambda request: _error(status, code), n=5)


def test_concurrency_is_bounded(tmp_path):
    in_flight, peak = 0, 0

    async def handler(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return httpx.Response(200, json=RESULT)

    outcomes, _ = _run(tmp_path, handler, n=12, concurrency=3)
    assert all(o.error is None for o in outcomes) and peak == 3


def test_pdf_goes_through_jobs_with_the_labelled_pages(tmp_path):
    polls = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/jobs":
            body = request.content.decode("latin-1")
            assert 'name="pages"\r\n\r\n1,2' in body and 'name="task"\r\n\r\nspotting' in body
            return httpx.Response(202, json={"id": "job1", "status": "queued", "pages_total": 2})
        if request.url.path == "/v1/jobs/job1":
            polls.append(1)
            if len(polls) < 2:
                return httpx.Response(200, json={"status": "running", "pages": []})
            pages = [{"page": p, "status": "ok", "result": RESULT | {"text": f"page {p}"}} for p in (2, 1)]
            return httpx.Response(200, json={"status": "succeeded", "pages": pages, "timings_ms": {"total": 1500.0}})
        return httpx.Response(200, json=RESULT)

    outcomes, _ = _run(tmp_path, handler, n=0, pdf_pages=2)
    pdf = outcomes[0]
    assert pdf.error is None and [p.page for p in pdf.pages] == [1, 2]
    assert [p.result["text"] for p in pdf.pages] == ["page 1", "page 2"]
    assert pdf.latency_ms >= 1500.0  # submission + the job's own creation-to-finish time


def test_failed_pdf_page_fails_the_document(tmp_path):
    def handler(request):
        if request.method == "POST":
            return httpx.Response(202, json={"id": "j", "status": "queued", "pages_total": 1})
        return httpx.Response(200, json={"status": "partial", "pages": [
            {"page": 1, "status": "failed", "error": {"code": "invalid_pdf", "message": "bad page"}}]})

    outcomes, _ = _run(tmp_path, handler, n=0, pdf_pages=1)
    assert outcomes[0].error == "page 1 failed: invalid_pdf: bad page"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_service_down_is_one_clear_line(tmp_path, capsys):
    manifest = _manifest(tmp_path)
    url = f"http://127.0.0.1:{_closed_port()}"
    code = eval_main([str(manifest), "--url", url, "--out", str(tmp_path / "out"), "--retries", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == (f"ocr-serve eval: error: cannot reach the OCR service at {url} (connection refused); start it "
                   "with `ocr-serve serve` or pass --url\n")
