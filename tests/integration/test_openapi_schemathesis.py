"""Schemathesis's own runner (`schemathesis run`, every phase and check) against the service's /openapi.json finds no
failure and raises no warning: no unresolvable reference, no schema-valid request refused (validation mismatch), no
schema-violating request accepted, no missing test data. Warnings fail the run (`warnings.fail-on`).

The API runs around the mock engine on a loopback uvicorn inside the test process (the runner needs a URL); its cache
is written to the test's temporary folder, never the repository. A few examples per operation keep it to seconds; the
in-process fuzz with more examples is tests/unit/test_fuzz_openapi.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from schemathesis.core.warnings import SchemathesisWarning
from service.config import Settings
from service.engine.mock import MockEngine
from service.http.app import create_app
from service.pipeline.context import AppContext
from tests.unit.openapi_hooks import FILES

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261205
EXAMPLES_PER_OPERATION = 10
ADAPTERS = ["tuned", "sharp"]


@pytest.fixture
def served_api():
    settings = Settings(engine="mock", rate_limit_enabled=False, max_body_bytes=1024 * 1024)
    app = create_app(AppContext(settings=settings, engine=MockEngine(adapters=list(ADAPTERS))))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def config_toml(cache_dir: Path, job_ids: list[str]) -> str:
    """Every warning shown and fatal; adapter names and job ids that exist, so that path parameters reach the
    handlers' logic (random ids are only 404s)."""
    warnings = json.dumps([str(kind) for kind in SchemathesisWarning])
    return "\n".join([
        "[warnings]", f"display = {warnings}", "fail-on = true",
        "[cache]", f"directory = {json.dumps(str(cache_dir))}",
        "[dictionaries.adapters]", f"values = {json.dumps(ADAPTERS)}",
        "[dictionaries.jobs]", f"values = {json.dumps(job_ids)}",
        "[parameters]",
        '"path.name" = { dictionary = "adapters", probability = 0.8 }',
        '"path.job_id" = { dictionary = "jobs", probability = 0.8 }',
    ]) + "\n"


def test_schemathesis_run_has_no_failure_and_no_warning(served_api, tmp_path):
    with httpx.Client(base_url=served_api, timeout=30) as client:
        document = client.get("/openapi.json").json()
        operations = sum(len(item) for item in document["paths"].values())
        job_ids = []
        for _ in range(2):
            resp = client.post("/v1/jobs", files={"file": ("page.png", FILES["image/png"][0], "image/png")})
            assert resp.status_code == 202, resp.text
            job_ids.append(resp.json()["id"])
    config = tmp_path / "schemathesis.toml"
    config.write_text(config_toml(tmp_path / "cache", job_ids))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.unit.openapi_hooks",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
         f"{served_api}/openapi.json", "--max-examples", str(EXAMPLES_PER_OPERATION), "--seed", str(SEED),
         "--workers", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    output = run.stdout + run.stderr
    summary = output[output.rfind("SUMMARY"):]
    assert run.returncode == 0, output[-6000:]
    assert f"Tested: {operations}" in summary and "Warnings" not in summary and "⚠" not in summary, summary
