"""The OpenAPI document is complete and true: valid OpenAPI 3.1 (openapi-spec-validator), every `$ref` resolves, the
bodies the routes parse themselves are documented with the limits this app runs with, and the API enforces exactly
those; the security schemes follow the mode. A Python client generated from the document: tests/integration/
test_openapi_client.py. Schemathesis over the whole document: tests/unit/test_fuzz_openapi.py (in-process) and
tests/integration/test_openapi_schemathesis.py (its runner, warnings fatal)."""

from __future__ import annotations

import base64
import io

import httpx
from openapi_spec_validator import validate

from service.cli.keys import add_key
from service.config import Settings
from service.engine.mock import MockEngine
from service.http.app import create_app
from service.pipeline.context import AppContext, build_context


def mock_app(**settings):
    settings = {"engine": "mock", "rate_limit_enabled": False, **settings}
    return create_app(AppContext(settings=Settings(**settings), engine=MockEngine(adapters=["tuned"])))


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def png_b64(size=(64, 32)) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, "white").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def refs_in(node, found: list[str]) -> list[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            found.append(node["$ref"])
        for value in node.values():
            refs_in(value, found)
    elif isinstance(node, list):
        for value in node:
            refs_in(value, found)
    return found


def resolve(doc: dict, ref: str):
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_the_document_is_valid_openapi_and_every_reference_resolves():
    doc = mock_app().openapi()
    validate(doc)  # the OpenAPI 3.1 meta-schema and the specification's rules
    refs = refs_in(doc, [])
    assert "#/components/schemas/OCRRequest" in refs and "#/components/schemas/ErrorResponse" in refs
    for ref in set(refs):
        resolve(doc, ref)
    ocr = doc["paths"]["/v1/ocr"]["post"]["requestBody"]["content"]
    assert set(ocr) == {"application/json", "multipart/form-data"}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/jobs"):  # bodies the routes read themselves
        assert doc["paths"][path]["post"]["requestBody"]["required"] is True
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # our 422 is the error envelope
    operation_ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(operation_ids) == len(set(operation_ids)) and "ocr" in operation_ids


async def test_security_schemes_follow_the_mode(tmp_path):
    open_doc = mock_app().openapi()
    assert set(open_doc["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    assert open_doc["components"]["securitySchemes"]["apiKey"]["name"] == "X-API-Key"
    assert open_doc["paths"]["/v1/ocr"]["post"]["security"] == [{"bearer": []}, {"apiKey": []}, {}]
    assert "security" not in open_doc["paths"]["/healthz"]["get"]  # probes carry no key

    keys = tmp_path / "keys.yaml"
    key, _ = add_key(keys, tenant="acme")
    ctx = build_context(Settings(engine="mock", api_keys_file=keys, rate_limit_enabled=False), MockEngine())
    app = create_app(ctx)
    keyed = app.openapi()
    assert keyed["paths"]["/v1/ocr"]["post"]["security"] == [{"bearer": []}, {"apiKey": []}]
    async with client_of(app) as client:  # both documented schemes work
        for headers in ({"Authorization": f"Bearer {key}"}, {"X-API-Key": key}):
            resp = await client.get("/v1/models", headers=headers)
            assert resp.status_code == 200, resp.text
        resp = await client.get("/v1/models")
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"


async def test_documented_limits_are_the_settings_the_api_enforces():
    app = mock_app(max_fields=3, max_text_field_chars=40)
    schemas = app.openapi()["components"]["schemas"]
    fields = schemas["OCRRequest"]["properties"]["fields"]["anyOf"][0]
    assert fields["maxItems"] == 3 and fields["items"]["maxLength"] == 40
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0]["maxLength"] == 40 and prompt[1]["maxItems"] == 1
    content = {b.get("type"): b for b in schemas["ChatMessage"]["properties"]["content"]["anyOf"]}
    assert content["string"]["maxLength"] == 40 and content["array"]["maxItems"] == 16
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user"]
    assert schemas["CompletionRequest"]["properties"]["echo"]["const"] is False
    image = png_b64()
    async with client_of(app) as client:
        async def ocr(**body):
            return await client.post("/v1/ocr", json={"image": image, **body})

        assert (await ocr(task="extract", fields=["a", "b", "c"])).status_code == 200
        assert (await ocr(task="extract", fields=["a", "b", "c", "d"])).status_code == 422
        assert (await ocr(task="extract", fields=["x" * 40])).status_code == 200
        assert (await ocr(task="extract", fields=["x" * 41])).status_code == 422
        assert (await ocr(task="extract")).json()["error"]["code"] == "invalid_request"  # the allOf rule
        assert (await ocr(task="nope")).json()["error"]["code"] == "unknown_task"  # outside the enum

        async def complete(**body):
            return await client.post("/v1/completions", json={"image": image, "max_tokens": 4, **body})

        assert (await complete(prompt="p" * 40)).status_code == 200
        assert (await complete(prompt="p" * 41)).json()["error"]["code"] == "prompt_too_long"
        assert (await complete(prompt=["a", "b"])).status_code == 400
        assert (await complete(prompt="", echo=True)).status_code == 400


async def test_chat_content_as_a_string_is_bounded_by_the_text_limit_not_the_part_count():
    """`content: "..."` (the official client's usual form) was refused above 16 characters: the part-count limit
    of a content list applied to the string's length."""
    text = "Extract the text in the image, please."
    messages = [{"role": "system", "content": "You are an OCR engine that reads documents."},
                {"role": "user", "content": [{"type": "image_url",
                                              "image_url": {"url": "data:image/png;base64," + png_b64()}}]},
                {"role": "user", "content": text}]
    async with client_of(mock_app()) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
    assert resp.status_code == 200, resp.text


async def test_json_integers_take_integral_numbers_never_strings_or_booleans():
    """JSON Schema's `integer` (the document's) includes 10.0; strict types still refuse "10" and true."""
    async with client_of(mock_app()) as client:
        body = {"image": png_b64(), "task": "text"}
        assert (await client.post("/v1/ocr", json={**body, "max_tokens": 8.0})).status_code == 200
        for bad in ("8", True, 8.5):
            resp = await client.post("/v1/ocr", json={**body, "max_tokens": bad})
            assert resp.status_code == 422 and resp.json()["error"]["param"] == "max_tokens", bad
        resp = await client.post("/v1/completions", json={"image": png_b64(), "max_tokens": 4.0, "logprobs": 1.0})
        assert resp.status_code == 200, resp.text


async def test_a_405_allows_every_method_of_the_path():
    async with client_of(mock_app()) as client:
        resp = await client.put("/v1/jobs/job-1")
    assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"
    assert resp.headers["allow"] == "DELETE, GET"


async def test_a_form_fields_value_that_is_json_but_no_list_names_a_field():
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 32), "white").save(buffer, format="PNG")
    async with client_of(mock_app()) as client:
        resp = await client.post("/v1/ocr", files={"file": ("a.png", buffer.getvalue(), "image/png")},
                                 data={"task": "extract", "fields": "2024"})
    assert resp.status_code == 200, resp.text
    assert list(resp.json()["fields"]) == ["2024"]
