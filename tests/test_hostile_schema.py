"""Hostile JSON Schemas: an extraction `schema`, a chat `response_format` schema, `ocr-serve parse --schema`.

No schema ever causes network access (only references within the document resolve; everything else is refused at
admission with 400 `invalid_schema`, and the validators' registry retrieves nothing), schema checks and output
validation run off the event loop, tenant regexes are matched by RE2 (never Python's backtracking `re`), references
that fan out stop at `max_schema_validation_steps`, and the chat endpoint admits its schema as `extract` does, before
the engine sees it. In-process with the mock engine, then through real Ray Serve over real HTTP (loopback listeners
stand in for a metadata service and a black-holed address).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import threading
import time
import types
from contextlib import contextmanager

import httpx
import pytest
from PIL import Image
from starlette.testclient import TestClient

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.config import Settings
from tests.fixtures.hostile import HOSTILE_SETTINGS

DRAFT_2019 = "https://json-schema.org/draft/2019-09/schema"
DRAFT_04 = "http://json-schema.org/draft-04/schema#"
CHAT_WHERE = "response_format.json_schema.schema:"
LIVENESS_BOUND_S = 5.0  # /healthz while a hostile schema is handled (measured: 11-106 ms; unfixed: the tarpit's 15 s)


def png_b64() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


PNG = png_b64()


@contextmanager
def mock_client(responder=None, **overrides):
    engine = MockEngine(responder=responder)
    settings = Settings(engine="mock", **{**HOSTILE_SETTINGS, **overrides})
    with TestClient(create_app(AppContext(settings=settings, engine=engine)), raise_server_exceptions=False) as client:
        yield client, engine


def chat_body(schema) -> dict:
    return {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def remote_schemas(listener) -> dict[str, dict]:
    """Schemas whose validation would reach `listener` if anything were fetched."""
    url = listener.url()
    return {
        "http $ref": {"type": "object", "properties": {"mock": {"$ref": url}}},
        "https $ref": {"type": "object", "properties": {"mock": {"$ref": listener.url(scheme="https")}}},
        "$id-relative $ref": {"$id": listener.url("/base/"), "type": "object",
                              "properties": {"mock": {"$ref": "other.json"}}},
        "draft-04 id-relative $ref": {"$schema": DRAFT_04, "id": listener.url("/d4/"), "type": "object",
                                      "properties": {"mock": {"$ref": "other.json#"}}},
        "$ref behind a local $ref": {"type": "object", "$defs": {"hop": {"$ref": url}},
                                     "properties": {"mock": {"$ref": "#/$defs/hop"}}},
        "$dynamicRef": {"type": "object", "properties": {"mock": {"$dynamicRef": url + "#meta"}}},
        "$recursiveRef": {"$schema": DRAFT_2019, "type": "object", "properties": {"mock": {"$recursiveRef": url}}},
        "remote $schema": {"$schema": url, "type": "object", "properties": {"mock": {}}},
        "file $ref": {"type": "object", "properties": {"mock": {"$ref": "file:///etc/hostname"}}},
        "protocol-relative $ref": {"type": "object", "properties": {"mock": {"$ref": f"//127.0.0.1:{listener.port}/"}}},
    }


# --- in-process (fast tier) ----------------------------------------------------------------------------------------

def test_no_schema_reaches_the_network_through_any_endpoint(recording_listener, tmp_path):
    """Every outward reference is a 400 `invalid_schema` on /v1/ocr (JSON and multipart), /v1/jobs and the chat
    endpoint, before the engine runs; nothing ever connects."""
    problems = []
    with mock_client() as (client, engine):
        for name, schema in remote_schemas(recording_listener).items():
            answers = {
                "ocr json": client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": schema}),
                "ocr multipart": client.post("/v1/ocr", data={"task": "extract", "schema": json.dumps(schema)},
                                             files={"file": ("p.png", base64.b64decode(PNG), "image/png")}),
                "jobs": client.post("/v1/jobs", data={"task": "extract", "schema": json.dumps(schema)},
                                    files={"file": ("p.png", base64.b64decode(PNG), "image/png")}),
                "chat": client.post("/v1/chat/completions", json=chat_body(schema)),
            }
            for where, resp in answers.items():
                if resp.status_code != 400 or resp.json()["error"]["code"] != "invalid_schema":
                    problems.append(f"{name} via {where}: {resp.status_code} {resp.text[:160]}")
        assert engine.requests == []
    assert not problems, "\n".join(problems)
    assert recording_listener.connections == 0


def test_refusals_say_what_is_wrong(recording_listener):
    with mock_client() as (client, _):
        resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract",
                                            "schema": remote_schemas(recording_listener)["http $ref"]})
        message = resp.json()["error"]["message"]
        assert message.startswith("schema: $ref ") and "/properties/mock/$ref" in message
        assert "nothing is fetched" in message
        resp = client.post("/v1/chat/completions", json=chat_body({"$ref": "#/$defs/missing"}))
        assert resp.json()["error"]["message"] == (f'{CHAT_WHERE} $ref "#/$defs/missing" does not resolve within '
                                                   "the schema")


def test_validation_fetches_nothing_even_without_admission(recording_listener):
    """Defence in depth: extraction output validated against schemas admission never saw (a remote `$ref`, a base
    URI moved by `$id` so that a `#…` reference names a document that is not there) reports an error, no fetch."""
    from service.admission.schemas import SchemaValidationStopped, output_errors
    from service.parsing.extraction import extract_fields

    result = extract_fields('{"mock": "value"}', fields=None, schema=remote_schemas(recording_listener)["http $ref"])
    assert result.fields["mock"].valid is False and "refers outside the schema" in result.errors[0]
    moved = {"$id": recording_listener.url("/root"), "type": "object",
             "properties": {"mock": {"$id": recording_listener.url("/elsewhere"), "$ref": "#/$defs/x"}}}
    with pytest.raises(SchemaValidationStopped, match="does not resolve"):
        output_errors(moved, {"mock": "value"}, 10_000)
    assert recording_listener.connections == 0


def test_local_references_keep_working():
    """What admission lets through validates as before: JSON pointers, anchors, draft-07 `definitions`, a nested
    `$id` resource referred to with `#`, recursion through `items`, and RE2-only syntax such as `\\p{L}`."""
    schema = {
        "type": "object",
        "$defs": {"amount": {"type": "number", "minimum": 0}, "word": {"$anchor": "word", "pattern": "^\\p{L}+$"},
                  "node": {"$id": "urn:node", "type": "object", "properties": {"kids": {"type": "array",
                                                                                          "items": {"$ref": "#"}}}}},
        "properties": {"total": {"$ref": "#/$defs/amount"}, "name": {"$ref": "#word"},
                       "tree": {"$ref": "#/$defs/node"}},
        "required": ["total", "name"],
    }
    output = json.dumps({"total": -3, "name": "Zoë", "tree": {"kids": [{"kids": 5}]}})
    with mock_client(responder=lambda request: output) as (client, _):
        resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": schema})
        assert resp.status_code == 200, resp.text
        fields = resp.json()["fields"]
        assert fields["name"]["valid"] is True and fields["total"]["valid"] is False
        assert fields["tree"]["valid"] is False  # kids: 5 is not an array, found through the recursive `#`
        draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                  "definitions": {"amount": {"type": "number", "minimum": 0}},
                  "properties": {"total": {"$ref": "#/definitions/amount"}}}
        resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": draft7})
        assert resp.status_code == 200 and resp.json()["fields"]["total"]["valid"] is False


def test_schema_work_never_runs_on_the_event_loop(monkeypatch):
    """The schema check (extract and chat) and the output validation are called from worker threads only."""
    import service.http.openai.router
    import service.parsing.extraction
    import service.pipeline.admit

    calls: list[tuple[str, bool]] = []

    def off_loop_probe(name, function):
        def probe(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                calls.append((name, True))
            except RuntimeError:
                calls.append((name, False))
            return function(*args, **kwargs)
        return probe

    for module, name in ((service.pipeline.admit, "check_schema"), (service.http.openai.router, "check_schema"),
                         (service.parsing.extraction, "output_errors")):
        monkeypatch.setattr(module, name, off_loop_probe(f"{module.__name__}.{name}", getattr(module, name)))
    schema = {"type": "object", "properties": {"mock": {"type": "string"}}}
    with mock_client() as (client, _):
        assert client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": schema}).status_code == 200
        resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": schema, "stream": True})
        assert resp.status_code == 200 and "event: result" in resp.text
        assert client.post("/v1/chat/completions", json=chat_body(schema)).status_code == 200
    names = {name for name, _ in calls}
    assert names == {"service.pipeline.admit.check_schema", "service.http.openai.router.check_schema",
                     "service.parsing.extraction.output_errors"}, calls
    assert [call for call in calls if call[1]] == [], "schema work ran on the event loop"


@pytest.mark.timeout(120)
def test_catastrophic_patterns_are_linear_time():
    """`^(a+)+$` against 40 a's and a `!` takes Python's `re` ~2^40 steps; RE2 answers at once. Keys are matched by
    RE2 too (`patternProperties`, and `additionalProperties` beside them)."""
    evil = "a" * 40 + "!"
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(a+)+$"}},
              "patternProperties": {"^(a|aa)+$": {"type": "integer"}}, "additionalProperties": False}
    with mock_client(responder=lambda request: json.dumps({"code": evil, evil: 1})) as (client, _):
        started = time.perf_counter()
        resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": schema})
        took = time.perf_counter() - started
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["fields"]["code"]["valid"] is False
    assert any("does not match" in e for e in body["errors"]) and any("Additional properties" in e
                                                                     for e in body["errors"])
    print(f"\nextract with catastrophic patterns: {took * 1000:.0f} ms")


def test_python_re_never_sees_a_tenant_pattern(monkeypatch):
    """jsonschema's own keyword code calls `re.search`; with `re` made unusable there, admission and validation in
    every draft still give the right answers (so they never reach it)."""
    import jsonschema._format
    import jsonschema._keywords
    import jsonschema._legacy_keywords
    import jsonschema._utils

    from service.admission.schemas import check_schema
    from service.parsing.extraction import extract_fields

    def refuse(*args, **kwargs):
        raise AssertionError(f"Python re used with {args[:1]!r}")

    unusable = types.SimpleNamespace(search=refuse, match=refuse, fullmatch=refuse, compile=refuse, findall=refuse)
    for module in (jsonschema._keywords, jsonschema._legacy_keywords, jsonschema._utils, jsonschema._format):
        monkeypatch.setattr(module, "re", unusable)
    output = '{"id": "AB-12", "x_note": 5, "zzz": 1}'
    for draft in (DRAFT_04, "http://json-schema.org/draft-07/schema#", DRAFT_2019,
                  "https://json-schema.org/draft/2020-12/schema"):
        schema = {"$schema": draft, "type": "object",
                  "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}},
                  "patternProperties": {"^x_": {"type": "string"}}, "additionalProperties": False}
        if draft != DRAFT_04:
            schema["propertyNames"] = {"pattern": "^[a-z_]+$"}
        check_schema(schema, Settings())
        result = extract_fields(output, fields=None, schema=schema)
        joined = "\n".join(result.errors)
        assert "'AB-12' does not match" in joined and "x_note: 5 is not of type 'string'" in joined, (draft, joined)
        assert "'zzz' was unexpected" in joined, (draft, joined)


def _fan_out_schema(levels: int = 40) -> dict:
    """2.8 KB whose validation, unbounded, takes 2^40 keyword evaluations."""
    defs = {"d0": {"type": "string"}}
    for i in range(1, levels):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]}
    return {"type": "object", "$defs": defs, "properties": {"mock": {"$ref": f"#/$defs/d{levels - 1}"}}}


@pytest.mark.timeout(120)
def test_reference_fan_out_stops_at_the_step_budget():
    with mock_client(max_schema_validation_steps=20_000) as (client, _):
        resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": _fan_out_schema()})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["fields"]["mock"] == {"value": "value", "confidence": body["fields"]["mock"]["confidence"],
                                          "valid": False}
        assert body["errors"] == ["(root): validation stopped after 20000 steps (max_schema_validation_steps); "
                                  "the fields are not validated"]
        loop = client.post("/v1/ocr", json={"image": PNG, "task": "extract",
                                            "schema": {"type": "object", "properties": {"mock": {}}, "$ref": "#"}})
        assert loop.status_code == 200 and loop.json()["errors"] == [
            "(root): the schema's references recurse without end"]


def chat_refusals() -> dict[str, dict]:
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    return {
        "400 KB": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                                    for i in range(2700)}},
        "40 deep": deep,
        "invalid regex": {"type": "string", "pattern": "(unclosed"},
        "backreference": {"type": "string", "pattern": "(a)\\1"},
        "look-ahead key": {"type": "object", "patternProperties": {"(?=a)": {}}},
        "too many properties": {"type": "object", "properties": {f"p{i}": {} for i in range(65)}},
        "not a schema": {"type": 12},
        "unknown $schema": {"$schema": "https://example.invalid/schema", "type": "object"},
        "dangling $ref": {"$ref": "#/definitions/none"},
    }


@pytest.mark.parametrize("name", list(chat_refusals()))
def test_chat_response_format_gets_the_extract_limits(name):
    schema = chat_refusals()[name]
    with mock_client() as (client, engine):
        resp = client.post("/v1/chat/completions", json=chat_body(schema))
        extract = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": schema})
        assert engine.requests == [], "the schema reached the engine"
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_schema", resp.text
    assert resp.json()["error"]["message"].startswith(CHAT_WHERE)
    assert extract.status_code == 400 and extract.json()["error"]["code"] == "invalid_schema", extract.text


def test_chat_response_format_that_passes_reaches_the_engine():
    schema = {"type": "object", "$defs": {"n": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/n"}}}
    with mock_client() as (client, engine):
        assert client.post("/v1/chat/completions", json=chat_body(schema)).status_code == 200
        json_object = {**chat_body({}), "response_format": {"type": "json_object"}}
        assert client.post("/v1/chat/completions", json=json_object).status_code == 200
    assert [r.guided_json for r in engine.requests] == [schema, {"type": "object"}]


def test_cli_parse_with_a_remote_ref_fetches_nothing(recording_listener, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "object", "properties": {"total": {"$ref": recording_listener.url()}}}))
    proc = subprocess.run([sys.executable, "-m", "service.cli", "parse", "--task", "extract", "--schema", str(path),
                           "--width", "10", "--height", "10"], input='{"total": 1}', capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "refers outside the schema" in proc.stderr
    assert recording_listener.connections == 0


# --- through real Ray Serve over real HTTP -------------------------------------------------------------------------

@pytest.mark.ray
def test_hostile_schemas_through_serve(serve_app, recording_listener, tarpit_listener):
    """The attacks against the deployed service: outward references refused with no connection, a black-holed one
    and a 2^40 fan-out while /healthz is polled (liveness stays fast), the chat endpoint's oversized, deep and
    invalid-regex schemas refused before the engine."""
    url = serve_app(engine="mock", **HOSTILE_SETTINGS)
    latencies: list[float] = []
    stop = threading.Event()

    def poll_liveness():
        with httpx.Client(base_url=url, timeout=120) as probe:
            while not stop.is_set():
                started = time.perf_counter()
                probe.get("/healthz")
                latencies.append(time.perf_counter() - started)
                time.sleep(0.05)

    poller = threading.Thread(target=poll_liveness)
    with httpx.Client(base_url=url, timeout=120) as client:
        for name, schema in remote_schemas(recording_listener).items():
            resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": schema})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_schema", (name, resp.text)
            resp = client.post("/v1/chat/completions", json=chat_body(schema))
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_schema", (name, resp.text)
        poller.start()
        try:
            time.sleep(0.5)
            blackholed = {"type": "object", "properties": {"mock": {"$ref": tarpit_listener.url()}}}
            resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": blackholed})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_schema", resp.text
            resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": _fan_out_schema()})
            assert resp.status_code == 200 and resp.json()["errors"][0].startswith(
                "(root): validation stopped after"), resp.text
            time.sleep(0.5)
        finally:
            stop.set()
            poller.join()
        for name in ("400 KB", "40 deep", "invalid regex"):
            resp = client.post("/v1/chat/completions", json=chat_body(chat_refusals()[name]))
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_schema", (name, resp.text)
    print(f"\n/healthz during hostile schemas: {len(latencies)} polls, max {max(latencies) * 1000:.0f} ms")
    assert recording_listener.connections == 0 and tarpit_listener.connections == 0
    assert latencies and max(latencies) < LIVENESS_BOUND_S
