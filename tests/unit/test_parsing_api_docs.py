"""docs/API.md stays true: every endpoint and error code is documented, and every example request/response
validates against the API's own models and OpenAPI schema (one example per task)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.schema import OCRRequest
from service.engine.mock import MockEngine
from service.errors import ERROR_CODES
from service.config import Settings
from service.tasks import TASKS
from tests.fixtures.ocr_schema import response_validator

DOC = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text(encoding="utf-8")


def openapi() -> dict:
    return create_app(AppContext(settings=Settings(), engine=MockEngine())).openapi()


def test_every_endpoint_is_documented():
    documented = set(re.findall(r"`(?:GET|POST|DELETE|PUT|PATCH) (/[^` ]*)`", DOC))
    missing = [path for path in openapi()["paths"] if path not in documented]
    assert not missing, f"document these endpoints in docs/API.md: {missing}"


def test_error_table_matches_error_codes():
    table = DOC.split("<!-- error-codes:begin -->")[1].split("<!-- error-codes:end -->")[0]
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| (\d{3}) \|", table, flags=re.M))
    expected = {code: str(status) for code, (status, _) in ERROR_CODES.items()}
    assert rows == expected, "regenerate the error table from service/errors.py ERROR_CODES"


def test_one_valid_example_per_task():
    validate = response_validator(openapi())
    sections = re.split(r"^### Task `([a-z]+)`$", DOC, flags=re.M)[1:]
    examples = dict(zip(sections[0::2], sections[1::2]))
    assert sorted(examples) == sorted(TASKS)
    for task, body in examples.items():
        request = json.loads(re.search(r"^Request:\n\n```json\n(.*?)\n```$", body, flags=re.S | re.M).group(1))
        response = json.loads(re.search(r"^Response:\n\n```json\n(.*?)\n```$", body, flags=re.S | re.M).group(1))
        assert OCRRequest.model_validate(request).task == task
        validate(response)
        assert response["task"] == task
        if TASKS[task].output == "lines":
            assert response["lines"] and all(0 < ln["confidence"] <= 1 for ln in response["lines"])
        if task == "extract":
            assert all(f["valid"] for f in response["fields"].values())
