"""Overload: bounded engine queues (`max_ongoing_requests`, `max_queued_requests`) turn excess load into fast
503 `overloaded` answers with Retry-After instead of an unbounded queue.

One mock-engine replica taking 2 requests at once with 2 more queued (capacity: 2 running), driven by 3x that many
closed-loop clients for a bounded time. Every answer must be a 200 or a 503 `overloaded` with Retry-After; both must
occur; and the service must recover to all-200 once the load is gone. Latencies are reported, not asserted.
"""

from __future__ import annotations

import base64
import collections
import statistics
import threading
import time

import httpx
import pytest

from tests.fixtures.documents import render_document

pytestmark = pytest.mark.ray

MAX_ONGOING = 2
MAX_QUEUED = 2
MOCK_DELAY_S = 1.0
CLIENTS = 3 * MAX_ONGOING  # 3x capacity
LOAD_S = 20.0
SETTINGS = dict(engine="mock", mock_delay_s=MOCK_DELAY_S, max_ongoing_requests=MAX_ONGOING,
                max_queued_requests=MAX_QUEUED, min_replicas=1, max_replicas=1, rate_limit_enabled=False)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) >= 2 else (values or [0.0])[0]


@pytest.mark.parametrize("topology", ["split", "colocated"])
def test_three_times_capacity_gets_fast_503s(serve_app, topology):
    """split: Serve's router bounds the engine deployment's queue; colocated: the replica's own EngineGate does."""
    url = serve_app(**SETTINGS, serve_topology=topology)
    doc = render_document(["Overload drill"], size=(400, 160), top=40)
    body = {"image": base64.b64encode(doc.png()).decode(), "task": "text"}
    results: list[tuple[int, str, float, str | None]] = []  # status, code, seconds, Retry-After
    lock = threading.Lock()
    deadline = time.monotonic() + LOAD_S

    def client_loop():
        with httpx.Client(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                started = time.monotonic()
                resp = client.post("/v1/ocr", json=body)
                code = "ok" if resp.status_code == 200 else resp.json().get("error", {}).get("code", "?")
                with lock:
                    results.append((resp.status_code, code, time.monotonic() - started,
                                    resp.headers.get("retry-after")))
                if resp.status_code == 503:
                    time.sleep(0.05)  # a polite client would wait Retry-After; a hostile one hammers

    threads = [threading.Thread(target=client_loop) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LOAD_S + 180)

    outcomes = collections.Counter(f"{status} {code}" for status, code, _, _ in results)
    accepted = [s for status, _, s, _ in results if status == 200]
    rejected = [s for status, _, s, _ in results if status == 503]
    print(f"\n{topology}: overload at {CLIENTS} clients for {LOAD_S:.0f}s (capacity {MAX_ONGOING} running + "
          f"{MAX_QUEUED} queued, {MOCK_DELAY_S}s each): {dict(outcomes)}; latency accepted p50 "
          f"{percentile(accepted, 50):.2f}s p99 {percentile(accepted, 99):.2f}s max {max(accepted, default=0):.2f}s; "
          f"rejected p50 {percentile(rejected, 50) * 1000:.0f}ms p99 {percentile(rejected, 99) * 1000:.0f}ms")
    assert set(outcomes) <= {"200 ok", "503 overloaded"}, outcomes
    assert accepted and rejected, outcomes
    for status, _, _, retry_after in results:
        if status == 503:
            assert retry_after is not None and int(retry_after) >= 1
    # the queue bound holds: at most MAX_ONGOING run at once, so accepted requests cannot exceed what that allows
    assert len(accepted) <= (LOAD_S / MOCK_DELAY_S + 2) * MAX_ONGOING + MAX_QUEUED + CLIENTS

    # load gone: every request is served again
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(3):
            assert client.post("/v1/ocr", json=body).status_code == 200
