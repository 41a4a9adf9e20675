"""`ocr-serve serve` (Ray on this machine, the application, a graceful drain on SIGTERM) and `ocr-serve drain` (the
same drain for a running cluster: the Helm chart's head pod runs it before `ray stop`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
import time

from service.cli.config import settings_or_exit

# printed once every deployment has all its starting replicas (serve.run waits for the app to be RUNNING); /readyz
# answers 200 earlier, with the first engine replica (loadtest.common.start_service waits for this line)
READY_MARKER = "engine ready at"


def cmd_serve(args: argparse.Namespace) -> int:
    from service.config import load_settings
    from service.serve import local
    from service.serve.resources import missing_resources

    overrides = dict(engine=args.engine, port=args.port, host=args.host, model=args.model)
    settings = settings_or_exit(**overrides)
    logging.basicConfig(level=settings.server.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    # HAProxy in front with the vLLM engine: a GPU engine's latency shows the proxy actor's milliseconds
    # (docs/design/http-front-end.md)
    try:
        local.start_ray(num_gpus=None, metrics_export_port=settings.observability.metrics_export_port,
                        haproxy=settings.engine.kind == "vllm")
    except local.PortInUse as exc:
        print(f"ocr-serve: {exc}", file=sys.stderr, flush=True)
        return 1
    nodes = local.node_resources()
    if engine_on_cpu(settings, nodes, local.vllm_cpu_build()):
        asked = settings.serve.engine_deployment
        settings = load_settings(**overrides, engine_deployment={  # valid: the same settings, no GPU asked
            **asked, "ray_actor_options": {**(asked.get("ray_actor_options") or {}), "num_gpus": 0}})
        print("ocr-serve: no GPU in this Ray cluster and vLLM's CPU build installed: the vLLM engine runs on CPU "
              "(num_gpus 0; vLLM's CPU defaults in docs/CONFIG.md, engine_kwargs)", flush=True)
    problem = missing_resources(settings, nodes)
    if problem is not None:
        print(f"ocr-serve: cannot start: {problem}", file=sys.stderr, flush=True)
        local.shutdown_ray()
        return 1
    stop = threading.Event()
    hurry = threading.Event()  # a second signal: stop waiting for in-flight requests (they still get their 503)

    def on_signal(*_):
        if stop.is_set():
            hurry.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    url = local.run_app(settings, stop=stop)
    if settings.auth.api_keys_file is None:
        from service.admission.auth import announce_open_service

        announce_open_service()
    # before the ready line, which is what scripts wait for
    print(f"ocr-serve: replica logs in {local.replica_logs_dir()}", flush=True)
    print(f"ocr-serve: Ray cluster at {local.ray_address()} (`ocr-serve drain --address` it)", flush=True)
    # `ocr-serve metrics prometheus-config` targets the configured port; with a free port it needs --target
    port = local.metrics_port()
    target = "" if port == settings.observability.metrics_export_port else f" --target 127.0.0.1:{port}"
    print(f"ocr-serve: metrics at {local.metrics_url()} (scrape config: `ocr-serve metrics prometheus-config{target}`)",
          flush=True)
    print(f"ocr-serve: {settings.engine.kind} {READY_MARKER} {url} in {time.monotonic() - started:.1f}s "
          f"(POST {url}/v1/ocr, docs {url}/docs, metrics {local.metrics_url()})", flush=True)
    stop.wait()
    # graceful drain: readiness fails and new work gets 503 at once; in-flight requests get up to the timeout, then
    # whatever is left gets 503 `shutting_down` (streams a last error event)
    print(f"ocr-serve: draining (in-flight requests get up to {settings.serve.graceful_shutdown_timeout_s:.0f}s)",
          flush=True)
    loop = asyncio.new_event_loop()  # drain and Serve's shutdown share it (local.drain)
    outcome = local.drain(settings.serve.graceful_shutdown_timeout_s, loop, hurry)
    if outcome.in_flight_at_deadline:
        print(f"ocr-serve: {'second signal' if hurry.is_set() else 'drain timeout'}, "
              f"{outcome.in_flight_at_deadline} request(s) still in flight", flush=True)
    if outcome.cut:
        print(f"ocr-serve: {outcome.cut} open request(s) ended with 503 shutting_down", flush=True)
    if outcome.left:
        print(f"ocr-serve: {outcome.left} request(s) could not be ended", flush=True)
    print("ocr-serve: shutting down", flush=True)
    local.shutdown(loop)
    return 0


def engine_on_cpu(settings, nodes: list[dict[str, float]], cpu_build: bool) -> bool:
    """The vLLM engine goes on CPU when the cluster has no GPU, vLLM's CPU build is installed and no setting asked
    for GPUs (engine_deployment's ray_actor_options.num_gpus, or the older OCR_ENGINE_NUM_GPUS)."""
    asked = "num_gpus" in (settings.serve.engine_deployment.get("ray_actor_options") or {})
    has_gpu = any(node.get("GPU", 0) > 0 for node in nodes)
    return settings.engine.kind == "vllm" and cpu_build and not has_gpu and not asked


def cmd_drain(args: argparse.Namespace) -> int:
    """What `serve` does on SIGTERM, for a Serve app that runs in a cluster of its own (the Helm chart's head pod
    runs it before `ray stop`): new work gets 503, in-flight requests get up to the timeout, then whatever is left
    gets 503 `shutting_down`. Ray and Serve keep running."""
    from service.serve import local
    from service.config import ServeConfig

    timeout_s = args.timeout_s if args.timeout_s is not None else \
        ServeConfig.model_fields["graceful_shutdown_timeout_s"].default
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    local.connect_ray(args.address)
    loop = asyncio.new_event_loop()
    try:
        outcome = local.drain(timeout_s, loop)
    finally:
        loop.close()
    print(f"ocr-serve drain: {outcome.in_flight_at_deadline} request(s) in flight at the deadline, {outcome.cut} "
          f"open request(s) ended with 503 shutting_down, {outcome.left} left", flush=True)
    return 0 if not outcome.left else 1


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start Ray (loopback) and the OCR application")
    p.add_argument("--engine", choices=["embedded", "vllm", "mock"], help="engine (default: OCR_ENGINE or embedded)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--model", help="model directory (vllm engine)")
    p.set_defaults(func=cmd_serve)


def add_drain(sub) -> None:
    p = sub.add_parser("drain", help="drain a running service's HTTP replicas (503 to new work, in-flight requests "
                                     "finish or get 503 at the deadline); Ray keeps running")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the one on this machine)")
    p.add_argument("--timeout-s", type=float, help="seconds in-flight requests get (default: the "
                   "graceful_shutdown_timeout_s default)")
    p.set_defaults(func=cmd_drain)
