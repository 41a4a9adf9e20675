"""Run the Serve application on this machine: a single-node Ray on loopback, usage stats off, no dashboard."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import urllib.request
from dataclasses import dataclass

from service.config import Settings

log = logging.getLogger(__name__)

APP_NAME = "ocr"


# Read by Ray at import time: a single-node cluster then binds its node IP to 127.0.0.1 instead of the host's address.
LOOPBACK_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray Serve's throughput-optimized mode, on unless the environment sets RAY_SERVE_THROUGHPUT_OPTIMIZED=0: every Ray
# process reads it when it imports Serve, so it is set before Ray starts. Behind Serve's proxy the CLI drains
# requests itself, so direct ingress's 30 s hold of a stopping replica is 0; a request crosses to a replica as one
# gRPC message, so the message limit is above the largest body (max_body_bytes ≤ 256 MiB) and page of pixels
# (4096² × 3 = 48 MiB). docs/design/serve-mode.md.
REPLICA_MAX_MESSAGE_BYTES = 320 * 1024 * 1024
SERVE_MODE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
                  "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(REPLICA_MAX_MESSAGE_BYTES)}
# HAProxy in front of the ingress replicas (RAY_SERVE_ENABLE_HA_PROXY=1) is the chart's default and, here, the default
# with the vLLM engine; RAY_SERVE_ENABLE_HA_PROXY=0 in the environment keeps Serve's proxy actor
# (docs/design/http-front-end.md). Its stats page and exporter bind fixed ports (8404, 9101): here each gets a free
# port unless the environment names one, so two services on one machine do not collide.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
# HAProxy runs through service/serve/haproxy.py, which gives it the edge's header cap and header timeout and binds
# its stats page and exporter to the API's address (Ray's configuration binds them to every interface): Ray runs the
# binary RAY_SERVE_HAPROXY_BINARY_PATH names, here a shim that runs that module with this interpreter.
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# Ray starts its workers at nice 15; here the replicas run at the priority of the command that started them, so a
# busy neighbour of the same session does not starve them (RAY_worker_niceness in the environment still wins).
# Kubernetes pods keep Ray's 15. docs/design/worker-priority.md.
WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "0"}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PortInUse(RuntimeError):
    """A port this machine's service needs is taken (the message is the one line `ocr-serve serve` prints)."""


def check_metrics_port(port: int) -> None:
    """Ray's metrics agent binds `port` on loopback when the cluster starts; taken, the agent fails inside Ray with
    nothing on this terminal, so the start stops here instead."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise PortInUse(f"metrics port {port} on 127.0.0.1: {exc.strerror or exc} (another `ocr-serve serve` or "
                            f"another server?); set OCR_METRICS_EXPORT_PORT to a free port, or empty for any free "
                            f"one") from None


def ray_node_env() -> dict[str, str]:
    """What every Ray process of the service's cluster reads when it starts (Serve's mode, the replicas' priority,
    the edge's proxy callback): set here before Ray starts, and by whoever runs `ray start` for the service's nodes
    (the scaling benchmark's multi-node cluster)."""
    from service.serve.edge import PROXY_CALLBACK_ENV

    return {**SERVE_MODE_ENV, **WORKER_PRIORITY_ENV, **PROXY_CALLBACK_ENV}


def start_ray(num_cpus: int | None = None, num_gpus: int | None = None,
              metrics_export_port: int | None = None, haproxy: bool = False,
              log_to_driver: bool = True) -> None:
    """Ray on this machine for the service; its metrics agent on `metrics_export_port` (None: a free port; PortInUse
    if it is taken); `haproxy`: HAProxy as the HTTP front end unless the environment sets RAY_SERVE_ENABLE_HA_PROXY."""
    for key, value in {**LOOPBACK_ENV, **ray_node_env()}.items():
        os.environ.setdefault(key, value)
    if haproxy:
        os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        for key in HAPROXY_PORT_ENV:
            os.environ.setdefault(key, str(_free_port()))
        os.environ.setdefault(HAPROXY_BINARY_ENV, haproxy_shim())
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
    if metrics_export_port is not None:
        check_metrics_port(metrics_export_port)
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus if num_cpus is not None else max(4, os.cpu_count() or 1),
        num_gpus=num_gpus,
        logging_level=logging.WARNING,
        log_to_driver=log_to_driver,  # `ocr-serve batch`: its workers' logs stay in the session's files
        _metrics_export_port=metrics_export_port,  # Prometheus endpoint of this node (None: a free port)
    )


def haproxy_shim() -> str:
    """An executable that runs service/serve/haproxy.py with this interpreter (the project need not be installed
    with its `ocr-haproxy` script); one per user, rewritten atomically at each start."""
    import sys
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"ocr-serve-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "haproxy")
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as shim:
        shim.write(f'#!/bin/sh\nexec "{sys.executable}" -m service.serve.haproxy "$@"\n')
    os.chmod(shim.name, 0o755)
    os.replace(shim.name, path)
    return path


def connect_ray(address: str) -> None:
    """Join a running cluster as a driver (`ocr-serve drain`): `auto` = the one on this machine, else its GCS
    address as `ocr-serve serve` prints it."""
    host = address.rsplit(":", 1)[0]
    loopback = host in ("127.0.0.1", "localhost")
    # the handles of this process must speak the replicas' mode; on loopback, Ray must not swap the address given
    # for the host's own
    for key, value in {**SERVE_MODE_ENV, **(LOOPBACK_ENV if loopback else {})}.items():
        os.environ.setdefault(key, value)
    if address != "auto" and "RAY_AUTH_MODE" not in os.environ and (
            os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(os.path.expanduser("~/.ray/auth_token"))):
        # what ray.init does for a cluster it finds itself (`auto`), never for a named one: a local cluster takes
        # this user's token by default
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray

    # a cluster on loopback (`ocr-serve serve`): this driver is on that node only at its loopback address
    node_ip = {"_node_ip_address": host} if loopback else {}
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, **node_ip)


def node_resources() -> list[dict[str, float]]:
    """Each live node's Ray resources (`CPU`, `GPU`, `memory`, custom ones)."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def vllm_cpu_build() -> bool:
    """vLLM's CPU build is what is installed: how vLLM itself tells (its platform plugin), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        try:
            version("vllm-cpu")
            return True
        except PackageNotFoundError:
            return False


def metrics_port() -> int | None:
    """The port of this node's Ray metrics agent (the service's `ocr_*` metrics; docs/METRICS.md)."""
    import ray

    ports = [n.get("MetricsExportPort") for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]
    return ports[0] if ports else None


def metrics_url() -> str | None:
    """Prometheus endpoint of this node's Ray metrics agent."""
    port = metrics_port()
    return f"http://127.0.0.1:{port}/metrics" if port else None


def ray_address() -> str:
    """The address of this process's Ray cluster (its GCS), as `ray.init(address=…)` takes it."""
    import ray

    return ray.get_runtime_context().gcs_address


def replica_logs_dir() -> str | None:
    """Where this node's Serve replicas write their logs (ours among them: service/serve/replica_logs.py): the
    `logs/serve` folder of the Ray session. Ray has no public call for it; None if its internals moved."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    logs = getattr(node, "get_logs_dir_path", None)
    return os.path.join(logs(), "serve") if callable(logs) else None


def run_app(settings: Settings, *, wait_ready_s: float = 600.0, stop: threading.Event | None = None) -> str:
    """Deploy the app and wait until `/readyz` answers 200 (or `stop` is set: a signal during start-up goes straight
    to the drain); returns the base URL."""
    from ray import serve

    from service.serve.app import build_app

    serve.start(http_options={"host": settings.server.host, "port": settings.server.port}, detached=False)
    serve.run(build_app(settings), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{'127.0.0.1' if settings.server.host in ('0.0.0.0', '::') else settings.server.host}:{settings.server.port}"
    wait_ready(url, wait_ready_s, stop)
    return url


def wait_ready(url: str, timeout_s: float, stop: threading.Event | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=30) as resp:
                if resp.status == 200:
                    return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.5)
    if stop is not None and stop.is_set():
        return
    raise TimeoutError(f"service at {url} not ready after {timeout_s:.0f}s (last error: {last!r})")


# After the drain's deadline: how long ending the requests still open may take (each gets its 503 or last stream
# event at once; this only bounds waiting for every replica to report) before Serve shuts down regardless
CUT_WAIT_S = 5.0


@dataclass
class DrainOutcome:
    in_flight_at_deadline: int  # requests doing work still open when the wait ended (0: all finished in time)
    cut: int  # requests ended by the drain (503 `shutting_down`, or a stream's last error event)
    left: int  # requests still open when the cut's wait ended (0 unless a replica could not be reached)


def drain(timeout_s: float, loop: asyncio.AbstractEventLoop, hurry: threading.Event | None = None) -> DrainOutcome:
    """Graceful drain before shutdown: every HTTP replica fails readiness and refuses new work, then this waits at
    most `timeout_s` (less once `hurry` is set: a second signal) until none has a request doing work in flight;
    then every request still open, streams included, is ended with 503 `shutting_down` and Retry-After (or a last
    error event), so that Serve's shutdown finds idle replicas and no client is left without an answer.

    Runs on `loop`, which the caller keeps open until `shutdown(loop)`: with Serve's throughput-optimized mode a
    handle's router lives on the loop of the code that calls it, and Serve's shutdown still talks to it."""
    return loop.run_until_complete(_drain(timeout_s, hurry or threading.Event()))


async def _drain(timeout_s: float, hurry: threading.Event) -> DrainOutcome:
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
        return DrainOutcome(0, 0, 0)
    # a handle of this loop only (not Serve's per-process cache): serve.shutdown() later must not find a router
    # bound to a loop that is closed by then
    handle = DeploymentHandle(http_deployment, APP_NAME)

    async def reports_until(done, until: float, cut: bool) -> tuple[dict[str, dict], int]:
        """Call the replicas' `drain` (each call reaches one replica) until every replica's last report satisfies
        `done`, or `until` passes (or, while waiting, a second signal comes). Returns the last report per replica
        and how many requests the calls ended."""
        reports: dict[str, dict] = {}
        ended = 0
        while True:
            remaining = until - time.monotonic()
            try:
                state = await asyncio.wait_for(handle.drain.remote(cut=cut), timeout=max(1.0, remaining))
                reports[state["replica"]] = state
                ended += state["cut"]
            except Exception as exc:  # a replica that cannot answer has nothing we can wait for
                log.warning("drain call failed: %s: %s", type(exc).__name__, str(exc)[:200])
            if len(reports) >= replicas and all(done(state) for state in reports.values()):
                return reports, ended
            if remaining <= 0 or (hurry.is_set() and not cut):
                return reports, ended
            await asyncio.sleep(0.1 if cut else 0.2)

    try:
        waited, _ = await reports_until(lambda state: not state["in_flight"], deadline, cut=False)
        # streams and polls (not waited for) and whatever outlived the deadline: ended now, so that no replica
        # holds Serve's shutdown for its own graceful timeout
        after_cut, ended = await reports_until(lambda state: not state["open"], time.monotonic() + CUT_WAIT_S,
                                               cut=True)
        return DrainOutcome(in_flight_at_deadline=sum(state["in_flight"] for state in waited.values()), cut=ended,
                            left=sum(state["open"] for state in after_cut.values()))
    finally:
        await handle.shutdown_async()


def shutdown_ray() -> None:
    """Stop Ray before anything was deployed."""
    import ray

    ray.shutdown()


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
