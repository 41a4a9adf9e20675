"""Run the Serve application on this machine: a single-node Ray on loopback, usage stats off, no dashboard."""

from __future__ import annotations

import logging
import os
import time
import urllib.request

from service.settings import Settings

log = logging.getLogger(__name__)

APP_NAME = "ocr"


# Read by Ray at import time: a single-node cluster then binds its node IP to 127.0.0.1 instead of the host's address.
LOOPBACK_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def start_ray(num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
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
    )


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


def shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
