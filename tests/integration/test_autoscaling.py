"""Engine autoscaling on queue depth and latency (service/serve/autoscaling.py) with the real Serve controller, on
CPU: the Serve app with a slow engine (mock, 1 s per request) and the chart's autoscaling settings with delays scaled
down to seconds. Replicas go up when the queue exceeds the target, go up when p95 latency exceeds the target while
the queue is short, and come back down after the load stops; split and colocated."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import pytest

from service.serve.app import COLOCATED_DEPLOYMENT, ENGINE_DEPLOYMENT
from tests.fixtures.helm import CHART_DIR, find, render_chart, rendered_objects


# the deployment holding the engines, per serve_topology (colocated: the replicas also answer HTTP)
ENGINE_DEPLOYMENTS = {"split": ENGINE_DEPLOYMENT, "colocated": COLOCATED_DEPLOYMENT}


def chart_autoscaling_args() -> dict:
    """The chart's autoscaling args (gpu-production scenario), with the time constants scaled to seconds."""
    objects = rendered_objects(render_chart(CHART_DIR / "ci" / "gpu-production-values.yaml"))
    import yaml

    args = yaml.safe_load(find(objects, "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]["args"]
    scaling = args["engine_deployment"]["autoscaling_config"]
    assert args["latency_target_ms"] and scaling["max_replicas"] > scaling["min_replicas"]
    return {
        "engine": "mock", "mock_delay_s": 1.0, "rate_limit_enabled": False,
        "engine_deployment": {
            "ray_actor_options": {"num_gpus": 0, "num_cpus": 0.1},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2,
                                   "upscale_delay_s": 1.0, "downscale_delay_s": 3.0, "look_back_period_s": 3.0,
                                   "metrics_interval_s": 0.5}},
        "latency_downscale_ratio": args["latency_downscale_ratio"],
    }


def engine_replicas(deployment: str) -> dict[str, int]:
    from ray import serve

    app = serve.status().applications["ocr"]
    return {str(k): v for k, v in app.deployments[deployment].replica_states.items()}


def running(deployment: str) -> int:
    return engine_replicas(deployment).get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, what: str, deployment: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; replicas: "
                         f"{engine_replicas(deployment)}")


def tiny_png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (320, 120), "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class Load:
    """`clients` closed-loop clients, each with one request in flight at a time (queue depth ≈ clients)."""

    def __init__(self, url: str, clients: int):
        self.url, self.clients = url, clients
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self):
        body = {"image": tiny_png(), "task": "text"}
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + 240  # bounded even if a test forgets to stop it
            while not self.stop.is_set() and time.monotonic() < deadline:
                self.statuses.append(client.post(self.url + "/v1/ocr", json=body).status_code)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


@pytest.mark.ray
@pytest.mark.timeout(400)
@pytest.mark.parametrize("topology", list(ENGINE_DEPLOYMENTS))
def test_queue_depth_scales_up_and_back_down(serve_app, topology):
    """8 clients against a target of 2 ongoing/replica → more replicas; latency (1 s) stays under its target.
    Colocated, the replicas that scale are the ones answering HTTP (their queue is the EngineGate's)."""
    url = serve_app(**chart_autoscaling_args(), latency_target_ms=5000, serve_topology=topology)
    deployment = ENGINE_DEPLOYMENTS[topology]
    wait_for(lambda: running(deployment) == 1, 60, "one replica at rest", deployment)
    with Load(url, clients=1) as light:  # control: short queue, fast enough → no scale-up
        time.sleep(8)
        assert engine_replicas(deployment) == {"RUNNING": 1}
    with Load(url, clients=8) as heavy:
        wait_for(lambda: running(deployment) >= 2, 90, "scale-up on queue depth", deployment)
        wait_for(lambda: running(deployment) == 3, 90, "max_replicas under sustained queue depth", deployment)
    assert set(light.statuses + heavy.statuses) == {200}
    wait_for(lambda: engine_replicas(deployment) == {"RUNNING": 1}, 90, "scale-down after the load stopped",
             deployment)


@pytest.mark.ray
@pytest.mark.timeout(400)
@pytest.mark.parametrize("topology", list(ENGINE_DEPLOYMENTS))
def test_latency_scales_up_at_low_queue_depth_and_back_down(serve_app, topology):
    """One client (queue depth ≤ 1, under the target of 2) but p95 = 1 s over a 300 ms target → more replicas."""
    url = serve_app(**chart_autoscaling_args(), latency_target_ms=300, serve_topology=topology)
    deployment = ENGINE_DEPLOYMENTS[topology]
    wait_for(lambda: running(deployment) == 1, 60, "one replica at rest", deployment)
    with Load(url, clients=1) as light:
        wait_for(lambda: running(deployment) >= 2, 90, "scale-up on p95 latency at low queue depth", deployment)
    assert set(light.statuses) == {200}
    wait_for(lambda: engine_replicas(deployment) == {"RUNNING": 1}, 90, "scale-down after the load stopped",
             deployment)
