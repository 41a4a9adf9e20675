"""A Python client generated from the OpenAPI document by openapi-python-client (a tool tests/run.sh installs in a
venv of its own: it pins an older httpx than the service's) calls `POST /v1/ocr` with JSON and multipart bodies and
reads a typed error."""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import subprocess

import httpx
import pytest

from service.config import Settings
from service.http.app import create_app
from service.pipeline.context import AppContext
from tests.fixtures.documents import normalise_text, render_document


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def generator() -> str:
    """openapi-python-client's command: $OCR_TEST_OPENAPI_CLIENT_GENERATOR (tests/run.sh installs it in a venv of its
    own: it pins an older httpx than the service's), else on PATH."""
    found = os.environ.get("OCR_TEST_OPENAPI_CLIENT_GENERATOR") or shutil.which("openapi-python-client")
    if not found:
        pytest.fail("openapi-python-client not found: run tests/run.sh, or set OCR_TEST_OPENAPI_CLIENT_GENERATOR")
    return found


async def test_a_generated_python_client_calls_v1_ocr(tmp_path, embedded_engine, monkeypatch):
    app = create_app(AppContext(settings=Settings(rate_limit_enabled=False), engine=embedded_engine))
    spec = tmp_path / "openapi.json"
    spec.write_text(json.dumps(app.openapi()))
    out = tmp_path / "ocr_service_client"
    run = subprocess.run([generator(), "generate", "--path", str(spec), "--meta", "none", "--output-path", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "warning" not in (run.stdout + run.stderr).lower(), run.stdout + run.stderr
    # openapi-python-client 0.29 writes `| Unset` for a required body with two media types (ours: JSON and
    # multipart) without importing `Unset`
    for module in (out / "api").rglob("*.py"):
        code = module.read_text()
        if "| Unset" in code and "import UNSET, Response" in code:
            module.write_text(code.replace("import UNSET, Response", "import UNSET, Response, Unset"))
    monkeypatch.syspath_prepend(str(tmp_path))
    package = importlib.import_module("ocr_service_client")
    ocr = importlib.import_module("ocr_service_client.api.default.ocr")
    models = importlib.import_module("ocr_service_client.models")
    types = importlib.import_module("ocr_service_client.types")

    document = render_document(["Invoice 4711", "Total 99.50 EUR"], size=(640, 240), font_size=36, top=40, gap=90)
    client = package.AuthenticatedClient(base_url="http://test", token="unused-in-open-mode")
    client.set_async_httpx_client(client_of(app))
    async with client as session:
        answer = await ocr.asyncio_detailed(client=session, body=models.OCRRequest(
            image=document.b64(), task=models.OCRRequestTask.SPOTTING))
        assert answer.status_code == 200, answer.content
        result = answer.parsed
        assert isinstance(result, models.OCRResponse) and result.task == "spotting"
        assert [normalise_text(line.text) for line in result.lines] == [normalise_text(t) for t in [line.text for line in document.lines]]
        assert len(result.lines[0].box) == 4 and 0 < result.lines[0].confidence <= 1

        upload = models.OcrFilesBody(file=types.File(payload=io.BytesIO(document.png()), file_name="invoice.png",
                                                     mime_type="image/png"),
                                     task=models.OcrFilesBodyTask.TEXT)
        answer = await ocr.asyncio_detailed(client=session, body=upload)
        assert answer.status_code == 200 and normalise_text(answer.parsed.text) == normalise_text(
            "\n".join([line.text for line in document.lines]))

        answer = await ocr.asyncio_detailed(client=session, body=models.OCRRequest(image="not base64!"))
        assert answer.status_code == 400 and isinstance(answer.parsed, models.ErrorResponse)
        assert answer.parsed.error.code == models.ErrorResponseErrorCode.INVALID_BASE64
