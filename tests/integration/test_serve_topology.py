"""`serve_topology: colocated` served for real: `ocr-serve serve` with HAProxy in front (as the chart runs it) and the
mock engine; one deployment answers the whole API and drains on SIGTERM."""

from __future__ import annotations


import httpx
import pytest

from service.serve.app import (COLOCATED_DEPLOYMENT)


@pytest.mark.ray
def test_colocated_serves_the_whole_api_behind_haproxy_with_no_engine_deployment(tmp_path, monkeypatch):
    """`ocr-serve serve` with OCR_SERVE_TOPOLOGY=colocated and HAProxy (the chart's front end): HAProxy holds the
    port, one deployment runs, and through it a page gets its OCR, a stream its events, bad input its stable 4xx,
    an unknown adapter its 404, /readyz the engine's health; SIGTERM drains and stops it."""
    from loadtest.common import port_holder, process_kind, session_members, start_service
    from loadtest.documents import make_documents

    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    proc, url = start_service({"engine": "mock", "serve_topology": "colocated", "graceful_shutdown_timeout_s": 2,
                               "rate_limit_enabled": False},
                              log_path=tmp_path / "serve.log", ready_timeout_s=180,
                              extra_env={"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    try:
        assert port_holder(proc, int(url.rsplit(":", 1)[1])) == "haproxy"
        replicas = sorted(kind for kind in map(process_kind, session_members(proc.pid))
                          if kind.startswith("ray::ServeReplica"))
        assert replicas == [f"ray::ServeReplica:ocr:{COLOCATED_DEPLOYMENT}"], replicas
        body = {"image": make_documents("id_card", 1)[0].data_url(), "task": "text"}
        resp = httpx.post(url + "/v1/ocr", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["text"], resp.text
        with httpx.stream("POST", url + "/v1/ocr", json={**body, "stream": True}, timeout=60) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("event:")]
        assert events and events[-1] == "event: result", events
        bad = httpx.post(url + "/v1/ocr", json={"image": "not base64!", "task": "text"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_base64"
        unknown = httpx.post(url + "/v1/ocr", json={**body, "adapter": "nope"}, timeout=30)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_adapter", unknown.text
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["engine"] == "mock"
        info = httpx.get(url + "/v1/models", timeout=10)
        assert info.status_code == 200, info.text
    finally:
        proc.stop(timeout_s=60)
    log = proc.tail(100_000)
    assert "draining" in log and "drain timeout" not in log, log[-3000:]
