"""Bad-input matrix: >= 12 kinds x >= 50 generated hostile requests (tests/fixtures/hostile.py) against the real
embedded engine — in-process for the bulk, and a subset through real Ray Serve over real HTTP.

Every answer must be a 4xx whose body carries a documented error code with its documented status, or a 200 where the
input is legal (odd colour modes, sizes just below the caps). No 5xx, no engine restart, bounded RSS growth.
"""

from __future__ import annotations

import collections
import socket
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine import make_engine
from service.engine.mock import MockEngine
from service.errors import ERROR_CODES
from service.config import Settings
from tests.fixtures.hostile import HOSTILE_SETTINGS, SPECIAL_TOKENS, HostileCase, b64, encode, matrix, page
from tests.fixtures.reliability import chunked, raw_http, replica_processes, rss_bytes, settled_rss_bytes

MIN_KINDS = 12
MIN_CASES_PER_KIND = 50
# RSS, measured settled (garbage collected, the allocator's free pages handed back: settled_rss_bytes): the first
# pass over the matrix grows the process while decoder/ONNX buffers reach the sizes the caps allow (50-103 MiB
# measured); a second pass over the allocation-heavy kinds must then stay flat (-11 to +21 MiB measured) — a leak of
# decoded images (12 MB each near the pixel cap) shows up within a few requests. Unsettled RSS, as measured before
# 2026-12-01, varied by 0-92 MiB on the second pass with nothing leaking, and failed this test now and then.
MAX_FIRST_PASS_GROWTH_BYTES = 768 * 2**20
MAX_STEADY_GROWTH_BYTES = 64 * 2**20
STEADY_STATE_KINDS = ("pixel_bomb", "truncated", "oversize_body", "huge_fields", "many_frames")


@pytest.fixture(scope="module")
def cases() -> dict[str, list[HostileCase]]:
    return matrix()


def judge(case: HostileCase, status: int, body: bytes, json_body) -> str | None:
    """None when the answer is acceptable for the case, else what is wrong."""
    if status >= 500:
        return f"{status} (server error)"
    if status == 200:
        if "ok" not in case.expect:
            return f"200 but expected one of {sorted(case.expect)}"
        if case.check is not None:
            try:
                case.check(json_body)
            except AssertionError as exc:
                return f"200 with wrong content: {exc}"
        return None
    if not isinstance(json_body, dict) or not isinstance(json_body.get("error"), dict):
        return f"{status} without an error body: {body[:120]!r}"
    code = json_body["error"].get("code")
    if code not in ERROR_CODES:
        return f"{status} with undocumented code {code!r}"
    if ERROR_CODES[code][0] != status:
        return f"code {code!r} came with {status}, documented {ERROR_CODES[code][0]}"
    if code not in case.expect:
        return f"{status} {code} but expected one of {sorted(case.expect)}"
    return None


def parse_json(content: bytes):
    import json

    try:
        return json.loads(content)
    except ValueError:
        return None


def test_matrix_shape(cases):
    assert len(cases) >= MIN_KINDS, sorted(cases)
    for kind, kind_cases in cases.items():
        assert len(kind_cases) >= MIN_CASES_PER_KIND, (kind, len(kind_cases))
        assert any("ok" not in c.expect for c in kind_cases), f"{kind} has no case that must be refused"
        assert len({c.name for c in kind_cases}) == len(kind_cases), f"{kind} has duplicate case names"


@pytest.fixture(scope="module")
def embedded_client():
    """The API in-process around a started real embedded engine (rapidocr)."""
    settings = Settings(engine="embedded", **HOSTILE_SETTINGS)
    engine = make_engine(settings)
    ctx = AppContext(settings=settings, engine=engine)
    with TestClient(create_app(ctx), raise_server_exceptions=False) as client:
        client.portal.call(engine.start)
        yield client, engine


def run_in_process(client: TestClient, case: HostileCase) -> str | None:
    resp = client.request(case.method, case.path, **case.request_kwargs())
    return judge(case, resp.status_code, resp.content, parse_json(resp.content))


def test_bad_input_matrix_in_process(embedded_client, cases):
    client, engine = embedded_client
    for kind_cases in cases.values():  # warm-up: one case of each kind (decoder plugins, engine sessions)
        run_in_process(client, kind_cases[0])
    rss_before = settled_rss_bytes()
    problems: list[str] = []
    outcomes: dict[str, collections.Counter] = {}
    started = time.perf_counter()
    for kind, kind_cases in cases.items():
        counter = outcomes.setdefault(kind, collections.Counter())
        for case in kind_cases:
            resp = client.request(case.method, case.path, **case.request_kwargs())
            payload = parse_json(resp.content)
            code = "ok" if resp.status_code == 200 else (payload or {}).get("error", {}).get("code", "?")
            counter[f"{resp.status_code} {code}"] += 1
            problem = judge(case, resp.status_code, resp.content, payload)
            if problem:
                problems.append(f"[{kind}] {case.name}: {problem}")
    rss_after_first = settled_rss_bytes()
    for kind in STEADY_STATE_KINDS:  # second pass: steady state
        for case in cases[kind]:
            client.request(case.method, case.path, **case.request_kwargs())
    steady_growth = settled_rss_bytes() - rss_after_first
    first_growth = rss_after_first - rss_before
    # the engine is the same object and still answers a real inference: nothing crashed or restarted it
    client.portal.call(engine.check_health)
    total = sum(len(v) for v in cases.values())
    print(f"\nbad-input matrix: {total} requests in {time.perf_counter() - started:.0f}s, RSS growth "
          f"{first_growth / 2**20:.0f} MiB (first pass), {steady_growth / 2**20:.0f} MiB (second pass)")
    for kind, counter in outcomes.items():
        print(f"  {kind:16s} {dict(counter)}")
    assert not problems, "\n".join(problems)
    assert first_growth < MAX_FIRST_PASS_GROWTH_BYTES, f"RSS grew {first_growth / 2**20:.0f} MiB"
    assert steady_growth < MAX_STEADY_GROWTH_BYTES, f"RSS grew {steady_growth / 2**20:.0f} MiB on the second pass"


@pytest.mark.parametrize("transport", ["png", "pixels"])
def test_engine_sees_no_byte_of_the_upload_container(cases, transport):
    """Whatever container arrives (polyglot, JPEG with a script comment), the engine gets a fresh PNG: no trailing
    payload, no metadata chunks of the upload; or, with the pixel transport, exactly width × height × 3 bytes of
    pixels and nothing else."""
    settings = Settings(engine="mock", engine_image_transport=transport, **HOSTILE_SETTINGS)
    engine = MockEngine()
    with TestClient(create_app(AppContext(settings=settings, engine=engine))) as client:
        polyglots = [c for c in cases["polyglot"] if "ok" in c.expect and c.file is not None]
        assert len(polyglots) >= 40
        for case in polyglots:
            resp = client.request(case.method, case.path, **case.request_kwargs())
            if resp.status_code != 200:
                continue
            request = engine.requests[-1]
            if transport == "pixels":
                assert request.image_png is None, case.name
                assert len(request.image_rgb) == request.width * request.height * 3, case.name
                continue
            png = request.image_png
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and png.endswith(b"IEND\xaeB`\x82"), case.name
            for marker in (b"<script", b"PK\x03\x04", b"%PDF", b"<?php", b"\x7fELF", b"<svg", b"tEXt"):
                assert marker not in png, (case.name, marker)


@pytest.mark.parametrize("prompt_set", ["1.0", "1.5"])
def test_special_tokens_never_reach_the_prompt(prompt_set):
    """Every user-text field of every prompt-building task, laden with special tokens: the prompt the engine gets
    carries none (HunyuanOCR's placeholder tokens in user text kill the vLLM engine)."""
    import random

    settings = Settings(engine="mock", prompt_set=prompt_set, **HOSTILE_SETTINGS)
    engine = MockEngine()
    rng = random.Random(7)
    image = b64(encode(page(rng), "PNG"))
    sent = 0
    with TestClient(create_app(AppContext(settings=settings, engine=engine))) as client:
        for token in SPECIAL_TOKENS:
            bodies = [
                {"task": "extract", "fields": [f"name{token}", token, f"{token}total"]},
                {"task": "extract", "schema": {"type": "object", "properties": {f"a{token}": {}, token: {}}}},
                {"task": "translate", "target_language": f"fr{token}"[:64]},
                {"task": "text", "language": f"{token}en"[:64]},
                {"task": "document", "language": token[:64]},
            ]
            for body in bodies:
                resp = client.post("/v1/ocr", json={"image": image, **body})
                assert resp.status_code == 200, (body, resp.text[:200])
                sent += 1
    prompts = [r.prompt or "" for r in engine.requests]
    assert len(prompts) == sent
    for prompt in prompts:
        for fragment in ("<｜", "｜>", "<|", "|>", "hy_place", "\x00", "\x1b"):
            assert fragment not in prompt, (fragment, prompt)


def test_no_url_is_ever_fetched():
    """An `image` that is a URL is invalid base64; nothing connects to it (no SSRF surface)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    connections = []

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                connections.append(conn)
            except OSError:
                continue

    stop = threading.Event()
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    settings = Settings(engine="mock", **HOSTILE_SETTINGS)
    try:
        with TestClient(create_app(AppContext(settings=settings, engine=MockEngine()))) as client:
            for url in (f"http://127.0.0.1:{port}/a.png", f"https://127.0.0.1:{port}/a.png",
                        f"//127.0.0.1:{port}/a.png", f"data:image/png;base64,http://127.0.0.1:{port}/"):
                resp = client.post("/v1/ocr", json={"image": url})
                assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_base64", resp.text
                resp = client.post("/v1/ocr", data={"url": url}, files={"file": ("a.png", url.encode(), "image/png")})
                assert resp.status_code in (415, 422), resp.text
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert connections == []


# --- the same inputs through real Ray Serve over real HTTP ---------------------------------------------------------

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
