"""Bad-input matrix: >= 12 kinds x >= 50 generated hostile requests (tests/fixtures/hostile.py) against the API
in-process around the mock engine: every answer must be a 4xx whose body carries a documented error code with its
documented status, or a 200 where the input is legal (odd colour modes, sizes just below the caps). No 5xx, bounded
RSS growth. What reaches the engine carries no byte of the upload's container and no special token; no URL is ever
fetched. The same matrix against the real embedded engine, in-process and through Ray Serve:
tests/integration/test_hostile_inputs.py.
"""

from __future__ import annotations

import socket
import threading

import pytest
from starlette.testclient import TestClient

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.config import Settings
from tests.fixtures.hostile import (HOSTILE_SETTINGS, MAX_FIRST_PASS_GROWTH_BYTES, MAX_STEADY_GROWTH_BYTES,
                                    SPECIAL_TOKENS, HostileCase, b64, encode, matrix, page, run_matrix_in_process)


MIN_KINDS = 12
MIN_CASES_PER_KIND = 50


@pytest.fixture(scope="module")
def cases() -> dict[str, list[HostileCase]]:
    return matrix()


def test_matrix_shape(cases):
    assert len(cases) >= MIN_KINDS, sorted(cases)
    for kind, kind_cases in cases.items():
        assert len(kind_cases) >= MIN_CASES_PER_KIND, (kind, len(kind_cases))
        assert any("ok" not in c.expect for c in kind_cases), f"{kind} has no case that must be refused"
        assert len({c.name for c in kind_cases}) == len(kind_cases), f"{kind} has duplicate case names"


@pytest.fixture(scope="module")
def admission_client():
    """The API in-process around the mock engine: every layer in front of the engine seam is the real one."""
    settings = Settings(engine="mock", **HOSTILE_SETTINGS)
    with TestClient(create_app(AppContext(settings=settings, engine=MockEngine())),
                    raise_server_exceptions=False) as client:
        yield client


def test_bad_input_matrix_in_process(admission_client, cases):
    run = run_matrix_in_process(admission_client, cases)
    print("\n" + run.report())
    assert not run.problems, "\n".join(run.problems)
    assert run.first_growth < MAX_FIRST_PASS_GROWTH_BYTES, f"RSS grew {run.first_growth / 2**20:.0f} MiB"
    assert run.steady_growth < MAX_STEADY_GROWTH_BYTES, \
        f"RSS grew {run.steady_growth / 2**20:.0f} MiB on the second pass"


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
