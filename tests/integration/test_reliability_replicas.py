"""Replica failure under load: two embedded-engine replicas serve steady traffic, one replica's process is killed
(SIGKILL, found through Ray's actor table). The ingress retries a request once on another replica when its replica
died, so no accepted request is lost; Serve starts a replacement.

Reported: success rate, requests in flight at the kill, replacement time (kill → a new replica ALIVE and RUNNING).
"""

from __future__ import annotations

import base64
import collections
import os
import signal
import threading
import time

import httpx
import pytest

from tests.fixtures.documents import render_document
from tests.fixtures.reliability import replica_processes, wait_for

pytestmark = pytest.mark.ray

CLIENTS = 4  # concurrent clients: both replicas always have requests running or queued
REQUESTS_BEFORE_KILL = 8
REQUESTS_AFTER_REPLACEMENT = 8
SETTINGS = dict(engine="embedded", min_replicas=2, max_replicas=2, engine_num_cpus=0.5, rate_limit_enabled=False,
                health_check_period_s=2.0, health_check_timeout_s=30.0)


def running_engine_replicas() -> int:
    from ray import serve

    status = serve.status().applications["ocr"].deployments["OCREngine"]
    return status.replica_states.get("RUNNING", 0)


def test_killed_replica_loses_no_accepted_request(serve_app):
    url = serve_app(**SETTINGS)
    before = wait_for(lambda: (r := replica_processes("OCREngine")) and len(r) == 2 and r, 120,
                      what="two engine replicas")
    doc = render_document(["Replica failure drill", "Invoice 4711 total 99.50"], size=(900, 320), top=60, gap=120)
    body = {"image": base64.b64encode(doc.png()).decode(), "task": "spotting"}

    results: list[tuple[str, float, float]] = []  # (error code or "ok", sent at, answered at)
    lock = threading.Lock()
    stop = threading.Event()

    def client_loop():
        with httpx.Client(base_url=url, timeout=300) as client:
            while not stop.is_set():
                sent = time.monotonic()
                resp = client.post("/v1/ocr", json=body)
                if resp.status_code == 200:
                    code = "ok" if "4711" in resp.json()["text"] else "wrong_text"
                else:
                    code = resp.json().get("error", {}).get("code", "?")
                with lock:
                    results.append((code, sent, time.monotonic()))

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(results) >= REQUESTS_BEFORE_KILL, 300, what="steady traffic")
        victim_id, victim_pid = sorted(before.items())[0]
        at_kill = len(results)
        killed_at = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)

        def replaced():
            now = replica_processes("OCREngine")
            return len(now) == 2 and victim_id not in now and running_engine_replicas() == 2

        wait_for(replaced, 300, interval_s=0.1, what="a replacement replica")
        replacement_s = time.monotonic() - killed_at
        after = len(results)
        wait_for(lambda: len(results) >= after + REQUESTS_AFTER_REPLACEMENT, 300, what="traffic after replacement")
    finally:
        stop.set()
        for thread in threads:
            thread.join(300)
    outcomes = collections.Counter(code for code, _, _ in results)
    success = outcomes["ok"] / len(results)
    in_flight_at_kill = [code for code, sent, answered in results if sent < killed_at < answered]
    print(f"\nreplica kill: {len(results)} requests, success rate {success:.1%} {dict(outcomes)}, "
          f"{at_kill} done before the kill, {len(in_flight_at_kill)} in flight at the kill, "
          f"replacement after {replacement_s:.1f}s")
    assert len(in_flight_at_kill) >= 2, "the kill hit no accepted request (the drill proved nothing)"
    assert outcomes["ok"] == len(results), f"requests lost: {dict(outcomes)}"
    assert len(replica_processes("OCREngine")) == 2


def test_deploy_returns_only_when_every_engine_replica_is_up(serve_app):
    """`/readyz` turns 200 with the first engine replica, but `local.run_app` (and so the CLI's ready line) returns
    only when every replica the app starts with is RUNNING (serve.run waits for it): what loadtest.common's
    start_service relies on. Here the mock engine's second replica starts 6 s after the first."""
    from ray import serve

    started = time.monotonic()
    serve_app(engine="mock", min_replicas=2, max_replicas=2, engine_num_cpus=0.5, mock_start_delay_s=6.0,
              rate_limit_enabled=False)
    assert time.monotonic() - started >= 6.0
    assert running_engine_replicas() == 2
    assert str(serve.status().applications["ocr"].status).endswith("RUNNING")


def test_started_service_has_every_engine_replica_up(tmp_path):
    """The benchmarks' `start_service` returns when the CLI says ready, not at the first 200 from /readyz, which
    comes with the first engine replica: on the H200 the second of two vLLM engines was still starting (image
    processor build, CUDA graphs) during the first measured step. The real `ocr-serve serve`, two mock engine
    replicas, the second one 10 s late."""
    import httpx

    from loadtest.common import start_service
    from service.cli.serve import READY_MARKER

    settings = dict(engine="mock", min_replicas=2, max_replicas=2, engine_num_cpus=0.5, ingress_replicas=1,
                    mock_start_delay_s=10.0, rate_limit_enabled=False, graceful_shutdown_timeout_s=2)
    proc, url = start_service(settings, log_path=tmp_path / "serve.log", ready_timeout_s=300)
    try:
        assert READY_MARKER in proc.tail(100_000)
        assert httpx.get(url + "/readyz", timeout=30).status_code == 200
    finally:
        proc.stop(timeout_s=30)
