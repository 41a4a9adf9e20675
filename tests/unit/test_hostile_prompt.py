"""Hostile prompts and client mistakes on the text paths: special-token sanitising, OpenAI message/prompt caps,
JSON bodies (depth, item count, strict types), model names, `Last-Event-ID`, vLLM's benchmark extensions and clients
that disconnect mid-body.

Two layers here: the sanitiser against its definition (the fixed point of the special-token regex, repeated) on
generated inputs; the app in-process around the mock engine (status codes, event-loop lag, what reaches the engine,
what is counted). The same attacks through real Ray Serve over real HTTP: tests/integration/test_hostile_prompt.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from service.config import Settings
from tests.fixtures.prompts import IMAGE, chat_body, deep_json, error_code, nested_halves

# The regex the sanitiser is defined by (service/admission/prompts.py): removal repeated until nothing changes.
SPECIAL_TOKEN = re.compile(r"<\s*[｜|][^<>]{0,128}?[｜|]\s*>|<[｜|]|[｜|]>|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# A wide margin for a loaded 2-core machine; the unbounded sanitiser held the loop for seconds on 32 KB.
MAX_LOOP_LAG_S = 0.5


def fixed_point(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, SPECIAL_TOKEN.sub("", text)
    return text


ALPHABET = ["<", ">", "｜", "|", " ", "\t", "\n", "\u3000", "\x00", "\x0b", "\x1f", "\x7f", "a", "é", "▁"]
text_chars = st.sampled_from(ALPHABET)


@st.composite
def nested_tokens(draw) -> str:
    """`<｜<｜x｜>｜>` and relatives: opening/closing halves, whole tokens and padding wrapped around each other."""
    inner = draw(st.text(text_chars, max_size=6))
    for _ in range(draw(st.integers(0, 8))):
        left = draw(st.sampled_from(["<｜", "<|", "< ｜", "<", "｜", "<\x00｜", "<\x0b|", "<\t\u3000｜", "<<"]))
        right = draw(st.sampled_from(["｜>", "|>", "｜ >", ">", "｜", "｜\x00>", "|\x0b>", ">>"]))
        pad = draw(st.text(text_chars, max_size=3))
        inner = left + pad + inner + right if draw(st.booleans()) else left + inner + pad + right
        if draw(st.booleans()):
            inner = draw(st.text(text_chars, max_size=3)) + inner
    return inner


@st.composite
def long_token_names(draw) -> str:
    """Whole tokens whose name is around the 128-character limit, some with control characters inside (removed in
    the same pass or not, which decides whether the name fits)."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        length = draw(st.sampled_from([0, 1, 126, 127, 128, 129, 130]))
        name = draw(st.text(st.sampled_from(["x", "x", "x", "｜", " ", "\x00", "\x0b", "<", ">"]),
                            min_size=length, max_size=length))
        parts.append(draw(st.sampled_from(["<", "< ", "<<", "", "<\x0b"])) + draw(st.sampled_from(["｜", "|"]))
                     + name + draw(st.sampled_from(["｜>", "｜ >", "|\x1f>", "｜", ">", "｜>>"])))
    return draw(st.sampled_from(["", "<<", "<｜"])) + "".join(parts) + draw(st.sampled_from(["", "｜>", "|||"]))


@st.composite
def half_chains(draw) -> str:
    """`<<<｜｜｜`, `｜｜｜>>>` and mixes: the inputs that need one pass per pair."""
    pairs = draw(st.integers(1, 120))
    shape = draw(st.sampled_from(["<B", "B>", "<B>", "mixed"]))
    bar = draw(st.sampled_from(["｜", "|"]))
    if shape == "<B":
        return "<" * pairs + bar * pairs
    if shape == "B>":
        return bar * pairs + ">" * pairs
    if shape == "<B>":
        return "<" * pairs + bar * (2 * pairs) + ">" * pairs
    return "".join(draw(st.lists(st.sampled_from(["<", bar, ">", " ", "x"]), min_size=pairs, max_size=pairs)))


hostile_text = st.one_of(st.text(text_chars, max_size=80), nested_tokens(), long_token_names(), half_chains(),
                         st.lists(st.one_of(nested_tokens(), half_chains(), long_token_names()), max_size=4)
                         .map("".join))


@hypothesis_settings(max_examples=1000, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_text)
def test_strip_special_tokens_is_the_fixed_point_of_the_regex(text):
    from service.admission.prompts import strip_special_tokens

    assert strip_special_tokens(text) == fixed_point(text)


@hypothesis_settings(max_examples=600, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_text, st.integers(1, 300))
def test_sanitize_user_text_cuts_first_and_equals_sanitising_then_cutting_within_the_cap(text, max_chars):
    from service.admission.prompts import sanitize_user_text

    clean = sanitize_user_text(text, max_chars)
    assert len(clean) <= max_chars and not SPECIAL_TOKEN.search(clean)
    assert "<|" not in clean and "|>" not in clean and "｜" not in clean
    if len(text) <= max_chars:  # within the cap, cutting first changes nothing: the same as sanitising then cutting
        assert clean == fixed_point(text).replace("｜", "|")[:max_chars].strip()


@pytest.mark.parametrize("size", [2_000, 8_000, 32_000])
@pytest.mark.parametrize("shape", ["<B", "B>", "<B>", "long names"])
def test_sanitising_work_grows_linearly(monkeypatch, size, shape):
    """Counted, not timed: match attempts per character stay bounded however deep the nesting (the repeated regex
    makes size/2 passes over the whole text for these)."""
    from service.admission import prompts

    text = {"<B": nested_halves(size // 2), "B>": "|" * (size // 2) + ">" * (size // 2),
            "<B>": "<" * (size // 4) + "|" * (size // 2) + ">" * (size // 4),
            "long names": ("<｜" + "x" * 127 + "｜" * 64 + ">" * 64) * (size // 383 + 1)}[shape]
    attempts = 0
    original = prompts._TokenStripper._match_end

    def counting(self, p):
        nonlocal attempts
        attempts += 1
        return original(self, p)

    monkeypatch.setattr(prompts._TokenStripper, "_match_end", counting)
    result = prompts.strip_special_tokens(text)
    assert not SPECIAL_TOKEN.search(result)
    assert attempts <= 3 * len(text), (attempts, len(text))


class _Keys:
    """Authenticator: `Bearer admin` is an admin, anything else the user tenant `acme`."""

    def authenticate(self, headers):
        from service.admission.auth import Principal

        if headers.get("authorization") == "Bearer admin":
            return Principal(tenant="ops", role="admin")
        return Principal(tenant="acme", role="user")


class _RecordingMetrics:
    """IngressMetrics' request hook, recorded."""

    def __init__(self):
        from service.observability.metrics import IngressMetrics

        self.inner = IngressMetrics()
        self.finished: list[tuple[int, str]] = []

    def request_finished(self, *, status, code, **_):
        self.finished.append((status, code))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_app(engine_delay_s: float = 0.0):
    from service.http.app import create_app
    from service.pipeline.context import AppContext
    from service.engine.mock import MockEngine

    settings = Settings(engine="mock", rate_limit_enabled=False)
    engine = MockEngine(delay_s=engine_delay_s)
    ctx = AppContext(settings=settings, engine=engine, authenticator=_Keys(), metrics=_RecordingMetrics())
    return create_app(ctx), engine, ctx


@pytest.fixture
async def app_client():
    app, engine, ctx = make_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as client:
        yield client, engine, ctx


async def loop_lag_during(coro) -> tuple[object, float]:
    """(result of `coro`, longest the event loop went without running a 1 ms ticker meanwhile)."""
    done = asyncio.Event()
    longest = 0.0

    async def ticker():
        nonlocal longest
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    try:
        result = await coro
    finally:
        done.set()
        await task
    return result, longest


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_oversized_instruction_is_refused_before_any_work_on_it(app_client, path):
    """32 KB of nested halves as the instruction: 400 `prompt_too_long`, the event loop never held (the unbounded
    repeated regex took seconds here, on the loop)."""
    client, engine, _ = app_client
    text = nested_halves(16 * 1024)  # 32 KiB
    body = chat_body(text) if path == "/v1/chat/completions" else \
        {"model": "mock-ocr", "max_tokens": 4, "prompt": text, "image": IMAGE}
    resp, lag = await loop_lag_during(client.post(path, json=body))
    assert error_code(resp) == (400, "prompt_too_long"), resp.text
    assert lag < MAX_LOOP_LAG_S, f"event loop held {lag:.3f}s"
    assert engine.requests == []


async def test_instruction_at_the_cap_is_sanitised_off_the_loop(app_client):
    client, engine, ctx = app_client
    cap = ctx.settings.limits.max_text_field_chars
    for text in (nested_halves(cap // 2), nested_halves(cap // 2, "｜"), "<" * (cap // 4) + "|" * (cap // 2) + ">" *
                 (cap // 4), "Read " + "<｜<｜hy_User｜>｜>" * (cap // 20)):
        resp, lag = await loop_lag_during(client.post("/v1/chat/completions", json=chat_body(text[:cap])))
        assert resp.status_code == 200, resp.text
        assert lag < MAX_LOOP_LAG_S, f"event loop held {lag:.3f}s"
        prompt = engine.requests[-1].prompt
        assert not SPECIAL_TOKEN.search(prompt) and "<|" not in prompt and "|>" not in prompt
    # a text that sanitises to nothing asks for the default instruction
    assert engine.requests[0].prompt == engine.requests[1].prompt


async def test_extraction_fields_of_nested_fragments_are_sanitised(app_client):
    client, engine, ctx = app_client
    cap, count = ctx.settings.limits.max_text_field_chars, ctx.settings.limits.max_fields
    fields = [f"f{i}" + nested_halves(cap // 2 - 2) for i in range(count)]
    resp, lag = await loop_lag_during(client.post("/v1/ocr", json={"image": IMAGE, "task": "extract",
                                                                   "fields": fields}))
    assert resp.status_code == 200, resp.text
    assert lag < MAX_LOOP_LAG_S, f"event loop held {lag:.3f}s"
    prompt = engine.requests[-1].prompt
    assert "'f0', 'f1'" in prompt and "'f63']" in prompt and not SPECIAL_TOKEN.search(prompt)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/ocr"])
@pytest.mark.parametrize("depth,answer", [(201, (400, "invalid_request")), (1_000, (400, "invalid_request")),
                                          (5_000, (400, "invalid_request")), (100_000, (413, "payload_too_large"))])
async def test_deeply_nested_json_is_a_4xx(app_client, path, depth, answer):
    """Deeper than the parser's 200 levels: invalid JSON; more brackets than `max_json_items`: not even parsed."""
    client, _, _ = app_client
    resp = await client.post(path, content=deep_json(depth), headers={"content-type": "application/json"})
    assert error_code(resp) == answer, resp.text


async def test_json_bodies_with_too_many_items_are_refused_before_parsing(app_client):
    """Two million tiny values in an ignored field: 413 before the parser runs, the loop barely held."""
    client, _, ctx = app_client
    body = json.dumps(chat_body()).encode()[:-1] + b', "user": [' + b"0," * 2_000_000 + b"0]}"
    resp, lag = await loop_lag_during(client.post("/v1/chat/completions", content=body))
    assert error_code(resp) == (413, "payload_too_large"), resp.text
    assert lag < MAX_LOOP_LAG_S, f"event loop held {lag:.3f}s"
    within = json.dumps(chat_body()).encode()[:-1] + b', "user": [' + b"0," * 1_000 + b"0]}"
    assert (await client.post("/v1/chat/completions", content=within)).status_code == 200


async def test_message_and_part_counts_are_bounded(app_client):
    from service.http.openai.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES

    client, _, _ = app_client
    system = {"role": "system", "content": "be brief"}
    body = chat_body()
    many = {**body, "messages": [system] * MAX_MESSAGES + body["messages"]}
    assert error_code(await client.post("/v1/chat/completions", json=many)) == (422, "validation_error")
    parts = body["messages"][0]["content"]
    crowded = {**body, "messages": [{"role": "user", "content": parts + [parts[1]] * MAX_CONTENT_PARTS}]}
    assert error_code(await client.post("/v1/chat/completions", json=crowded)) == (422, "validation_error")


async def test_model_names_longer_than_an_adapter_name_are_a_422(app_client):
    client, _, _ = app_client
    resp = await client.post("/v1/chat/completions", json=chat_body(model="m" * 129))
    assert error_code(resp) == (422, "validation_error"), resp.text
    resp = await client.post("/v1/completions", json={"model": "m" * 129, "prompt": "x", "image": IMAGE})
    assert error_code(resp) == (422, "validation_error"), resp.text
    resp = await client.post("/v1/chat/completions", json=chat_body(model="m" * 128))  # a name, not an adapter
    assert error_code(resp) == (404, "model_not_found"), resp.text


WRONG_TYPES = [
    ("/v1/chat/completions", {"max_tokens": "10"}), ("/v1/chat/completions", {"stream": "yes"}),
    ("/v1/chat/completions", {"stream": 1}), ("/v1/chat/completions", {"logprobs": "true"}),
    ("/v1/chat/completions", {"temperature": "0"}), ("/v1/chat/completions", {"max_completion_tokens": 10.5}),
    ("/v1/chat/completions", {"stream_options": {"include_usage": "yes"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/completions", {"max_tokens": "10"}), ("/v1/completions", {"stream": "yes"}),
    ("/v1/completions", {"logprobs": "1"}), ("/v1/completions", {"echo": "false"}),
    ("/v1/ocr", {"max_tokens": "10"}), ("/v1/ocr", {"stream": "yes"}), ("/v1/ocr", {"confidence": 0}),
    ("/v1/ocr", {"include_raw": "false"}), ("/v1/ocr", {"fields": "a,b", "task": "extract"}),
]


@pytest.mark.parametrize("path,fields", WRONG_TYPES, ids=[f"{p}-{json.dumps(f)[:30]}" for p, f in WRONG_TYPES])
async def test_wrong_json_types_are_a_422(app_client, path, fields):
    client, _, _ = app_client
    base = {"/v1/chat/completions": chat_body(), "/v1/completions": {"prompt": "x", "image": IMAGE},
            "/v1/ocr": {"image": IMAGE, "task": "text"}}[path]
    resp = await client.post(path, json={**base, **fields})
    assert error_code(resp) == (422, "validation_error"), resp.text


async def test_form_fields_stay_text(app_client):
    """Multipart form fields are text by nature: `max_tokens=10`, `stream=false` keep working there."""
    client, _, _ = app_client
    png = base64.b64decode(IMAGE.split(",", 1)[1])
    resp = await client.post("/v1/ocr", files={"file": ("a.png", png, "image/png")},
                             data={"task": "text", "max_tokens": "10", "stream": "false", "confidence": "true"})
    assert resp.status_code == 200, resp.text


async def test_what_the_official_openai_client_sends_is_accepted(app_client):
    import openai

    client, engine, _ = app_client
    api = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=client, max_retries=0)
    chat = await api.chat.completions.create(
        model="mock-ocr", messages=chat_body()["messages"], max_tokens=4, max_completion_tokens=4, temperature=0,
        top_p=1, n=1, seed=1, user="u", logprobs=True, top_logprobs=0, stop=["\n\n"], presence_penalty=0,
        frequency_penalty=0, response_format={"type": "json_object"})
    assert chat.choices[0].message.content is not None
    stream = await api.chat.completions.create(model="mock-ocr", messages=chat_body()["messages"], max_tokens=4,
                                               stream=True, stream_options={"include_usage": True})
    assert [chunk async for chunk in stream]
    completion = await api.completions.create(model="mock-ocr", prompt="Read the text.", max_tokens=4, logprobs=1,
                                              temperature=0.0, extra_body={"image": IMAGE, "repetition_penalty": 1.05})
    assert completion.choices[0].text is not None


async def test_benchmark_extensions_need_an_admin_key(app_client):
    client, engine, _ = app_client
    for extension in ({"ignore_eos": True}, {"min_tokens": 3}, {"ignore_eos": True, "min_tokens": 4}):
        resp = await client.post("/v1/chat/completions", json=chat_body(**extension))
        assert error_code(resp) == (403, "forbidden"), resp.text
        resp = await client.post("/v1/completions", json={"prompt": "x", "image": IMAGE, "max_tokens": 4, **extension})
        assert error_code(resp) == (403, "forbidden"), resp.text
    assert engine.requests == []
    # the defaults are not extensions
    resp = await client.post("/v1/chat/completions", json=chat_body(ignore_eos=False, min_tokens=0))
    assert resp.status_code == 200
    admin = {"authorization": "Bearer admin"}
    resp = await client.post("/v1/chat/completions", json=chat_body(ignore_eos=True, min_tokens=1000), headers=admin)
    assert resp.status_code == 200, resp.text
    sent = engine.requests[-1]
    assert sent.ignore_eos and sent.min_tokens == sent.max_tokens == 4


@pytest.mark.parametrize("last_event_id", ["9" * 5000, "1" * 10, "-1", "1.5", "abc", "²".encode("latin-1"),
                                           "١".encode()], ids=["5000 digits", "10 digits", "-1", "1.5", "abc",
                                                              "superscript two", "arabic-indic one"])
async def test_bad_last_event_ids_are_a_400(app_client, last_event_id):
    client, _, _ = app_client
    png = base64.b64decode(IMAGE.split(",", 1)[1])
    job = (await client.post("/v1/jobs", files=[("file", ("a.png", png, "image/png"))], data={"task": "text"})).json()
    resp = await client.get(job["links"]["events"], headers={"Last-Event-ID": last_event_id})
    assert error_code(resp) == (400, "invalid_request"), resp.text
    resp = await client.get(job["links"]["events"], headers={"Last-Event-ID": "999999999"})
    assert resp.status_code == 200 and "event: done" in resp.text


async def test_a_client_gone_mid_body_is_counted_as_disconnected_not_as_a_500(caplog):
    """The ASGI server reports the disconnect while the body is read: no error logged, no 5xx counted."""
    app, engine, ctx = make_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        await client.get("/healthz")  # lifespan-free app: nothing to start, but the first call warms the imports
    sent: list[dict] = []
    for path in ("/v1/ocr", "/v1/chat/completions", "/v1/completions"):
        messages = iter([{"type": "http.request", "body": b'{"image": "' + b"A" * 1000, "more_body": True},
                         {"type": "http.disconnect"}])

        async def receive():
            return next(messages)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"100000")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        with caplog.at_level("DEBUG"):
            await app(scope, receive, send)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
    assert ctx.metrics.finished == [(499, "client_disconnected")], ctx.metrics.finished  # /v1/ocr is counted
    assert all(m.get("status", 0) < 500 for m in sent if m["type"] == "http.response.start")
    assert engine.requests == []


async def test_a_body_read_that_serves_proxy_cancelled_is_counted_as_disconnected(caplog):
    """Through Serve's proxy a client gone mid-body reaches the replica as TaskCancelledError from `receive()`, not
    as `http.disconnect`: the replica's app (service/serve/deployments.py) counts it as 499 all the same."""
    from ray.exceptions import TaskCancelledError

    from service.serve.deployments import ProxyCancelAsDisconnect

    app, engine, ctx = make_app()
    app.add_middleware(ProxyCancelAsDisconnect)
    sent: list[dict] = []
    first = True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"image": "' + b"A" * 1000, "more_body": True}
        raise TaskCancelledError()

    async def send(message):
        sent.append(message)

    path = "/v1/ocr"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100000")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    with caplog.at_level("DEBUG"):
        await app(scope, receive, send)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
    assert ctx.metrics.finished == [(499, "client_disconnected")], ctx.metrics.finished
    assert all(m.get("status", 0) < 500 for m in sent if m["type"] == "http.response.start")
    assert engine.requests == []


async def test_a_request_cancelled_before_its_answer_is_counted_as_disconnected():
    """Serve cancels the replica's request when its proxy sees the client go."""
    app, engine, ctx = make_app(engine_delay_s=5.0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        task = asyncio.create_task(client.post("/v1/ocr", json={"image": IMAGE, "task": "text"}))
        while not engine.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert ctx.metrics.finished == [(499, "client_disconnected")]
