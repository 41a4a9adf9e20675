"""Run the Serve application on this machine: a single-node Ray on loopback, usage stats off, no dashboard."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.request

from service.settings import Settings

log = logging.getLogger(__name__)

APP_NAME = "ocr"


# Read by Ray at import time: a single-node cluster then binds its node IP to 127.0.0.1 instead of the host's address.
LOOPBACK_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray Serve's throughput-optimized mode (Ray >= 2.55): gRPC between deployments instead of the object store, user
# code on each replica's own event loop instead of a second thread, GC frozen after start-up. Our default (Ray's is
# off): on the H200 the engine replica's image work at 128 ID cards in flight took a third of the time, and the
# service served 1.14x as many (docs/BENCHMARKS.md, eighth session). Every Ray process reads it when it imports
# Serve, so it is set before Ray starts; RAY_SERVE_THROUGHPUT_OPTIMIZED=0 in the environment keeps Ray's standard
# mode (the Helm chart: values `rayServeThroughputOptimized`).
# The mode also has each ingress replica serve HTTP on a port of its own ("direct ingress", for load balancers that
# target replicas) and hold a stopping ingress replica open 30 s so such a balancer can deregister it. Our traffic
# goes through the Serve proxy (on one node; in a cluster the mode leaves the proxy on the head only, which the Helm
# chart handles), and the CLI drains in-flight requests itself: the wait only made every stop 26 s longer (6 -> 32 s
# with the mock engine), so it is 0 here, as in the Helm chart when it runs the proxy actor.
# In that mode each request crosses to a replica as one gRPC message, and Ray 2.60 keeps gRPC's 4 MiB default for
# what a replica receives: an upload over 4 MiB (of the 20 MiB max_body_bytes allows) or an A4 page as pixels
# (engine_image_transport: pixels, 6.4 MB) was a 500. The limit is raised above the largest body setting allows
# (settings.max_body_bytes ≤ 256 MiB) and the largest page of pixels (4096² × 3 = 48 MiB).
REPLICA_MAX_MESSAGE_BYTES = 320 * 1024 * 1024
SERVE_MODE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
                  "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(REPLICA_MAX_MESSAGE_BYTES)}
# RAY_SERVE_ENABLE_HA_PROXY=1 (opt-in here, the Helm chart's default): HAProxy, which ray[serve] ships, takes the
# client's HTTP in place of Serve's Python proxy actor and forwards it to the ingress replicas' own ports, so the
# ingress no longer fetches the request body back from the proxy. On the H200 it took 7.5 ms per ID card off the
# time outside the engine (docs/BENCHMARKS.md, thirteenth session). Here it stays opt-in: beside a laptop's CPU
# engine those milliseconds do not matter, its errors without an ingress replica answer 500 where the proxy answers
# 503, and its stats page and Prometheus exporter listen on every interface. Those bind fixed ports (8404, 9101);
# here each gets a free port unless the environment names one, so two services on one machine do not collide.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
# Ray starts its worker processes (our replicas, and the vLLM EngineCore a replica starts) at nice 15, so that its
# own daemons stay responsive on a busy node. Linux ranks by nice value within a session (autogroup; machine-wide
# without it), so beside busy processes of the same session, such as a CI job's or a container's other work, a
# replica got about 1/28 of their CPU each: an ID card that took 0.47 s on a quiet machine took 33 s beside four
# busy loops on two CPUs, 70x (1.6 s, 3.8x, at nice 0; `bench cpu --parts busy`, docs/BENCHMARKS.md). Here the
# service runs at the priority of the command that started it; RAY_worker_niceness in the environment still wins.
# Kubernetes pods (the Helm chart) keep Ray's 15: there the neighbours are Ray's own processes.
WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "0"}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ray(num_cpus: int | None = None, num_gpus: int | None = None,
              metrics_export_port: int | None = None) -> None:
    for key, value in {**LOOPBACK_ENV, **SERVE_MODE_ENV, **WORKER_PRIORITY_ENV}.items():
        os.environ.setdefault(key, value)
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        for key in HAPROXY_PORT_ENV:
            os.environ.setdefault(key, str(_free_port()))
    import sys

    serve_constants = sys.modules.get("ray.serve._private.constants")
    if serve_constants is not None and serve_constants.RAY_SERVE_THROUGHPUT_OPTIMIZED != (
            os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"):
        # this process read the mode before it was set: its handles would not match the replicas' mode
        log.warning("Ray Serve was imported before start_ray(): this process's Serve mode differs from the "
                    "cluster's; set RAY_SERVE_THROUGHPUT_OPTIMIZED before importing ray.serve")
    import ray

    if ray.is_initialized():
        return
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus if num_cpus is not None else max(4, os.cpu_count() or 1),
        num_gpus=num_gpus,
        logging_level=logging.WARNING,
        log_to_driver=True,
        _metrics_export_port=metrics_export_port,  # Prometheus endpoint of this node (None = a free port)
    )


def metrics_url() -> str | None:
    """Prometheus endpoint of this node's Ray metrics agent (the service's `ocr_*` metrics; docs/METRICS.md)."""
    import ray

    ports = [n.get("MetricsExportPort") for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]
    return f"http://127.0.0.1:{ports[0]}/metrics" if ports else None


def replica_logs_dir() -> str | None:
    """Where this node's Serve replicas write their logs (ours among them: service/serve/replica_logs.py): the
    `logs/serve` folder of the Ray session. Ray has no public call for it; None if its internals moved."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    logs = getattr(node, "get_logs_dir_path", None)
    return os.path.join(logs(), "serve") if callable(logs) else None


def run_app(settings: Settings, *, wait_ready_s: float = 600.0) -> str:
    """Deploy the app and wait until `/readyz` answers 200; returns the base URL."""
    from ray import serve

    from service.serve.app import build_app

    serve.start(http_options={"host": settings.host, "port": settings.port}, detached=False)
    serve.run(build_app(settings), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{'127.0.0.1' if settings.host in ('0.0.0.0', '::') else settings.host}:{settings.port}"
    wait_ready(url, wait_ready_s)
    return url


def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=30) as resp:
                if resp.status == 200:
                    return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"service at {url} not ready after {timeout_s:.0f}s (last error: {last!r})")


def drain(timeout_s: float, loop: asyncio.AbstractEventLoop) -> int:
    """Graceful drain before shutdown: every ingress replica fails readiness and refuses new work, then this waits
    (at most `timeout_s`) until none has a request in flight. Returns the requests still in flight at the end.

    Runs on `loop`, which the caller keeps open until `shutdown(loop)`: with Serve's throughput-optimized mode a
    handle's router lives on the loop of the code that calls it, and Serve's shutdown still talks to it."""
    return loop.run_until_complete(_drain(timeout_s))


async def _drain(timeout_s: float) -> int:
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    from service.serve.app import HTTP_DEPLOYMENTS

    deadline = time.monotonic() + timeout_s
    try:
        deployments = serve.status().applications[APP_NAME].deployments
        http_deployment = next(name for name in HTTP_DEPLOYMENTS if name in deployments)
        replicas = max(1, deployments[http_deployment].replica_states.get("RUNNING", 1))
    except Exception as exc:  # app never came up: nothing to drain
        log.warning("drain skipped: %s: %s", type(exc).__name__, str(exc)[:300])
        return 0
    # a handle of this loop only (not Serve's per-process cache): serve.shutdown() later must not find a router
    # bound to a loop that is closed by then
    handle = DeploymentHandle(http_deployment, APP_NAME)
    in_flight: dict[str, int] = {}  # replica → last reported count; a drained replica's count only goes down
    try:
        while True:
            remaining = deadline - time.monotonic()
            try:
                state = await asyncio.wait_for(handle.drain.remote(), timeout=max(1.0, remaining))
                in_flight[state["replica"]] = state["in_flight"]
            except Exception as exc:  # a replica that cannot answer has nothing we can wait for
                log.warning("drain call failed: %s: %s", type(exc).__name__, str(exc)[:200])
            # calls go to a random replica: keep calling until every replica has reported (and reports 0)
            if len(in_flight) >= replicas and not any(in_flight.values()):
                return 0
            if remaining <= 0:
                return sum(in_flight.values())
            await asyncio.sleep(0.2)
    finally:
        await handle.shutdown_async()


def shutdown(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Stop Serve and Ray; with the loop `drain` ran on, Serve shuts down on it and then the loop is closed."""
    import ray
    from ray import serve

    try:
        if loop is None:
            serve.shutdown()
        else:
            loop.run_until_complete(serve.shutdown_async())
    finally:
        if loop is not None:
            loop.close()
        ray.shutdown()
