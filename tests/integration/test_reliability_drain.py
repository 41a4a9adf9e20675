"""Graceful drain: `ocr-serve serve` (its own Ray cluster, mock engine with a per-request delay) gets SIGTERM while
10 requests are in flight. Readiness fails at once, new work is refused with 503 `shutting_down`, the 10 requests
complete with 200, then the process exits 0.
"""

from __future__ import annotations

import base64
import signal
import threading

import httpx
import pytest

from tests.fixtures.documents import render_document
from tests.fixtures.reliability import ServeProcess, wait_for

pytestmark = pytest.mark.ray

IN_FLIGHT = 10
MOCK_DELAY_S = 20.0  # long enough that the 10 are still running when SIGTERM arrives on a loaded machine


# HAProxy in front of the ingress replicas (the vLLM engine's default front end) and, behind it, replicas that hold
# the engine and answer HTTP in one process (serve_topology: colocated), where the drain calls that deployment: the
# drain's handle calls, its refusals and Serve's shutdown must work in each. Serve's own proxy actor (the mock and
# embedded engines' default) drains in test_hostile_edge.py, past its deadline; the standard Serve mode is checked in
# test_serve_mode.py.
SERVE_SETUPS = {"haproxy": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"},
                "colocated_haproxy": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                                      "OCR_SERVE_TOPOLOGY": "colocated"}}


@pytest.fixture(params=list(SERVE_SETUPS))
def serving_process(tmp_path, request):
    service = ServeProcess(tmp_path / "serve.log", {
        "OCR_MOCK_DELAY_S": str(MOCK_DELAY_S), "OCR_RATE_LIMIT_ENABLED": "false",
        "OCR_GRACEFUL_SHUTDOWN_TIMEOUT_S": "120", "OCR_MAX_ONGOING_REQUESTS": "32", **SERVE_SETUPS[request.param]})
    try:
        yield service.proc, service.url, service.log_path
    finally:  # the test failed before the process exited: stop it and its Ray cluster
        service.stop()


def test_sigterm_drains_in_flight_requests(serving_process):
    proc, url, log_path = serving_process
    doc = render_document(["Drain drill"], size=(400, 160), top=40)
    body = {"image": base64.b64encode(doc.png()).decode(), "task": "text"}
    statuses: list[int] = []
    lock = threading.Lock()

    def one_request():
        resp = httpx.post(url + "/v1/ocr", json=body, timeout=300)
        with lock:
            statuses.append(resp.status_code)

    threads = [threading.Thread(target=one_request) for _ in range(IN_FLIGHT)]
    for thread in threads:
        thread.start()
    # /readyz reports the admitted work; SIGTERM only once all 10 are inside the service
    wait_for(lambda: httpx.get(url + "/readyz", timeout=10).json().get("in_flight") == IN_FLIGHT, 60,
             what="10 requests in flight")
    proc.send_signal(signal.SIGTERM)

    draining = wait_for(lambda: (r := httpx.get(url + "/readyz", timeout=10)).status_code == 503 and r, 30,
                        interval_s=0.1, what="readiness failing")
    assert draining.json()["status"] == "draining"
    refused = httpx.post(url + "/v1/ocr", json=body, timeout=30)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "shutting_down"
    assert int(refused.headers["retry-after"]) >= 1
    with lock:
        assert statuses == [], "in-flight requests finished before the drain was observed (raise MOCK_DELAY_S)"

    for thread in threads:
        thread.join(300)
    assert statuses == [200] * IN_FLIGHT, statuses
    exit_code = proc.wait(180)
    log = log_path.read_text()
    assert exit_code == 0, log[-3000:]
    assert "draining" in log and "drain timeout" not in log, log[-3000:]
