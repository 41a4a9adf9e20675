"""Engine autoscaling on queue depth and latency (service/serve/autoscaling.py): the rule checked as a function, the
latency window, and the policy reading the worst replica's p95. The behaviour with the real Serve controller:
tests/integration/test_autoscaling.py."""

from __future__ import annotations

import time
from types import SimpleNamespace


from service.serve.autoscaling import (P95_METRIC, QueueLatencyPolicy, LatencyWindow, decide, deployment_p95_ms,
                                       percentile)


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
