"""`ocr-serve serve` runs Ray Serve in its throughput-optimized mode unless its environment says otherwise
(service.serve.local.SERVE_MODE_ENV; docs/DEPLOY.md). The mode is seen from outside: in it, each ingress replica
also listens for HTTP itself on a port of 30000-31000 (Serve's direct ingress) and answers the API there. In every
mode a page over gRPC's default message size (4 MiB) reaches the engine replica, and our own loggers write to the
replicas' log files."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import httpx
import pytest

from loadtest.common import listening_ports, port_holder, session_members, start_service
from tests.fixtures.reliability import wait_for

pytestmark = pytest.mark.ray

DIRECT_INGRESS_PORTS = range(30000, 31001)


# (the mode set explicitly to "1" is the default case again: the default is read from the same setting)
@pytest.mark.parametrize("env, direct_ingress", [(None, True), ("0", False)], ids=["default", "standard"])
def test_serve_mode_is_throughput_optimized_unless_the_environment_says_otherwise(env, direct_ingress, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)  # tests/conftest.py sets the default
    proc, url = start_service({"engine": "mock", "ingress_replicas": 1, "graceful_shutdown_timeout_s": 2},
                              log_path=tmp_path / "serve.log", ready_timeout_s=180,
                              extra_env={"RAY_SERVE_THROUGHPUT_OPTIMIZED": env} if env is not None else None)
    try:
        ports = listening_ports([proc.pid, *session_members(proc.pid)])
        direct = sorted(p for p in ports if p in DIRECT_INGRESS_PORTS)
        assert bool(direct) == direct_ingress, (sorted(ports), proc.tail())
        for port in direct:  # the ingress replica's own HTTP server serves the API, on loopback as the proxy does
            assert ports[port] == "0100007F", (port, ports[port])
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200
        assert httpx.get(url + "/readyz", timeout=10).status_code == 200  # and the proxy still does
        assert port_holder(proc, int(url.rsplit(":", 1)[1])) == "ray::ProxyActor"
        # a page over gRPC's 4 MiB default reaches the engine replica in every mode: the throughput-optimized mode
        # sends each call to a replica as one gRPC message, and an upload of noise stays as large as a PNG page
        # (a 500 before SERVE_MODE_ENV raised the replicas' limit)
        page = noise_png()
        assert len(page) > 6 * 1024 * 1024
        resp = httpx.post(url + "/v1/ocr", files={"file": ("noise.png", page, "image/png")}, timeout=120)
        assert resp.status_code == 200, resp.text
        # our loggers write to the replicas' log files, with their level, in every mode (through Serve's capture of
        # stderr alone a warning arrives as INFO, an INFO record not at all): the CLI says where they are
        logs_dir = re.search(r"replica logs in (\S+)", (tmp_path / "serve.log").read_text())
        assert logs_dir, proc.tail()
        ingress_log = "".join(f.read_text() for f in Path(logs_dir.group(1)).glob("replica_ocr_OCRIngress_*.log"))
        assert re.search(r"^WARNING .* -- NO API KEY FILE CONFIGURED", ingress_log, re.M), ingress_log[-2000:]
        # and the CLI says it on its own output, which a replica's log does not reach in the throughput mode
        assert "WARNING service.admission.auth: NO API KEY FILE CONFIGURED" in (tmp_path / "serve.log").read_text()
    finally:
        proc.stop(timeout_s=60)


@functools.cache
def noise_png() -> bytes:
    """1,500 × 1,500 pixels of noise: a 6.8 MB PNG (noise does not compress), within every upload limit."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 256, (1500, 1500, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def test_start_ray_warns_when_this_process_read_another_serve_mode(monkeypatch, caplog):
    """A process that imported ray.serve before start_ray() set the mode keeps the mode it read: its handles would
    not match the replicas'. start_ray() says so (and leaves an explicit choice in the environment alone)."""
    import logging
    import os
    import sys
    import types

    import ray

    from service.serve import local

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no cluster: only the checks before it
    monkeypatch.setitem(sys.modules, "ray.serve._private.constants",
                        types.SimpleNamespace(RAY_SERVE_THROUGHPUT_OPTIMIZED=False))
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")
    with caplog.at_level(logging.WARNING, logger="service.serve.local"):
        local.start_ray()
    assert not caplog.records  # standard mode read, standard mode asked for
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED")
    with caplog.at_level(logging.WARNING, logger="service.serve.local"):
        local.start_ray()
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"  # the default, set before Ray starts
    assert "Serve mode differs" in caplog.text


def test_replicas_run_at_the_priority_of_the_process_that_started_ray(embedded_url):
    """Ray starts its worker processes at nice 15; start_ray() has them run at the priority of the process that
    started Ray (WORKER_PRIORITY_ENV). Beside busy processes of its own session, an embedded replica at 15 took
    70x its quiet time for an ID card, at 0 3.8x (docs/design/worker-priority.md). The tests' Ray cluster and its replicas
    are this process's descendants."""
    import os

    import psutil

    from loadtest.common import niceness, process_kind

    replicas = {process_kind(child.pid): niceness(child.pid) for child in psutil.Process().children(recursive=True)
                if process_kind(child.pid).startswith("ray::ServeReplica:ocr:")}
    assert "ray::ServeReplica:ocr:OCREngine" in replicas, replicas
    assert set(replicas.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}, replicas


def test_haproxy_takes_the_http_port_and_serves_the_whole_api(tmp_path, monkeypatch):
    """RAY_SERVE_ENABLE_HA_PROXY=1 (opt-in for `ocr-serve serve`, the chart's default; docs/DEPLOY.md): the service
    port belongs to an haproxy process, not to Serve's proxy actor, and through it a real page gets its OCR (a body
    far over HAProxy's 16 KiB buffer), a stream its events, bad input its stable 4xx; HAProxy's stats and metrics
    listeners got free ports, not the fixed 8404/9101 (start_ray), so two services on one machine do not collide."""
    from loadtest.common import process_kind
    from loadtest.documents import make_documents

    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    proc, url = start_service({"engine": "mock", "ingress_replicas": 2, "graceful_shutdown_timeout_s": 2},
                              log_path=tmp_path / "serve.log", ready_timeout_s=180,
                              extra_env={"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    try:
        port = int(url.rsplit(":", 1)[1])
        assert port_holder(proc, port) == "haproxy"  # what bench gpu records as the service's front end

        def haproxy_ports_with_the_service_port() -> dict[int, str] | None:
            members = [proc.pid, *session_members(proc.pid)]
            ports = listening_ports([pid for pid in members if process_kind(pid).endswith("haproxy")])
            return ports if port in ports else None

        # looked at again while Ray reloads HAProxy (a new process takes the port over from the old one)
        held = wait_for(haproxy_ports_with_the_service_port, 10, what="an haproxy process holding the service port")
        assert port in held and not {8404, 9101} & set(held), held
        body = {"image": make_documents("id_card", 1)[0].data_url(), "task": "text"}  # a rendered ID card
        assert len(body["image"]) > 3 * 16 * 1024
        resp = httpx.post(url + "/v1/ocr", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["text"], resp.text
        with httpx.stream("POST", url + "/v1/ocr", json={**body, "stream": True}, timeout=60) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            events = [line for line in stream.iter_lines() if line.startswith("event:")]
        assert events and events[-1] == "event: result", events
        bad = httpx.post(url + "/v1/ocr", json={"image": "not base64!", "task": "text"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_base64"
        assert httpx.get(url + "/readyz", timeout=10).status_code == 200
    finally:
        proc.stop(timeout_s=60)
