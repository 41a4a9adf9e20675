"""Hostile JSON Schemas in-process (mock engine): an extraction `schema`, a chat `response_format` schema,
`ocr-serve parse --schema`.

No schema ever causes network access (only references within the document resolve; everything else is refused at
admission with 400 `invalid_schema`, and the validators' registry retrieves nothing), schema checks and output
validation run off the event loop, tenant regexes are matched by RE2 (never Python's backtracking `re`), references
that fan out stop at `max_schema_validation_steps`, and the chat endpoint admits its schema as `extract` does, before
the engine sees it (loopback listeners stand in for a metadata service). The same attacks through real Ray Serve:
tests/integration/test_hostile_schema.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
import types
from contextlib import contextmanager

import pytest
from starlette.testclient import TestClient

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.config import Settings
from tests.fixtures.hostile import HOSTILE_SETTINGS
from tests.fixtures.schemas import DRAFT_04, DRAFT_2019, PNG, chat_body, chat_refusals, fan_out_schema, remote_schemas

CHAT_WHERE = "response_format.json_schema.schema:"


@contextmanager
def mock_client(responder=None, **overrides):
    engine = MockEngine(responder=responder)
    settings = Settings(engine="mock", **{**HOSTILE_SETTINGS, **overrides})
    with TestClient(create_app(AppContext(settings=settings, engine=engine)), raise_server_exceptions=False) as client:
        yield client, engine


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


@pytest.mark.timeout(120)
def test_reference_fan_out_stops_at_the_step_budget():
    with mock_client(max_schema_validation_steps=20_000) as (client, _):
        resp = client.post("/v1/ocr", json={"image": PNG, "task": "extract", "schema": fan_out_schema()})
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
