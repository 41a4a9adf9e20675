"""Hostile clients at the HTTP edge, in-process (no Ray): the middleware (header cap, body pace, tenant cap, the
drain's cut of requests and streams), uvicorn with the edge's protocol, and HAProxy's check of the configuration
service/serve/haproxy.py makes of the one Ray writes. Through a real `ocr-serve serve` behind Serve's proxy and
behind HAProxy, and its drain: tests/integration/test_hostile_edge.py."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from service.cli.keys import add_key
from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.errors import ERROR_CODES
from service.config import Settings
from tests.fixtures.edge import error_code, held_for, page_body, send_and_answer
from tests.fixtures.reliability import wait_for


def app_for(engine=None, **settings) -> tuple[AppContext, object]:
    ctx = AppContext(settings=Settings(engine="mock", rate_limit_enabled=False, **settings),
                     engine=engine or MockEngine())
    return ctx, create_app(ctx)


def test_app_refuses_oversized_headers_itself():
    """Defence in depth behind the edge: a front end that passes a larger head on still gets 431."""
    _, app = app_for(max_header_bytes=4096)
    with TestClient(app) as client:
        resp = client.get("/healthz", headers={"X-Big": "a" * 5000})
        assert resp.status_code == 431
        assert resp.json()["error"]["code"] == "headers_too_large"
        assert client.get("/healthz", headers={"X-Small": "a" * 1000}).status_code == 200


async def test_app_cuts_a_body_that_arrives_too_slowly():
    _, app = app_for(body_timeout_s=0.5, body_min_rate_bytes_s=1024)

    async def trickle():
        for _ in range(100):
            yield b"  "
            await asyncio.sleep(0.1)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        started = time.monotonic()
        resp = await client.post("/v1/ocr", content=trickle(), headers={"content-type": "application/json"})
        assert resp.status_code == 408, resp.text
        assert resp.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < 5
        # a body at a normal pace is read whole
        fast = await client.post("/v1/ocr", json=page_body())
        assert fast.status_code == 200, fast.text


async def test_open_mode_is_one_tenant_without_a_cap():
    """No key file: every caller is the anonymous tenant, and the per-tenant cap does not cap the whole service."""
    settings = Settings(engine="mock", rate_limit_enabled=False, max_concurrent_requests_per_tenant=1)
    app = create_app(AppContext(settings=settings, engine=MockEngine(delay_s=0.5)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=30) as client:
        answers = await asyncio.gather(*(client.post("/v1/ocr", json=page_body()) for _ in range(3)))
    assert [r.status_code for r in answers] == [200, 200, 200]


async def test_app_caps_a_tenants_concurrent_requests(tmp_path):
    path = tmp_path / "keys.yaml"
    key_a, key_b = add_key(path, tenant="a")[0], add_key(path, tenant="b")[0]
    from service.pipeline.context import build_context

    settings = Settings(engine="mock", rate_limit_enabled=False, api_keys_file=path,
                        max_concurrent_requests_per_tenant=1)
    ctx = build_context(settings, MockEngine(delay_s=1.0))
    app = create_app(ctx)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=30) as client:
        def post(key):
            return client.post("/v1/ocr", json=page_body(), headers={"Authorization": f"Bearer {key}"})

        first = asyncio.create_task(post(key_a))
        await asyncio.sleep(0.3)
        second, other, unauthenticated = await asyncio.gather(post(key_a), post(key_b), post("wrong"))
        assert (await first).status_code == 200
    assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_concurrent_requests"
    assert second.headers["retry-after"] == "1"
    assert other.status_code == 200
    assert unauthenticated.status_code == 401  # its route answers; it holds no tenant's slot


class StallingEngine(MockEngine):
    """Streams the first piece of its answer, then never finishes."""

    async def stream(self, request):
        async for delta in super().stream(request):
            yield delta
            await asyncio.sleep(3600)


@pytest.mark.parametrize("path,stream_frame", [("/v1/ocr", b"event: error\ndata: "),
                                               ("/v1/chat/completions", b"\n\ndata: {\"error\"")])
async def test_drain_cut_answers_open_requests_and_ends_streams(path, stream_frame):
    from service.http.middleware import cut_requests

    ctx, app = app_for(StallingEngine(delay_s=0.0))
    image = page_body()["image"]
    if path == "/v1/ocr":
        plain, streamed = {"image": image, "task": "text"}, {"image": image, "task": "text", "stream": True}
    else:
        message = {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + image}}, {"type": "text", "text": "text"}]}
        plain = {"model": "mock-ocr", "messages": [message]}
        streamed = {**plain, "stream": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=30) as client:
        calls = [asyncio.create_task(client.post(path, json=plain)),
                 asyncio.create_task(client.post(path, json=streamed))]
        await asyncio.sleep(0.5)
        assert ctx.in_flight == 2 and not any(call.done() for call in calls)
        assert cut_requests(ctx) == 2
        refused, stream = await asyncio.gather(*calls)
        late = await client.post(path, json=plain)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
    assert refused.headers["retry-after"] == "1"
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    assert stream_frame in stream.content and b'"shutting_down"' in stream.content.rsplit(b"data: ", 1)[1]
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert ctx.in_flight == 0 and not ctx.open_requests


def test_error_codes_of_the_edge_are_documented():
    assert ERROR_CODES["headers_too_large"][0] == 431
    assert ERROR_CODES["request_timeout"][0] == 408
    assert ERROR_CODES["too_many_concurrent_requests"][0] == 429


@pytest.fixture
def edge_uvicorn(monkeypatch):
    """uvicorn on a loopback port, parsing with the edge's protocol (as Serve's proxy does after proxy_callback)."""
    import uvicorn
    from uvicorn.protocols.http import auto

    from service.serve.edge import EdgeLimits, install_edge_protocol

    monkeypatch.setattr(auto, "AutoHTTPProtocol", auto.AutoHTTPProtocol)  # restored after the test
    install_edge_protocol(EdgeLimits(max_header_bytes=16 * 1024, header_timeout_s=1.0))

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, interval_s=0.05, what="uvicorn started")
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def test_edge_protocol_refuses_big_and_slow_heads(edge_uvicorn):
    head = b"GET / HTTP/1.1\r\nHost: edge\r\nX-Filler: "
    assert send_and_answer(edge_uvicorn, head, b"a", 1000)[0] == 200
    for size in (17 * 1024, 8 * 2**20):
        status, body = send_and_answer(edge_uvicorn, head, b"a", size)
        assert (status, error_code(body)) == (431, "headers_too_large"), (size, status, body)
    elapsed, status, body = held_for(edge_uvicorn, b"GET / HTTP/1.1\r\nHost: edge\r\nX-Slow: ", b"a", 0.2, 10)
    assert (status, error_code(body)) == (408, "request_timeout") and elapsed < 5, (elapsed, status, body)
    # an idle connection that never sends a byte is closed too
    elapsed, status, _ = held_for(edge_uvicorn, b"", b"", 0.2, 10)
    assert status == 408 and elapsed < 5
    # two requests on one kept-alive connection, each within the deadline, are both answered
    with socket.create_connection(("127.0.0.1", edge_uvicorn), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(b"GET / HTTP/1.1\r\nHost: edge\r\n\r\n")
            answer = b""
            while not answer.endswith(b"\r\n\r\nok"):
                answer += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(0.6)


def test_haproxy_config_gets_the_edge_limits_and_loopback_binds(tmp_path, monkeypatch):
    """Ray's own HAProxy template, rendered as its HAProxy manager does, then rewritten: HAProxy accepts the
    result, and it carries the header cap, the header timeout and loopback binds."""
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    from service.serve.edge import EdgeLimits
    from service.serve.haproxy import real_haproxy, rewrite_config

    config = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=18123),
                           socket_path=str(tmp_path / "admin.sock"), server_state_base=str(tmp_path),
                           server_state_file=str(tmp_path / "state"), metrics_socket_path=str(tmp_path / "m.sock"),
                           stats_port=18404, metrics_port=18101)
    path = tmp_path / "haproxy.cfg"
    HAProxyApi(cfg=config, config_file_path=str(path))._generate_config_file_internal()
    original = path.read_text()
    assert re.search(r"bind \*?:18404", original) and re.search(r"bind \*?:18101", original)
    rewritten, missing = rewrite_config(original, EdgeLimits(max_header_bytes=16384, header_timeout_s=7.0))
    assert missing == []
    assert rewrite_config(rewritten, EdgeLimits(16384, 7.0)) == (rewritten, [])  # HAProxy restarts on it
    assert "bind 127.0.0.1:18404" in rewritten and "bind 127.0.0.1:18101" in rewritten
    assert "timeout http-request 7s" in rewritten and "req.hdrs,length gt 16384" in rewritten
    assert re.search(r"tune\.bufsize (\d+)", rewritten).group(1) == str(16384 + 9 * 1024)
    path.write_text(rewritten)
    checked = subprocess.run([real_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
