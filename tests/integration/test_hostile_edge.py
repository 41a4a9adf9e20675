"""Hostile clients at the HTTP edge and through the process's life, against a real `ocr-serve serve` (mock engine,
API keys, small limits), once behind Serve's proxy actor and once behind HAProxy: oversized headers get 431 at the
edge with its memory flat, slow headers and slow bodies are cut with 408, a tenant over its concurrency cap gets 429,
and every socket the service listens on is on loopback. SIGTERM (and `ocr-serve drain`) with more work in flight than
the drain allows: every client gets its answer or 503 `shutting_down` with Retry-After, and the process exits within
the bound plus a few seconds."""

from __future__ import annotations

import ipaddress
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest

from service.cli.keys import add_key
from tests.fixtures.edge import error_code, held_for, page_body, send_and_answer
from tests.fixtures.reliability import ServeProcess, wait_for

HEADER_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 3.0
# a loaded two-core machine answers a refusal this much later than its deadline, at most
CUT_MARGIN_S = 8.0
TENANT_CAP = 2
MOCK_DELAY_S = 3.0
# the 64 MiB header held whole cost the proxy actor 193 MiB; refused at the cap, the edge's memory stays flat
MAX_EDGE_GROWTH_BYTES = 32 * 2**20


SETUPS = {"proxy": {}, "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"}}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("edge-keys") / "keys.yaml"
    return {"path": path, "a": add_key(path, tenant="tenant-a")[0], "b": add_key(path, tenant="tenant-b")[0]}


@pytest.fixture(scope="module", params=list(SETUPS))
def edge_service(request, keys, tmp_path_factory):
    env = {"OCR_MOCK_DELAY_S": str(MOCK_DELAY_S), "OCR_RATE_LIMIT_ENABLED": "false",
           "OCR_API_KEYS_FILE": str(keys["path"]), "OCR_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
           "OCR_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S), "OCR_BODY_MIN_RATE_BYTES_S": "1024",
           "OCR_MAX_CONCURRENT_REQUESTS_PER_TENANT": str(TENANT_CAP), "OCR_GRACEFUL_SHUTDOWN_TIMEOUT_S": "5",
           **SETUPS[request.param]}
    service = ServeProcess(tmp_path_factory.mktemp(f"edge-{request.param}") / "serve.log", env)
    service.setup = request.param
    yield service
    service.stop()


def listening_sockets(service: ServeProcess) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket a process of the service listens on."""
    found = []
    for process in service.processes():
        try:
            name = f"{process.name()} {' '.join(process.cmdline())[:100]}"
            for conn in process.net_connections(kind="tcp"):
                if conn.status == "LISTEN":
                    found.append((name, conn.laddr.ip, conn.laddr.port))
        except (OSError, psutil.Error):
            continue
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.ray
def test_every_listening_socket_is_on_loopback(edge_service):
    sockets = listening_sockets(edge_service)
    names = " ".join(name for name, _, _ in sockets)
    # Ray's daemons, Serve's proxy (or HAProxy with its stats page and exporter), both replicas' gRPC servers
    assert "ServeReplica:ocr:OCREngine" in names and "ServeReplica:ocr:OCRIngress" in names, sockets
    assert "raylet" in names and "gcs_server" in names, sockets
    assert ("haproxy" in names) == (edge_service.setup == "haproxy"), sockets
    assert edge_service.port in {port for _, _, port in sockets}
    exposed = [s for s in sockets if not is_loopback(s[1])]
    assert exposed == [], f"listening beyond loopback: {exposed}"


def direct_ingress_port(service: ServeProcess) -> int:
    """The port the ingress replica serves HTTP on itself (Serve's direct ingress, 30000-31000)."""
    ports = [port for name, _, port in listening_sockets(service)
             if "OCRIngress" in name and 30000 <= port <= 31000]
    assert len(ports) == 1, listening_sockets(service)
    return ports[0]


def edge_rss_bytes(service: ServeProcess) -> int:
    """Memory of what parses the client's HTTP: Serve's proxy actor, or every HAProxy process (a reload starts a
    new one)."""
    marker = "bin/haproxy" if service.setup == "haproxy" else "ProxyActor"
    total = 0
    for process in service.processes():
        try:
            if marker in " ".join(process.cmdline()):
                total += process.memory_info().rss
        except psutil.Error:  # gone since the listing (an HAProxy reload)
            continue
    assert total, f"no {marker} among the service's processes"
    return total


@pytest.mark.ray
def test_oversized_headers_get_431_at_the_edge(edge_service):
    head = b"POST /v1/ocr HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\nContent-Length: 2\r\n" \
           b"Authorization: Bearer "
    targets = {"api": edge_service.port, "direct ingress": direct_ingress_port(edge_service)}
    for where, port in targets.items():
        status, body = send_and_answer(port, head, b"a", 17 * 1024)
        assert (status, error_code(body)) == (431, "headers_too_large"), (where, status, body[:200])

    before = edge_rss_bytes(edge_service)
    peak = [before]
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            peak[0] = max(peak[0], edge_rss_bytes(edge_service))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        status, body = send_and_answer(edge_service.port, head, b"a", 64 * 2**20)
        time.sleep(0.5)
    finally:
        sampling.set()
        sampler.join()
    if edge_service.setup == "haproxy" and status == 400:
        # a head larger than HAProxy's buffer: HAProxy's own refusal, before any of it is held
        assert b"400 Bad request" in body
    else:
        assert (status, error_code(body)) == (431, "headers_too_large"), (status, body[:200])
    assert peak[0] - before < MAX_EDGE_GROWTH_BYTES, f"edge grew {(peak[0] - before) / 2**20:.0f} MiB"
    # the service still answers
    assert httpx.get(edge_service.url + "/healthz", timeout=30).status_code == 200


@pytest.mark.ray
def test_slow_clients_are_cut(edge_service, keys):
    """A client that sends its headers (or its body) a byte at a time is answered 408 and cut within the timeout,
    instead of holding its connection and an in-flight slot."""
    results = {}
    limit_s = HEADER_TIMEOUT_S + CUT_MARGIN_S + 10

    def slow_headers():
        results["headers"] = held_for(edge_service.port, b"POST /v1/ocr HTTP/1.1\r\nHost: edge\r\nX-Slow: ",
                                      b"a", 0.5, limit_s)

    def slow_body():
        head = (f"POST /v1/ocr HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
                f"Content-Length: 100000\r\nAuthorization: Bearer {keys['a']}\r\n\r\n").encode()
        results["body"] = held_for(edge_service.port, head, b"  ", 1.0, limit_s)

    threads = [threading.Thread(target=slow_headers), threading.Thread(target=slow_body)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for kind, deadline in (("headers", HEADER_TIMEOUT_S), ("body", BODY_TIMEOUT_S)):
        elapsed, status, body = results[kind]
        assert status != 0, f"slow {kind} still held after {elapsed:.0f} s"
        assert elapsed <= deadline + CUT_MARGIN_S, f"slow {kind} cut only after {elapsed:.1f} s"
        assert status == 408, (kind, status, body[:200])
        if kind == "headers" and edge_service.setup == "haproxy":
            assert b"408 Request Time-out" in body  # HAProxy's own page (service/serve/haproxy.py)
        else:
            assert error_code(body) == "request_timeout", (kind, body[:200])
    assert httpx.get(edge_service.url + "/readyz", timeout=30).json()["in_flight"] == 0


@pytest.mark.ray
def test_tenant_over_its_concurrency_cap_gets_429(edge_service, keys):
    body = page_body()
    answers: dict[int, httpx.Response] = {}

    def call(index: int, key: str) -> None:
        answers[index] = httpx.post(edge_service.url + "/v1/ocr", json=body, timeout=120,
                                    headers={"Authorization": f"Bearer {key}"})

    busy = [threading.Thread(target=call, args=(i, keys["a"])) for i in range(TENANT_CAP)]
    for thread in busy:
        thread.start()
    wait_for(lambda: httpx.get(edge_service.url + "/readyz", timeout=30).json()["in_flight"] >= TENANT_CAP, 30,
             what="tenant-a's requests in flight")
    refused = httpx.post(edge_service.url + "/v1/ocr", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {keys['a']}"})
    other = httpx.post(edge_service.url + "/v1/ocr", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {keys['b']}"})
    for thread in busy:
        thread.join()
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "too_many_concurrent_requests"
    assert int(refused.headers["retry-after"]) >= 1
    assert other.status_code == 200, other.text  # another tenant is not held back
    assert [answers[i].status_code for i in range(TENANT_CAP)] == [200] * TENANT_CAP
    again = httpx.post(edge_service.url + "/v1/ocr", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {keys['a']}"})
    assert again.status_code == 200, again.text  # the slots came back


DRAIN_BOUND_S = 12.0
DRAIN_CLIENTS = 14
DRAIN_MOCK_DELAY_S = 4.0  # two at a time: 28 s of work, more than the bound allows
# Serve's and Ray's shutdown after the drain, on a loaded two-core machine
SHUTDOWN_MARGIN_S = 10.0


@pytest.fixture(params=["sigterm", "drain_command"])
def drain_trigger(request):
    return request.param


@pytest.mark.ray
def test_drain_past_its_deadline_answers_every_client(tmp_path, drain_trigger):
    service = ServeProcess(tmp_path / "serve.log", {
        "OCR_MOCK_DELAY_S": str(DRAIN_MOCK_DELAY_S), "OCR_RATE_LIMIT_ENABLED": "false",
        "OCR_MAX_ONGOING_REQUESTS": "2", "OCR_GRACEFUL_SHUTDOWN_TIMEOUT_S": str(DRAIN_BOUND_S)})
    try:
        body = page_body()
        outcomes: list[str] = []
        lock = threading.Lock()

        def client():
            try:
                resp = httpx.post(service.url + "/v1/ocr", json=body, timeout=120)
                if resp.status_code == 200:
                    outcome = "200"
                else:
                    retry_after = int(resp.headers.get("retry-after", "0"))
                    outcome = f"{resp.status_code} {resp.json()['error']['code']} retry-after>=1={retry_after >= 1}"
            except httpx.HTTPError as exc:
                outcome = f"no answer ({type(exc).__name__})"
            with lock:
                outcomes.append(outcome)

        threads = [threading.Thread(target=client) for _ in range(DRAIN_CLIENTS)]
        for thread in threads:
            thread.start()
        # every client inside the service (/readyz's engine check would queue behind them: no polling it)
        time.sleep(3)
        started = time.monotonic()
        if drain_trigger == "sigterm":
            service.proc.send_signal(signal.SIGTERM)
        else:
            address = re.search(r"Ray cluster at (\S+)", service.log()).group(1)
            drained = subprocess.run([sys.executable, "-m", "service.cli", "drain", "--address", address,
                                      "--timeout-s", str(DRAIN_BOUND_S)], env=service.env, capture_output=True,
                                     text=True, timeout=120)
            assert drained.returncode == 0, drained.stdout + drained.stderr
            assert time.monotonic() - started <= DRAIN_BOUND_S + SHUTDOWN_MARGIN_S, drained.stdout
            assert "ended with 503 shutting_down" in drained.stdout, drained.stdout
        for thread in threads:
            thread.join(120)
        counts = Counter(outcomes)
        assert sum(counts.values()) == DRAIN_CLIENTS, counts
        assert set(counts) <= {"200", "503 shutting_down retry-after>=1=True"}, counts
        assert counts["200"] >= 2 and counts["503 shutting_down retry-after>=1=True"] >= 2, counts
        if drain_trigger == "drain_command":
            service.proc.send_signal(signal.SIGTERM)
        exit_code = service.proc.wait(120)
        elapsed = time.monotonic() - started
        assert exit_code == 0, service.log()[-3000:]
        if drain_trigger == "sigterm":
            assert elapsed <= DRAIN_BOUND_S + SHUTDOWN_MARGIN_S, f"exited {elapsed:.1f} s after SIGTERM"
            assert "drain timeout" in service.log(), service.log()[-3000:]
    finally:
        service.stop()
