"""Hostile prompts and client mistakes through real Ray Serve over real HTTP (mock engine): nested special-token
bodies with `/healthz` polled throughout, deep JSON, long model names, wrong JSON types, huge `Last-Event-ID`s, and
raw sockets that send half a body and close (counted as 499, never as a 5xx or an error in the log)."""

from __future__ import annotations

import base64
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.fixtures.prompts import IMAGE, chat_body, deep_json, error_code, nested_halves

# A wide margin for a loaded 2-core machine; the unbounded sanitiser held the loop for seconds on 32 KB.
MAX_HEALTHZ_S = 2.0


class HealthzPoller:
    """Polls /healthz from a thread; `.longest` is the slowest answer (a failed poll counts as its timeout)."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url, self.timeout_s = url, timeout_s
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get(self.url + "/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - started if ok else self.timeout_s)
                self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(self.timeout_s + 5)

    @property
    def longest(self) -> float:
        return max(self.latencies, default=0.0)


def scrape_requests(metrics_url: str) -> dict[tuple[str, str, str], float]:
    """`ocr_requests_total` of the node's metrics agent: (endpoint, status, code) → count, all replicas summed."""
    counts: dict[tuple[str, str, str], float] = {}
    text = httpx.get(metrics_url, timeout=30).text
    for line in text.splitlines():
        if not line.startswith("ray_ocr_requests_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
        key = (labels.get("endpoint", ""), labels.get("status", ""), labels.get("code", ""))
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def server_errors(counts: dict[tuple[str, str, str], float]) -> float:
    return sum(v for (_, status, _), v in counts.items() if status.startswith("5"))


def send_half_body_and_close(url: str, path: str, total: int = 200_000) -> None:
    """Headers promising `total` bytes, half of them, then the socket closed."""
    parsed = urlparse(url)
    head = (f"POST {path} HTTP/1.1\r\nHost: {parsed.hostname}:{parsed.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {total}\r\n\r\n").encode()
    with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as sock:
        sock.sendall(head + b'{"image": "' + b"A" * (total // 2))
        time.sleep(0.3)  # the proxy forwards what it has to the ingress, then sees the close


def ingress_log_text() -> str:
    from service.serve import local

    logs_dir = local.replica_logs_dir()
    return "".join(p.read_text(errors="replace") for p in Path(logs_dir).glob("replica_ocr_OCRIngress_*.log"))


@pytest.fixture
def mock_url(serve_app) -> str:
    return serve_app(engine="mock", rate_limit_enabled=False)


@pytest.mark.ray
def test_hostile_prompts_through_serve_keep_healthz_fast(mock_url):
    """32 KB and 1 MB chat bodies of nested special-token halves, a completion prompt of the same, and text at the
    cap: each answered (400 `prompt_too_long` above the cap, 200 at it) while /healthz stays fast."""
    statuses = []
    with httpx.Client(base_url=mock_url, timeout=300) as client, HealthzPoller(mock_url) as poller:
        time.sleep(0.5)
        for size in (32 * 1024, 1024 * 1024):
            text = nested_halves(size // 2)
            statuses.append(error_code(client.post("/v1/chat/completions", json=chat_body(text))))
            statuses.append(error_code(client.post("/v1/completions", json={
                "model": "mock-ocr", "max_tokens": 4, "prompt": text, "image": IMAGE})))
        at_cap = client.post("/v1/chat/completions", json=chat_body(nested_halves(1000)))
        time.sleep(0.5)
    print(f"\n/healthz: {len(poller.latencies)} polls, slowest {poller.longest * 1000:.0f} ms; answers {statuses}")
    assert statuses == [(400, "prompt_too_long")] * 4
    assert at_cap.status_code == 200, at_cap.text
    assert len(poller.latencies) > 10 and poller.longest < MAX_HEALTHZ_S, poller.longest


@pytest.mark.ray
def test_client_mistakes_through_serve_are_4xx(mock_url):
    png = base64.b64decode(IMAGE.split(",", 1)[1])
    answers = {}
    with httpx.Client(base_url=mock_url, timeout=120) as client:
        for path in ("/v1/chat/completions", "/v1/completions"):
            answers[f"{path} nested 1000"] = error_code(client.post(
                path, content=deep_json(1_000), headers={"content-type": "application/json"}))
        answers["model of 129"] = error_code(client.post("/v1/chat/completions", json=chat_body(model="m" * 129)))
        answers["max_tokens '10'"] = error_code(client.post("/v1/chat/completions", json=chat_body(max_tokens="10")))
        answers["stream 'yes'"] = error_code(client.post("/v1/chat/completions", json=chat_body(stream="yes")))
        answers["ocr max_tokens '10'"] = error_code(client.post("/v1/ocr", json={"image": IMAGE, "max_tokens": "10"}))
        answers["ignore_eos (open mode: admin)"] = error_code(client.post(
            "/v1/chat/completions", json=chat_body(ignore_eos=True, min_tokens=2)))
        job = client.post("/v1/jobs", files=[("file", ("a.png", png, "image/png"))], data={"task": "text"}).json()
        answers["Last-Event-ID of 5000 digits"] = error_code(client.get(
            job["links"]["events"], headers={"Last-Event-ID": "9" * 5000}))
    print("\n" + "\n".join(f"  {k}: {v}" for k, v in answers.items()))
    assert answers == {
        "/v1/chat/completions nested 1000": (400, "invalid_request"),
        "/v1/completions nested 1000": (400, "invalid_request"),
        "model of 129": (422, "validation_error"),
        "max_tokens '10'": (422, "validation_error"),
        "stream 'yes'": (422, "validation_error"),
        "ocr max_tokens '10'": (422, "validation_error"),
        "ignore_eos (open mode: admin)": (200, None),
        "Last-Event-ID of 5000 digits": (400, "invalid_request"),
    }


@pytest.mark.ray
def test_clients_gone_mid_body_through_serve_are_not_server_errors(mock_url):
    """Raw sockets that send half a body and close: counted as 499 `client_disconnected` by the ingress, no 5xx
    counted, nothing logged as an error."""
    from service.serve import local

    metrics_url = local.metrics_url()
    assert metrics_url
    before = scrape_requests(metrics_url)
    log_before = len(ingress_log_text())
    closed = 4
    for _ in range(closed):
        send_half_body_and_close(mock_url, "/v1/ocr")
    assert httpx.get(mock_url + "/healthz", timeout=30).status_code == 200
    deadline = time.monotonic() + 90  # the metrics agent exports what replicas report every few seconds
    after = before
    while time.monotonic() < deadline:
        after = scrape_requests(metrics_url)
        gone = after.get(("ocr", "499", "client_disconnected"), 0) - before.get(("ocr", "499", "client_disconnected"), 0)
        if gone >= closed or server_errors(after) > server_errors(before):
            break
        time.sleep(2)
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    print(f"\nocr_requests_total since the closes: {new}")
    assert server_errors(after) == server_errors(before), new
    assert new.get(("ocr", "499", "client_disconnected"), 0) >= closed, new
    logged = ingress_log_text()[log_before:]
    assert "unhandled error" not in logged and "ClientDisconnect" not in logged, logged[-2000:]
