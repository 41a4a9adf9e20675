"""The load tools' own logic, with no service, no Ray and no vLLM: the runner's summaries, the paired statistics, the
GPU comparison's plan, configuration, analysis and report, the CPU comparison's report, the command table, and the
process helpers on this machine's /proc. Stand-in HTTP servers play the service where a request must be sent."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.server
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loadtest import bench_cpu, bench_gpu, run
from loadtest.__main__ import main as loadtest_main
from loadtest.common import ManagedProcess, cpu_seconds, cpu_snapshot, free_port, parse_variants, port_holder, \
    process_kind
from loadtest.documents import make_documents
from loadtest.run import Arm, paired_summary, ratio_summary, run_paired

REPO = Path(__file__).resolve().parents[2]
H100 = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2}


def test_the_tools_import_without_torch_vllm_or_ray():
    """What the fast tier needs: the tools load (and plan) without the engine's packages."""
    code = ("import sys\nimport loadtest.__main__, loadtest.run, loadtest.bench_gpu, "
            "loadtest.bench_cpu, loadtest.bench_limiter, loadtest.bench_scale, loadtest.common, loadtest.documents\n"
            "print(sorted(m for m in ('torch', 'vllm', 'ray', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# --- the runner's summaries -------------------------------------------------------------------------------------------

def test_goodput_and_error_rates_count_the_window():
    samples = [run.Sample(0.0, 0.5, 200, True), run.Sample(0.2, 2.0, 200, True),  # ok, ok but slow
               run.Sample(1.0, 0.1, 429, False, "rate_limited"), run.Sample(1.5, 0.1, 500, False, "internal_error"),
               run.Sample(9.5, 1.0, 200, True)]  # ends after the window
    summary = run.StepResult("t", "closed", 1, duration_s=4.0, warmup_s=0.0, samples=samples).summary(slo_ms=1000)
    assert summary["answers"] == 4 and summary["ok"] == 2 and summary["docs_per_s"] == 0.5
    assert summary["rate_429"] == 0.25 and summary["error_rate"] == 0.5
    assert summary["goodput"] == 0.25  # one of four answers succeeded within 1 s
    assert summary["error_codes"] == {"rate_limited": 1, "internal_error": 1}
    assert summary["handler_ms_p50"] is None and summary["outside_handler_ms_p50"] is None  # no API timings


def test_the_handler_and_what_lay_outside_it_split_each_answer():
    """Answers of 100, 200 and 300 ms whose API handler took 90, 170 and 280 ms: p50s of 170 and 20 ms."""
    samples = [run.Sample(0.1 * i, ms / 1000, 200, True, handler_ms=handler)
               for i, (ms, handler) in enumerate(((100, 90), (200, 170), (300, 280)))]
    summary = run.StepResult("t", "closed", 1, duration_s=4.0, warmup_s=0.0, samples=samples).summary(None)
    assert (summary["handler_ms_p50"], summary["outside_handler_ms_p50"]) == (170.0, 20.0)


def test_littles_law_throughput_does_not_depend_on_the_window_edges():
    """4 clients that each need 5 s per answer, started together: answers come in waves at 5, 10, 15 s. A window
    from 3 to 13 s counts 2 waves (0.8/s), one from 3 to 16 s 3 waves (0.92/s); clients ÷ latency says 0.8/s for
    both. With one failure in four, only the successes count."""
    waves = [run.Sample(5.0 * k, 5.0, 200, True) for k in range(3) for _ in range(4)]
    short = run.StepResult("t", "closed", 4, duration_s=13.0, warmup_s=3.0, samples=waves).summary(None)
    long = run.StepResult("t", "closed", 4, duration_s=16.0, warmup_s=3.0, samples=waves).summary(None)
    assert (short["docs_per_s"], long["docs_per_s"]) == (0.8, 0.923)
    assert short["docs_per_s_little"] == long["docs_per_s_little"] == 0.8
    failed = [run.Sample(0.0, 5.0, 500, False, "internal_error")] + waves[1:4]
    assert run.StepResult("t", "closed", 4, 6.0, 0.0, failed).summary(None)["docs_per_s_little"] == 0.6
    assert run.StepResult("t", "open", 4, 16.0, 3.0, waves).summary(None)["docs_per_s_little"] is None


def test_the_raw_client_asks_vllm_for_what_the_service_asks_its_engine():
    """Same prompt text, temperature 0, a fixed output length, the sampled tokens' logprobs (confidences) and the
    image processor backend; without confidences, no logprobs."""
    doc = make_documents("id_card", 1)[0]
    target = run.OpenAIChatTarget(model="m", prompts={"extract": "the prompt"},
                                  mm_processor_kwargs={"backend": "torchvision"})
    body = json.loads(target.body(run.Job("id_card", "extract", 64), doc))
    assert body["messages"][0]["content"][1] == {"type": "text", "text": "the prompt"}
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 64
    assert body["logprobs"] is True and body["top_logprobs"] == 0
    assert body["mm_processor_kwargs"] == {"backend": "torchvision"}
    bare = json.loads(run.OpenAIChatTarget(model="m", prompts={"extract": "x"}, logprobs=False).body(
        run.Job("id_card", "extract", 64), doc))
    assert "logprobs" not in bare and "mm_processor_kwargs" not in bare
    ours = json.loads(run.OCRTarget(confidence=False).body(run.Job("id_card", "extract", 64), doc))
    assert ours["confidence"] is False and ours["max_tokens"] == 64 and ours["task"] == "extract"


# --- paired comparisons -------------------------------------------------------------------------------------------

@pytest.fixture()
def two_ocr_servers():
    """Two HTTP servers answering like the service (timings_ms: engine, total), each recording which page it got
    and when; each takes 12 ms."""
    seen: list[tuple[str, str, float, float]] = []  # (server, page digest, start, end)

    def handler(name: str, engine_ms: float):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the paired client expects

            def do_POST(self):  # noqa: N802
                start = time.perf_counter()
                page = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["image"]
                time.sleep(0.012)
                body = json.dumps({"text": "x", "usage": {"output_tokens": 3},
                                   "timings_ms": {"engine": engine_ms, "total": engine_ms + 2}}).encode()
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
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield {name: f"http://127.0.0.1:{s.server_address[1]}" for name, s in servers.items()}, seen
    for server in servers.values():
        server.shutdown()
        server.server_close()


def test_paired_rounds_send_one_page_to_every_server_in_a_new_order_one_request_at_a_time(two_ocr_servers):
    import asyncio

    urls, seen = two_ocr_servers
    documents = {"id_card": make_documents("id_card", 3)}
    target = run.OCRTarget()
    arms = [Arm(name, url, target, run.build_requests(target, run.WORKLOADS["id_card"], 3, documents=documents))
            for name, url in urls.items()]
    rounds = asyncio.run(run_paired(arms, duration_s=30.0, max_rounds=12))
    assert len(rounds) == 12 and all(set(r) == {"a", "b"} and all(s.ok for s in r.values()) for r in rounds)
    pages = [digest for _, digest, _, _ in seen]
    assert len(pages) == 24 and all(pages[2 * i] == pages[2 * i + 1] for i in range(12))  # one page per round
    assert len(set(pages)) == 3 and pages[0] != pages[2]  # pages cycle
    orders = {tuple(name for name, *_ in seen[2 * i:2 * i + 2]) for i in range(12)}
    assert orders == {("a", "b"), ("b", "a")}  # each round its own order
    assert all(later[2] >= earlier[3] for earlier, later in zip(seen, seen[1:]))  # never two in flight
    summary = paired_summary(rounds, ["a", "b"])
    assert summary["arms"]["a"]["engine_p50_ms"] == 5.0 and summary["arms"]["b"]["handler_p50_ms"] == 9.0
    assert summary["arms"]["a"]["outside_handler_p50_ms"] >= 12 - 7 - 0.1  # the answer took ≥ 12 ms, 7 inside


def test_paired_summary_keeps_the_servers_difference_and_drops_the_shared_drift():
    """Latency drifting by ±60 ms over the run moves both servers alike: the per-round difference is the servers'
    own 7 ms, its bootstrap interval holds it and not 0, and so does the docs/s ratio at one client; a round one
    server failed counts as its error and leaves every server's percentiles."""
    def sample(ms: float, ok: bool = True) -> run.Sample:
        return run.Sample(0.0, ms / 1000, 200 if ok else 500, ok, None if ok else "internal", 64)

    rounds = []
    for i in range(80):
        drift = 250 + 60 * math.sin(i / 6)
        rounds.append({"raw": sample(drift), "service": sample(drift + 7 + ((i * 37) % 11 - 5) * 0.4)})
    rounds.append({"raw": sample(200), "service": sample(9000, ok=False)})
    s = paired_summary(rounds, ["raw", "service"])
    assert (s["rounds"], s["complete_rounds"], s["reference"]) == (81, 80, "raw")
    assert s["arms"]["service"]["errors"] == 1 and s["arms"]["service"]["p95_ms"] < 9000
    d = s["against_reference"]["service"]
    assert abs(d["median_ms"] - 7) <= 1 and 4 < d["ci95_ms"][0] <= d["median_ms"] <= d["ci95_ms"][1] < 10
    assert d["mean_ci95_ms"][0] <= d["mean_ms"] <= d["mean_ci95_ms"][1]
    assert 0.96 < d["docs_per_s_ratio_ci95"][0] <= d["docs_per_s_ratio"] <= d["docs_per_s_ratio_ci95"][1] < 0.99
    assert s["arms"]["raw"]["p95_ms"] - s["arms"]["raw"]["p50_ms"] > 30  # the drift dwarfs the difference
    assert "raw" not in s["against_reference"] and len(s["rounds_ms"]["service"]) == 80


def test_ratio_summary_gives_the_median_and_its_interval_over_rounds():
    assert ratio_summary([0.9, 1.0]) == {"n": 2, "median": 0.95, "mean": 0.95, "ci95": [0.9, 1.0],
                                         "rounds": [0.9, 1.0]}
    many = ratio_summary([0.96 + 0.002 * (i % 5) for i in range(40)])
    assert many["ci95"][0] <= many["median"] <= many["ci95"][1] and many["ci95"][1] - many["ci95"][0] < 0.005
    assert ratio_summary([None, float("nan")])["median"] is None


# --- the GPU comparison's plan, configuration and analysis ------------------------------------------------------------

def gpu_args(*argv: str) -> argparse.Namespace:
    return bench_gpu.parse_args(list(argv))


def test_the_default_plan_fits_one_device_call_from_a_cold_start_on_an_h100():
    """Both workloads, raw and the service started at once (the cold start measured there: 193 s for raw alone),
    the one-client pairs and at least two rounds of the sweep within the 540 s budget."""
    p = bench_gpu.plan(gpu_args(), H100)
    assert p["fits"] and p["servers"] == ["raw", "service"] and p["arms"] == ["raw", "service"]
    assert p["startup_s"] >= 193 and p["rounds"] >= 2 and p["total_s"] <= 540
    assert p["total_s"] == pytest.approx(p["fixed_s"] + p["rounds"] * p["round_s"], abs=1)
    assert p["memory_gib"] == 2 * (24 + bench_gpu.ENGINE_OVERHEAD_GIB)
    text = bench_gpu.plan_text(p)
    for step in ("start raw, service at once", "id_card: one client", "a4: one client", "id_card @ 8 clients",
                 "id_card @ 32 clients", "a4 @ 16 clients", f"{p['rounds']} rounds"):
        assert step in text, text


def test_a_plan_that_does_not_fit_says_why():
    assert not bench_gpu.plan(gpu_args("--budget-s", "300"), H100)["fits"]
    fixed_rounds = bench_gpu.plan(gpu_args("--rounds", "5"), H100)
    assert not fixed_rounds["fits"] and "over the 540s budget" in fixed_rounds["problems"][0]
    crowded = bench_gpu.plan(gpu_args("--variant", "haproxy", "--variant", "colocated", "--workloads", "id_card",
                                      "--id-levels", "16", "--budget-s", "3000"), H100)
    assert crowded["servers"] == ["raw", "service", "service-haproxy", "service-colocated"]
    assert not crowded["fits"] and "4 engines need about 120 GiB" in crowded["problems"][0]
    assert bench_gpu.plan(gpu_args("--variant", "haproxy", "--workloads", "id_card", "--id-levels", "16",
                                   "--budget-s", "3000", "--kv-budget-gb", "16"), H100)["fits"]
    with pytest.raises(ValueError, match="one client is the paired part"):
        bench_gpu.plan(gpu_args("--id-levels", "1,8"), H100)


def test_the_batch_benchmarks_reference_is_one_round_of_raw_vllm_alone(tmp_path):
    """`bench batch --engine vllm` runs `bench gpu` for raw `vllm serve`'s peak: its arguments must parse there, start
    raw alone and plan one round of the A4 levels, with no budget unless --raw-budget-s gives one."""
    from loadtest import bench_batch

    batch = argparse.Namespace(raw_levels="128,256", kv_budget_gb=24.0, out=tmp_path, tiny=False, raw_budget_s=None)
    args = gpu_args(*bench_batch.raw_gpu_args(batch))
    planned = bench_gpu.plan(args, H100)
    assert planned["servers"] == planned["arms"] == ["raw"] and planned["rounds"] == 1 and planned["fits"], planned
    assert args.out == tmp_path / "raw" and args.workloads == "a4" and args.a4_levels == "128,256"
    timed = gpu_args(*bench_batch.raw_gpu_args(argparse.Namespace(**{**vars(batch), "raw_budget_s": 60.0})))
    assert not bench_gpu.plan(timed, H100)["fits"]


def test_plan_only_starts_nothing_and_exits_by_whether_the_plan_fits(capsys, tmp_path):
    assert loadtest_main(["bench", "gpu", "--plan-only", "--out", str(tmp_path / "a")]) == 0
    assert "fits" in capsys.readouterr().out and not (tmp_path / "a").exists()
    assert loadtest_main(["bench", "gpu", "--plan-only", "--startup-s", "600", "--out", str(tmp_path / "b")]) == 2
    assert "does not fit" in capsys.readouterr().out
    # a run whose plan does not fit stops before it starts anything, with the same answer
    assert loadtest_main(["bench", "gpu", "--budget-s", "100", "--out", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()


def test_confidence_cost_and_variants_add_arms_compared_with_raw_and_their_own_server():
    args = gpu_args("--confidence-cost", "--variant", "haproxy")
    names = bench_gpu.arm_names(args, bench_gpu.servers(args))
    assert names == ["raw", "service", "service-haproxy", "raw-noconf", "service-noconf", "service-haproxy-noconf"]
    assert bench_gpu.servers(args)["service-haproxy"] == {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    assert [bench_gpu._references(n) for n in ("raw", "service", "raw-noconf", "service-haproxy-noconf")] == [
        [], ["raw"], ["raw"], ["raw", "service-haproxy"]]


def test_variants_take_presets_and_environment_variables():
    assert parse_variants(["haproxy", "slim:OCR_PREPROCESS_WORKERS=4,RAY_SERVE_ENABLE_HA_PROXY=0"]) == {
        "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
        "slim": {"OCR_PREPROCESS_WORKERS": "4", "RAY_SERVE_ENABLE_HA_PROXY": "0"}}
    assert parse_variants(["colocated:OCR_INGRESS_REPLICAS=2"])["colocated"]["OCR_SERVE_TOPOLOGY"] == "colocated"
    for bad in (["nothing"], ["a:NAME"], ["bad label:X=1"], ["default:X=1"], ["x:A=1", "x:B=2"]):
        with pytest.raises(ValueError, match="--variant"):
            parse_variants(bad)


def test_the_service_runs_with_its_defaults_but_for_what_random_weights_need(tmp_path):
    """Only the kit, dummy weights, the KV budget in bytes (with vLLM's start check sized to it), fixed output
    lengths and no rate limit: everything else is the service's default, and the raw server is built from it."""
    settings = bench_gpu.service_settings(gpu_args(), tmp_path, H100["gpu_memory_gib"])
    assert settings == {"engine": "vllm", "model": str(tmp_path), "bench_fixed_output_tokens": True,
                        "rate_limit_enabled": False,
                        "engine_kwargs": {"kv_cache_memory_bytes": 24 * 2**30, "load_format": "dummy",
                                          "gpu_memory_utilization": round(30 / 79.2, 3)}}
    tiny = bench_gpu.service_settings(gpu_args("--tiny", "--engine-arg", "max_num_batched_tokens=4096"), tmp_path,
                                      None)
    assert tiny["engine_deployment"] == {"ray_actor_options": {"num_gpus": 0}}
    assert tiny["engine_kwargs"] == {"kv_cache_memory_bytes": 2**30, "dtype": "float32",
                                     "max_num_batched_tokens": 4096}
    from service.config import Settings

    Settings(**settings)  # every key is a real setting


def block(arm: str, level: int, round_no: int, docs_per_s: float, p50: float = 100.0, errors: int = 0) -> dict:
    return {"arm": arm, "workload": "id_card", "level": level, "round": round_no, "docs_per_s": docs_per_s,
            "docs_per_s_little": docs_per_s, "latency_ms_p50": p50, "latency_ms_p95": p50 * 1.5, "errors": errors}


def fake_results(service_rates: tuple[float, float] = (9.7, 9.9)) -> dict:
    """Two rounds at 16 clients: raw 10 and 11 docs/s, the service as given; one client: the service 4 ms slower."""
    blocks = {"16": {"raw": [block("raw", 16, 1, 10.0), block("raw", 16, 2, 11.0)],
                     "service": [block("service", 16, 1, service_rates[0]),
                                 block("service", 16, 2, service_rates[1] * 1.1)]}}
    one = {"complete_rounds": 40, "arms": {name: {"p50_ms": 250.0 + 4 * (name == "service"), "mean_ms": 251.0,
                                                  "p95_ms": 260.0, "engine_p50_ms": None, "handler_p50_ms": None,
                                                  "outside_handler_p50_ms": None, "errors": 0}
                                           for name in ("raw", "service")},
           "against_reference": {"service": {"median_ms": 4.0, "ci95_ms": [3.1, 5.0], "mean_ms": 4.2,
                                             "mean_ci95_ms": [3.0, 5.1], "docs_per_s_ratio": 0.984,
                                             "docs_per_s_ratio_ci95": [0.98, 0.988]}}}
    return {"date": "d", "command": "python -m loadtest bench gpu", "environment": H100,
            "plan": {"kv_budget_gb": 24.0}, "servers": {"raw": {"ready_s": 190.0}, "service": {
                "ready_s": 201.0, "http_listener": "ray::ProxyActor"}}, "startup_s": 201.0,
            "workloads": {"id_card": {"one_client": one, "blocks": blocks}}, "dropped": ["rounds 3-3 of the sweep"],
            "errors": {}}


def test_analysis_pairs_each_round_with_raws_and_checks_the_goals():
    met = bench_gpu.analyse(fake_results((9.7, 9.9)), ["raw", "service"])["id_card"]
    row = met["levels"]["16"]["service"]
    assert row["vs_raw"]["rounds"] == [0.97, 0.99] and row["vs_raw"]["median"] == 0.98  # round by round
    assert row["docs_per_s"] == pytest.approx((9.7 + 9.9 * 1.1) / 2, abs=1e-3) and row["blocks"] == 2
    assert met["goals"]["service"] == {"docs_per_s_ratios": {"16": 0.98, "1": 0.984}, "p50_delta_ms": 4.0,
                                       "throughput_met": True, "latency_met": True}
    missed = bench_gpu.analyse(fake_results((9.0, 9.2)), ["raw", "service"])["id_card"]["goals"]["service"]
    assert missed["throughput_met"] is False and missed["latency_met"] is True


def test_the_report_holds_the_tables_the_goals_and_what_was_dropped():
    results = fake_results()
    results["analysis"] = bench_gpu.analyse(results, ["raw", "service"])
    results["workloads"]["id_card"]["one_client"]["confidence_cost"] = {"service-noconf": {
        "median_ms": -12.0, "ci95_ms": [-20.0, -3.1], "docs_per_s_ratio": 1.05, "docs_per_s_ratio_ci95": [1.01, 1.09]}}
    text = bench_gpu.report(results)
    assert "with them, per round: service-noconf -12 ms (-20 … -3.1), docs/s 1.05 (1.01 … 1.09)" in text
    assert "## id_card: one client, 40 paired rounds" in text
    assert "| service | 254 | 251 | 260 | - | - | - | +4 (+3.1 … +5) | 0.984 (0.98 … 0.988) | 0 |" in text
    assert "| 16 | service |" in text and "÷ raw 0.98 (0.97 … 0.99) (n 2)" in text
    assert "p50 at one client − raw ≤ +10 ms (4) **met**" in text
    assert "HTTP port held by `ray::ProxyActor`" in text and "Dropped: rounds 3-3 of the sweep" in text


def test_rounds_and_blocks_that_no_longer_fit_are_dropped_and_listed(tmp_path):
    """A slow start leaves time for fewer rounds than planned; a block that would end past the budget is not run.
    Both are named in the results, never left out silently."""
    import asyncio

    args = gpu_args("--out", str(tmp_path))
    planned = {**bench_gpu.plan(args, H100), "kv_budget_gb": 24.0}
    bench = bench_gpu.Bench(args, H100, planned)
    try:
        bench.results["startup_s"] = 320.0
        bench.deadline = time.monotonic() + planned["round_s"] * 1.5 + 2 * (args.pair_s + 20) + bench_gpu.STOP_S
        assert bench.replan() == 1 < planned["rounds"]
        assert bench.results["dropped"] == [f"rounds 2-{planned['rounds']} of the sweep: the servers took 320s to "
                                            "start"]
        bench.deadline = time.monotonic() + 5
        w = bench.workloads[0]
        arm = Arm("service", "http://127.0.0.1:1", run.OCRTarget(), [])
        asyncio.run(bench.block(w, 16, arm, 0))  # the stand-in URL is never asked
        assert bench.results["dropped"][-1] == "service/id_card @ 16 clients, round 1 (time budget)"
        assert bench.results["workloads"]["id_card"]["blocks"] == {}
    finally:
        bench.gpu.stop()


METRICS_BEFORE = """# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="hunyuan-ocr"} 0.0
vllm:request_queue_time_seconds_count{engine="0",model_name="hunyuan-ocr"} 4.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="hunyuan-ocr"} 2.0
vllm:request_decode_time_seconds_count{engine="0",model_name="hunyuan-ocr"} 4.0
vllm:num_requests_running{engine="0",model_name="hunyuan-ocr"} 0.0
"""
METRICS_AFTER = """vllm:request_decode_time_seconds_sum{engine="0",model_name="hunyuan-ocr"} 5.0
vllm:request_decode_time_seconds_count{engine="0",model_name="hunyuan-ocr"} 8.0
vllm:request_decode_time_seconds_sum{engine="1",model_name="hunyuan-ocr"} 1.0
vllm:request_decode_time_seconds_count{engine="1",model_name="hunyuan-ocr"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="hunyuan-ocr"} 0.6
vllm:request_queue_time_seconds_count{engine="0",model_name="hunyuan-ocr"} 10.0
"""


def test_vllm_histograms_give_mean_ms_per_request_between_scrapes():
    """Two label sets add up: decode (5 + 1 − 2) s over (8 + 2 − 4) requests = 667 ms; queue 0.6 s over 6."""
    pages = [METRICS_BEFORE]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(pages[0].encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        before = bench_gpu.vllm_histograms(url)
        pages[0] = METRICS_AFTER
        assert bench_gpu.histogram_means(before, bench_gpu.vllm_histograms(url)) == {"queue": 100.0, "decode": 666.7}
    finally:
        server.shutdown()
        server.server_close()
    assert bench_gpu.vllm_histograms(f"http://127.0.0.1:{free_port()}") == {}  # nobody there: no numbers


# --- the CPU comparison's report --------------------------------------------------------------------------------------

def test_the_cpu_report_puts_the_paired_ratios_beside_the_throughput_blocks():
    pair = {"pairs": 36, "direct_p50_ms": 500.0, "api_p50_ms": 540.0, "p50_ratio": 1.08,
            "pair_ratio": ratio_summary([1.07, 1.08, 1.09]), "api_engine_p50_ms": 505.0, "api_decode_p50_ms": 9.0}
    results = {"date": "d", "command": "python -m loadtest bench cpu", "errors": [],
               "environment": {"cpu_model": "x", "cpu_count": 2}, "load_average": [0.5], "load_average_end": [1.0],
               "embedded": {"documents": "6 A4 pages", "per_request": {"jpeg": pair, "png": {**pair, "p50_ratio": 1.2}},
                            "throughput": {"rounds": 2, "block_s": 30.0, "direct_docs_per_s": 2.0,
                                           "api_docs_per_s": 1.9, "api_over_direct": 0.95, "api_c2_docs_per_s": 2.1,
                                           "api_c2_over_direct": 1.05, "api_c2_errors": 0}}}
    text = bench_cpu.report(results)
    assert "| jpeg | 36 | 500.0 | 540.0 | **1.08** | 1.08 (1.07 … 1.09) | 505.0 | 9.0 |" in text
    assert "jpeg **met**, png **not met**" in text
    assert "API at one client 1.9 (**0.95×**)" in text and "API at two clients 2.1 (**1.05×**" in text


# --- the command table ------------------------------------------------------------------------------------------------

def test_the_command_table_answers_help_and_refuses_what_it_does_not_know(capsys):
    assert loadtest_main(["--help"]) == 0 and "bench gpu" in capsys.readouterr().out
    assert loadtest_main([]) == 2
    assert loadtest_main(["encoder"]) == 2 and "unknown command 'encoder'" in capsys.readouterr().err
    assert loadtest_main(["bench", "pool"]) == 2 and "bench {gpu,scale,cpu,limiter,batch}" in capsys.readouterr().err


def test_documents_command_writes_the_generated_pages(tmp_path, capsys):
    assert loadtest_main(["documents", str(tmp_path), "--kind", "id_card", "--count", "2"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id_card-0.png", "id_card-1.png"]
    assert (tmp_path / "id_card-0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- processes on this machine ----------------------------------------------------------------------------------------

def test_process_titles_name_the_kind():
    """vLLM and Ray write a process title over argv (one string with spaces): the title is the kind."""
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    titled = [subprocess.Popen([sys.executable, "-c", "import setproctitle, time\n"
                                f"setproctitle.setproctitle({title!r})\ntime.sleep(30)"])
              for title in ("VLLM::EngineCore", "vllm serve")]
    try:
        deadline = time.monotonic() + 30
        while [process_kind(p.pid) for p in titled] != ["VLLM::EngineCore", "vllm serve"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert [process_kind(p.pid) for p in titled] == ["VLLM::EngineCore", "vllm serve"]
        assert process_kind(plain.pid) == f"{os.path.basename(sys.executable)} -c"
    finally:
        for proc in (plain, *titled):
            proc.kill()
            proc.wait()
    assert process_kind(2**22 + 12345) == "?"  # gone or never there


def test_cpu_seconds_count_what_each_process_used():
    """A child that burns 0.3 s of CPU time (its own clock, whatever else the machine runs) and one that sleeps:
    the CPU seconds between two snapshots, per kind."""
    burn = ("import sys, time\nsys.stdin.readline()\nstart = time.process_time()\n"
            "while time.process_time() - start < 0.3: pass\nprint('done', flush=True)\ntime.sleep(30)\n")
    busy = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen(["sleep", "30"])
    try:
        before = cpu_snapshot([busy.pid, idle.pid])
        busy.stdin.write("go\n")
        busy.stdin.flush()
        assert busy.stdout.readline().strip() == "done"
        used = cpu_seconds(before, cpu_snapshot([busy.pid, idle.pid]))
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait()
    assert list(used) == [f"{os.path.basename(sys.executable)} -c", "sleep"]  # busiest first
    assert 0.28 <= used[f"{os.path.basename(sys.executable)} -c"] < 1.0 and used["sleep"] <= 0.02


def test_port_holder_looks_again_while_a_front_end_hands_its_port_over(tmp_path):
    """Ray reloads HAProxy when replicas change: a new haproxy takes the port and the old one lets it go, so for a
    moment nobody holds it. Here a process of the session starts listening only after a second."""
    port = free_port()
    late = ("import socket, time\ntime.sleep(1.0)\nsock = socket.socket()\n"
            f"sock.bind(('127.0.0.1', {port}))\nsock.listen()\ntime.sleep(30)\n")
    proc = ManagedProcess("late-listener", [sys.executable, "-c", late], log_path=tmp_path / "late.log")
    try:
        assert port_holder(proc, port, wait_s=0) is None  # one look, before it listens
        assert port_holder(proc, port, wait_s=30) == f"{os.path.basename(sys.executable)} -c"
    finally:
        proc.stop(timeout_s=5)


def test_bench_batch_report_reads_the_ratios():
    from loadtest.bench_batch import report

    row = lambda rate: {"pages": 16, "wall_s": 16 / rate, "pages_per_s": rate}  # noqa: E731
    results = {"engine": "embedded", "date": "d", "command": "python -m loadtest bench batch", "errors": [],
               "environment": {"cpu_count": 2}, "load_average": [1.0], "pages": {"a4": 8, "id_card": 8},
               "rounds": [{"direct": row(1.0), "batch": row(0.95), "batch-1": row(0.9), "batch_over_direct": 0.95,
                           "batch-1_over_direct": 0.9}],
               "batch_over_direct_median": 0.95, "batch-1_over_direct_median": 0.9}
    text = report(results)
    assert "| 1 | 1.0 | 0.95 | **0.95** | 0.9 | 0.9 |" in text and "goal ≥ 0.9: met" in text
    results["batch_over_direct_median"] = 0.5
    assert "not met" in report(results)


async def test_a_closed_step_waits_for_its_minimum_of_answers_past_its_duration():
    """Each answer takes longer than the whole step: the one client keeps sending until `min_answers` arrived
    (a client that checked only the step's end stopped after its first answer)."""
    from aiohttp import web

    from loadtest.run import Job, OCRTarget, Request, run_closed

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.3)
        return web.json_response({"text": "ok", "usage": {"output_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/ocr", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        requests = [Request(Job("id_card", "text"), None, b"{}")]
        step = await run_closed(f"http://127.0.0.1:{port}", OCRTarget(), requests, concurrency=1, duration_s=0.1,
                                warmup_s=0.0, timeout_s=10.0, min_answers=3)
    finally:
        await runner.cleanup()
    assert len(step.samples) == 3 and all(s.status == 200 for s in step.samples), step.samples
    assert step.cancelled == 0 and step.duration_s >= 0.9
