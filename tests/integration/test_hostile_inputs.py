"""Bad-input matrix against the real embedded engine: the whole matrix (tests/fixtures/hostile.py) in-process around
a started rapidocr engine, and a subset through real Ray Serve over real HTTP to the embedded engine replica
(every kind's chunked and lying-length bodies over raw sockets). Same verdicts as against the mock engine
(tests/unit/test_hostile_inputs.py); no engine crashed or restarted, RSS bounded.
"""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine import make_engine
from service.config import Settings
from tests.fixtures.hostile import (HOSTILE_SETTINGS, MAX_FIRST_PASS_GROWTH_BYTES, MAX_STEADY_GROWTH_BYTES,
                                    HostileCase, b64, judge, matrix, parse_json, run_matrix_in_process)
from tests.fixtures.reliability import chunked, raw_http, replica_processes, rss_bytes


@pytest.fixture(scope="module")
def cases() -> dict[str, list[HostileCase]]:
    return matrix()


@pytest.fixture(scope="module")
def embedded_client():
    """The API in-process around a started real embedded engine (rapidocr)."""
    settings = Settings(engine="embedded", **HOSTILE_SETTINGS)
    engine = make_engine(settings)
    ctx = AppContext(settings=settings, engine=engine)
    with TestClient(create_app(ctx), raise_server_exceptions=False) as client:
        client.portal.call(engine.start)
        yield client, engine


def test_bad_input_matrix_in_process(embedded_client, cases):
    client, engine = embedded_client
    run = run_matrix_in_process(client, cases)
    # the engine is the same object and still answers a real inference: nothing crashed or restarted it
    client.portal.call(engine.check_health)
    print("\n" + run.report())
    assert not run.problems, "\n".join(run.problems)
    assert run.first_growth < MAX_FIRST_PASS_GROWTH_BYTES, f"RSS grew {run.first_growth / 2**20:.0f} MiB"
    assert run.steady_growth < MAX_STEADY_GROWTH_BYTES, \
        f"RSS grew {run.steady_growth / 2**20:.0f} MiB on the second pass"


SERVE_CASES_PER_KIND = 6


@pytest.mark.ray
def test_bad_input_subset_through_serve(serve_app, cases):
    """A subset of every kind (every kind's chunked and lying-length bodies included) through the Serve proxy and
    ingress to the embedded engine replica: same verdicts, no engine replica restarted, ingress RSS bounded."""
    url = serve_app(engine="embedded", **HOSTILE_SETTINGS)
    engines_before = replica_processes("OCREngine")
    ingress_before = replica_processes("OCRIngress")
    assert engines_before and ingress_before
    (ingress_pid,) = ingress_before.values()
    subset = []
    for kind_cases in cases.values():
        step = max(1, len(kind_cases) // SERVE_CASES_PER_KIND)
        picked = kind_cases[::step][:SERVE_CASES_PER_KIND]
        picked += [c for c in kind_cases if (c.chunked or "content-length" in c.headers) and c not in picked][:4]
        subset += picked
    problems = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for case in subset[:len(cases)]:  # warm-up pass over one case per kind
            client.request(case.method, case.path, **case.request_kwargs())
        rss_before = rss_bytes(ingress_pid)
        for case in subset:
            if "content-length" in case.headers:  # httpx refuses to send a lying length: raw socket
                status, body = raw_http(url, case.method, case.path, case.headers, case.raw or b"")
            elif case.chunked:  # raw socket too: the 413 may come while the body is still being sent
                status, body = raw_http(url, case.method, case.path,
                                        {**case.headers, "transfer-encoding": "chunked"}, chunked(case.raw or b""))
            else:
                resp = client.request(case.method, case.path, **case.request_kwargs())
                status, body = resp.status_code, resp.content
            problem = judge(case, status, body, parse_json(body))
            if problem:
                problems.append(f"[{case.kind}] {case.name}: {problem}")
        # streamed, a page only the engine replica refuses: the 200 waits for output, so the answer is the 400
        corrupt = next(c for c in cases["corrupt_pixels"] if c.name.startswith("garbage IDAT"))
        resp = client.post("/v1/ocr", json={"image": b64(corrupt.file), "task": "text", "stream": True})
        if resp.status_code != 400 or resp.json()["error"]["code"] != "invalid_image":
            problems.append(f"[corrupt_pixels] streamed {corrupt.name}: {resp.status_code} {resp.text[:200]}")
    rss_growth = rss_bytes(ingress_pid) - rss_before
    print(f"\nServe subset: {len(subset)} requests, ingress RSS growth {rss_growth / 2**20:.0f} MiB")
    assert not problems, "\n".join(problems)
    assert replica_processes("OCREngine") == engines_before, "an engine replica was restarted"
    assert replica_processes("OCRIngress") == ingress_before, "the ingress replica was restarted"
    assert rss_growth < MAX_FIRST_PASS_GROWTH_BYTES, f"ingress RSS grew {rss_growth / 2**20:.0f} MiB"
    assert httpx.get(url + "/readyz", timeout=60).status_code == 200
