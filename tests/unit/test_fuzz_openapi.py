"""Schemathesis against the service's own /openapi.json: positive and negative data, >= 50 examples per operation,
fixed seed. Every response must be a non-5xx that conforms to the documented schema (status, content type, body).

The app runs in-process around the mock engine (the layers above the engine seam are what the fuzzer exercises; the
real-engine hostile inputs are tests/integration/test_hostile_inputs.py), so the whole run takes seconds.
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import pytest

import schemathesis  # noqa: E402  (dev extra)

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from service.http.app import create_app  # noqa: E402
from service.pipeline.context import AppContext  # noqa: E402
from service.engine.mock import MockEngine  # noqa: E402
from service.config import Settings  # noqa: E402
import tests.unit.openapi_hooks  # noqa: E402,F401  (real images for the image formats and media types)

SEED = 20261130
EXAMPLES_PER_OPERATION = 50
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz_app():
    """The API around the mock engine; the limiter is off so the fuzzer reaches every layer behind it."""
    settings = Settings(engine="mock", rate_limit_enabled=False, max_body_bytes=1024 * 1024)
    return create_app(AppContext(settings=settings, engine=MockEngine(adapters=["tuned", "sharp"])))


APP = fuzz_app()
CONFIG = schemathesis.Config.from_dict({
    "seed": SEED,
    # failures are reported by the test; the crash cache stays outside the repository
    "cache": {"directory": str(Path(tempfile.gettempdir()) / "ocr-service-schemathesis")},
    # mode "all" = positive and negative data
    "generation": {"mode": "all", "max-examples": EXAMPLES_PER_OPERATION, "deterministic": True},
})
schema = schemathesis.openapi.from_asgi("/openapi.json", APP, config=CONFIG)
EXAMPLES: collections.Counter[str] = collections.Counter()


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(case):
    EXAMPLES[f"{case.operation.method.upper()} {case.operation.path}"] += 1
    response = case.call()
    case.validate_response(response, checks=CHECKS)


def test_fuzzing_reached_every_operation_often_enough():
    """Runs after the fuzz test in this module (pytest keeps file order): each operation got its examples."""
    document = APP.openapi()
    operations = {f"{method.upper()} {path}": spec for path, item in document["paths"].items()
                  for method, spec in item.items()}
    assert operations, "the OpenAPI document lists no operations"
    if not EXAMPLES:
        pytest.skip("run together with test_openapi_fuzz")
    print("examples per operation:", dict(EXAMPLES))
    # operations with documented inputs (a body or parameters) get the full count; without inputs there are only a
    # handful of distinct requests to make
    with_inputs = [op for op, spec in operations.items() if spec.get("requestBody") or spec.get("parameters")]
    assert "POST /v1/ocr" in with_inputs
    for op in with_inputs:
        assert EXAMPLES[op] >= EXAMPLES_PER_OPERATION, (op, EXAMPLES[op])
