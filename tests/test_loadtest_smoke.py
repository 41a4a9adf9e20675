"""Smoke of the load test against the real embedded engine (Serve app from the session fixture): the headless
runner and the Locust file each run for a few seconds and must leave sane summary files. No timing assertions —
only that answers arrived, succeeded and were summarised consistently."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import run
from loadtest.documents import A4_SIZE, ID_CARD_FIELDS, ID_CARD_SIZE, make_documents, render_a4

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.ray


def test_documents_have_requested_size_and_text():
    card = make_documents("id_card", 2)
    assert [(d.width, d.height) for d in card] == [ID_CARD_SIZE] * 2
    assert set(card[0].fields) == set(ID_CARD_FIELDS)
    assert card[0].fields != card[1].fields  # different seeds, different cards
    for value in card[0].fields.values():
        assert value in card[0].text  # every field value is rendered
    medium, dense = render_a4(500, seed=1), render_a4(2000, seed=1)
    assert (medium.width, medium.height) == A4_SIZE
    assert 500 <= medium.chars <= 600  # ~500 characters: the "medium" document
    assert 2000 <= dense.chars <= 2200
    assert render_a4(500, seed=1).png == medium.png  # deterministic for a seed


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


def test_goodput_and_error_rates_count_the_window():
    samples = [run.Sample(0.0, 0.5, 200, True), run.Sample(0.2, 2.0, 200, True),  # ok, ok but slow
               run.Sample(1.0, 0.1, 429, False, "rate_limited"), run.Sample(1.5, 0.1, 500, False, "internal_error"),
               run.Sample(9.5, 1.0, 200, True)]  # ends after the window
    step = run.StepResult("t", "closed", 1, duration_s=4.0, warmup_s=0.0, samples=samples)
    summary = step.summary(slo_ms=1000)
    assert summary["answers"] == 4 and summary["ok"] == 2
    assert summary["docs_per_s"] == 0.5
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
    waves = [run.Sample(5.0 * k, 5.0, 200, True) for k in range(3) for _ in range(4)]  # start_s, latency
    short = run.StepResult("t", "closed", 4, duration_s=13.0, warmup_s=3.0, samples=waves).summary(None)
    long = run.StepResult("t", "closed", 4, duration_s=16.0, warmup_s=3.0, samples=waves).summary(None)
    assert (short["docs_per_s"], long["docs_per_s"]) == (0.8, 0.923)
    assert short["docs_per_s_little"] == long["docs_per_s_little"] == 0.8
    failed = [run.Sample(0.0, 5.0, 500, False, "internal_error")] + waves[1:4]
    assert run.StepResult("t", "closed", 4, 6.0, 0.0, failed).summary(None)["docs_per_s_little"] == 0.6
    assert run.StepResult("t", "open", 4, 16.0, 3.0, waves).summary(None)["docs_per_s_little"] is None


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


def test_locust_csv_counts_answers_that_arrive_during_the_stop_timeout(tmp_path):
    """Every request in flight at `--run-time` ends during `--stop-timeout`; Locust printed those answers but left
    them out of its CSV (CI once found an empty CSV after a 20 s run whose single request took longer). A stand-in
    server answers each OCR request after 4 s; a 2 s run must still count its answer in the CSV."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class SlowOCR(BaseHTTPRequestHandler):
        def _answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # /readyz: the embedded engine, so the locustfile asks for `text`
            self._answer(b'{"status": "ready", "engine": "embedded"}')

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(4.0)
            self._answer(b'{"lines": []}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowOCR)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "OCR_LOADTEST_WORKLOAD": "id_card", "OCR_LOADTEST_DOCS": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
             "--host", f"http://127.0.0.1:{server.server_port}", "--headless", "-u", "1", "-r", "1", "-t", "2s",
             "--stop-timeout", "30", "--csv", str(tmp_path / "locust"), "--only-summary"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (tmp_path / "locust_stats.csv").open() as fh:
        rows = {row["Name"]: row for row in csv.DictReader(fh)}
    assert int(rows["Aggregated"]["Request Count"]) == 1, rows
    assert int(rows["/v1/ocr [id_card text]"]["Failure Count"]) == 0


def test_serve_mode_benchmark_runs_both_modes(tmp_path):
    """`bench cpu --parts serve_mode` starts the real `ocr-serve serve` once in Ray Serve's standard mode and once
    in its throughput-optimized mode (opt-in) and answers through both; no timing assertions."""
    from loadtest import bench_cpu

    out = tmp_path / "cpu"
    assert bench_cpu.main(["--parts", "serve_mode", "--overhead-requests", "3", "--rounds", "1",
                           "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())["serve_mode"]
    for payload in ("tiny_64x32", "id_card_1000x630"):
        for mode in ("standard", "throughput_optimized"):
            assert result[payload][mode]["client_p50_ms"] > result[payload][mode]["outside_ingress_p50_ms"] > 0
    logs = {p.name: p.read_text() for p in (out / "logs").glob("service-*.log")}
    assert "Throughput optimized Ray Serve enabled" in logs["service-throughput_optimized-0.log"]
    assert "Throughput optimized Ray Serve enabled" not in logs["service-standard-0.log"]
    assert "| id_card_1000x630 | throughput_optimized |" in (out / "report.md").read_text()


def test_busy_benchmark_runs_the_embedded_service_at_both_worker_priorities(tmp_path):
    """`bench cpu --parts busy` starts the embedded service with Ray's worker priority (nice 15) and with ours (the
    starting command's), times ID cards on a quiet machine and beside a spinning neighbour in the service's
    session, and reads the engine replica's nice value; the neighbour leaves with the service. No timing
    assertions."""
    from loadtest import bench_cpu

    out = tmp_path / "cpu"
    assert bench_cpu.main(["--parts", "busy", "--docs", "1", "--block-s", "1", "--busy", "1",
                           "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())["busy"]
    assert result["ray_default"]["engine_replica_niceness"] == [15]
    assert result["ours"]["engine_replica_niceness"] == [os.getpriority(os.PRIO_PROCESS, 0)]
    for name in ("ray_default", "ours"):
        assert result[name]["quiet_ms"] > 0 and result[name]["busy_ms"] > 0 and min(result[name]["n"]) >= 1
    assert "| ours | 0 |" in (out / "report.md").read_text()
    switch_dir = str(out)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and switch_dir in _cmdline(int(pid))]
    assert not left, [_cmdline(int(pid)) for pid in left]


def test_neighbours_spin_only_while_switched_on_and_leave_with_the_command(tmp_path):
    """`loadtest.neighbours` (the busy part's neighbours): its children sleep while the switch file is absent, burn
    CPU while it exists, sleep again once it is removed, and exit when the command they were started beside is
    gone. CPU time read from /proc; the bounds leave room for a loaded machine (a spinning child on two CPUs gets
    far more than 0.2 s of 1.5 s, a sleeping one far less than 0.15 s)."""
    import signal
    import time

    import psutil

    switch = tmp_path / "on"
    leader = subprocess.Popen([sys.executable, "-m", "loadtest.neighbours", "--count", "2", "--switch", str(switch),
                               "--", sys.executable, "-c", "import time; time.sleep(120)"],
                              cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(children := psutil.Process(leader.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(children) == 2, children
        assert _cmdline(leader.pid).strip().endswith("time.sleep(120)")  # the leader became the command (exec)

        def cpu_s_over(seconds: float) -> list[float]:
            before = [sum(child.cpu_times()[:2]) for child in children]
            time.sleep(seconds)
            return [sum(child.cpu_times()[:2]) - b for child, b in zip(children, before)]

        time.sleep(0.5)  # past the interpreter's start-up
        assert max(cpu_s_over(1.5)) < 0.15  # off: sleeping
        switch.touch()
        assert min(cpu_s_over(1.5)) > 0.2  # on: spinning
        switch.unlink()
        time.sleep(0.5)  # the spin slice in progress ends
        assert max(cpu_s_over(1.5)) < 0.15  # off again
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        deadline = time.monotonic() + 10
        while any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        switch.unlink(missing_ok=True)
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.own_engines
def test_png_check_http_proxy_topology_and_stop_benchmarks_run_both_settings(tmp_path):
    """`bench cpu --parts png_check,http_proxy,topology,stop` starts the real service with a passed-on PNG's pixels
    decoded by the engine only and by the ingress too (`OCR_PNG_PIXEL_CHECK`), then behind Serve's proxy actor and
    behind HAProxy (`RAY_SERVE_ENABLE_HA_PROXY`), then split and colocated (`OCR_SERVE_TOPOLOGY`), and answers
    through each; then starts and stops it with Serve's replica wait loop and with ours, and leaves no process of it
    behind; no timing assertions."""
    from loadtest import bench_cpu

    out = tmp_path / "cpu"
    assert bench_cpu.main(["--parts", "png_check,http_proxy,topology,stop", "--overhead-requests", "3",
                           "--rounds", "1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    for part, payloads, modes in (("png_check", ("id_card_1000x630", "a4_1240x1754"), ("engine", "ingress")),
                                  ("http_proxy", ("tiny_64x32", "id_card_1000x630"), ("proxy_actor", "haproxy")),
                                  ("topology", ("tiny_64x32", "id_card_1000x630"), ("split", "colocated"))):
        for payload in payloads:
            for mode in modes:
                row = results[part][payload][mode]
                assert row["client_p50_ms"] > row["ingress_p50_ms"] > 0 and row["outside_ingress_p50_ms"] > 0
    report = (out / "report.md").read_text()
    assert "| a4_1240x1754 | the ingress too |" in report and "| id_card_1000x630 | haproxy |" in report
    assert "| tiny_64x32 | colocated |" in report
    stop = results["stop"]
    for mode, wait_loop_s in (("serve_default", 2.0), ("ours", 0.25)):
        assert stop[mode]["wait_loop_s"] == wait_loop_s and stop[mode]["ready_s"] > 0, stop
        assert len(stop[mode]["stop_s_all"]) == 1 and stop[mode]["stop_s"] > 0, stop
        log = (out / "logs" / f"service-stop-{mode}-0.log").read_text()
        assert "draining" in log and "shutting down" in log  # stopped through the CLI's drain, not killed
    assert "| ours | 0.25 |" in report and "Stop time saved by the 0.25 s wait loop" in report


def test_png_rows_benchmark_times_the_decode_with_and_without_the_row_check(tmp_path):
    """`bench cpu --parts png_rows`: the engine's PNG decode with the row check, Pillow's plain load and the row count,
    per document kind (it also asserts that both decodes give the same pixels); no timing assertions."""
    from loadtest import bench_cpu

    out = tmp_path / "cpu"
    assert bench_cpu.main(["--parts", "png_rows", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["png_rows"]
    for kind in ("id_card", "a4"):
        ms = results[kind]["ms_per_page"]
        assert ms["checked"] > 0 and ms["plain"] > 0 and 0 < ms["count"]
    assert "| a4 (1240x1754" in (out / "report.md").read_text()


def test_a_terminated_benchmark_stops_the_service_it_started(tmp_path):
    """`timeout` (SIGTERM) on a benchmark must not leave its server behind: the server runs in its own session, out of
    reach of the signal, so the benchmark has to stop it on the way out. (A killed `bench gpu --tiny` once left a
    vLLM engine holding 2 GB of a CI machine.)"""
    import os
    import signal
    import sys
    import time

    from loadtest.common import session_members
    from tests.fixtures.reliability import wait_for

    bench = subprocess.Popen([sys.executable, "-m", "loadtest", "bench", "cpu", "--parts", "overhead",
                              "--overhead-requests", "100000", "--out", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    services: list[int] = []
    try:
        from service.cli import READY_MARKER

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
