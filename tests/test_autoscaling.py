"""Engine autoscaling on queue depth and latency (service/serve/autoscaling.py).

The rule itself is checked as a function; the behaviour is checked on CPU with the real Serve controller: the Serve
app with a slow engine (mock, 1 s per request) and the chart's autoscaling settings with delays scaled down to
seconds. Replicas go up when the queue exceeds the target, go up when p95 latency exceeds the target while the queue
is short, and come back down after the load stops.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from service.serve.app import COLOCATED_DEPLOYMENT, ENGINE_DEPLOYMENT
from service.serve.autoscaling import (P95_METRIC, QueueLatencyPolicy, LatencyWindow, decide, deployment_p95_ms,
                                       percentile)
from tests.fixtures.helm import CHART_DIR, find, render_chart, rendered_objects

# --- the rule ---------------------------------------------------------------------------------------------------


def rule(**kw):
    base = dict(running=2, ongoing=4.0, target_ongoing=2.0, p95_ms=None, latency_target_ms=1000.0,
                downscale_ratio=0.8)
    return decide(**{**base, **kw})


def test_queue_rule_alone_without_latency_data():
    assert rule(ongoing=10.0) == rule(ongoing=10.0, p95_ms=500.0)
    assert rule(ongoing=10.0).replicas == 5 and rule(ongoing=10.0).rule == "queue_up"
    assert rule(ongoing=4.0).rule == "hold"
    assert rule(ongoing=1.0).replicas == 0.5 and rule(ongoing=1.0).rule == "scale_down"


def test_latency_over_target_adds_a_replica_even_with_a_short_queue():
    d = rule(ongoing=1.0, p95_ms=1500.0)
    assert (d.replicas, d.rule) == (3, "latency_up")
    assert rule(ongoing=20.0, p95_ms=1500.0).replicas == 10  # a long queue may add more at once


def test_replicas_are_removed_only_under_target_with_a_short_queue():
    assert rule(ongoing=1.0, p95_ms=900.0).rule == "hold"          # under target but inside the hysteresis band
    assert rule(ongoing=1.0, p95_ms=700.0).rule == "scale_down"    # under target × ratio and short queue
    assert rule(ongoing=3.5, p95_ms=100.0).rule == "hold"          # fast, but the queue still needs 2 replicas


def test_latency_window_p95_and_expiry():
    window = LatencyWindow(window_s=0.3)
    assert window.stats() == {}
    for ms in range(1, 101):
        window._done.append((time.monotonic(), float(ms)))
    assert window.stats() == {P95_METRIC: 95.0, "latency_samples": 100.0}
    with window.track():  # a request still running counts with its age
        time.sleep(0.05)
        assert window.stats()["latency_samples"] == 101
    time.sleep(0.35)
    assert window.stats() == {}  # no traffic in the window: no latency pressure
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_policy_reads_the_worst_replica_p95():
    assert deployment_p95_ms(None) is None
    assert deployment_p95_ms({P95_METRIC: {"r1": 200.0, "r2": 1200.0}}) == 1200.0
    policy = QueueLatencyPolicy(latency_target_ms=1000, latency_downscale_ratio=0.8)
    ctx = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, total_num_requests=1.0,
                          aggregated_metrics={P95_METRIC: {"r1": 200.0, "r2": 1200.0}},
                          config=SimpleNamespace(get_target_ongoing_requests=lambda: 2.0))
    replicas, state = policy(ctx)
    assert replicas == 3 and state["rule"] == "latency_up" and state["p95_ms"] == 1200.0


# --- behaviour on CPU, with the real Serve controller --------------------------------------------------------------

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
