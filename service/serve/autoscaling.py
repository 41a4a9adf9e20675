"""Engine autoscaling on queue depth AND latency (a custom Ray Serve autoscaling policy).

Two rules decide the engine replica count; Serve's controller calls the policy every control-loop tick.

- **Queue-depth rule** (Serve's default): `queue_replicas = ongoing requests / target_ongoing_requests`, where
  ongoing = running in replicas + queued at handles, averaged over `autoscaling_look_back_s`.
- **Latency rule**: each engine replica reports the p95 of its request latencies over the same window (completed
  requests plus the age of requests still running, so a stalled engine counts) via `record_autoscaling_stats`;
  the deployment's p95 is the worst replica's.

How they combine (`decide`):
1. p95 over `latency_target_ms` → `max(queue_replicas, running + 1)`: the latency rule adds one replica per
   upscale delay even when the queue is short; a long queue may add more at once.
2. p95 below `latency_target_ms × latency_downscale_ratio` (or no traffic) AND the queue is short (the queue rule
   alone would run fewer replicas) → `queue_replicas`: only then are replicas removed.
3. Otherwise → `max(queue_replicas, running)`: the queue rule may still add replicas, nothing is removed.

Serve then applies `min_replicas`/`max_replicas`, `upscale_delay_s`/`downscale_delay_s` and the scaling factors to
the result, exactly as for its default policy. Without `latency_target_ms` the deployment uses Serve's default policy.

This module is pickled by value into the Serve controller: keep it free of imports from the service package.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any, Iterator

POLICY_IMPORT_PATH = "service.serve.autoscaling:QueueLatencyPolicy"
P95_METRIC = "latency_p95_ms"
SAMPLES_METRIC = "latency_samples"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class LatencyWindow:
    """Request latencies of one engine replica over a sliding window, for `record_autoscaling_stats`."""

    def __init__(self, window_s: float, max_samples: int = 4096):
        self.window_s = window_s
        self._done: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (finished at, latency ms)
        self._running: dict[int, float] = {}  # token → started at
        self._tokens = count()

    @contextmanager
    def track(self) -> Iterator[None]:
        token = next(self._tokens)
        self._running[token] = time.monotonic()
        try:
            yield
        finally:
            started = self._running.pop(token)
            now = time.monotonic()
            self._done.append((now, (now - started) * 1000))

    def stats(self) -> dict[str, float]:
        """`{latency_p95_ms, latency_samples}`, or `{}` when the window is empty (no traffic: the metric expires,
        so the policy sees "no latency pressure")."""
        now = time.monotonic()
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()
        samples = [ms for _, ms in self._done] + [(now - t) * 1000 for t in self._running.values()]
        if not samples:
            return {}
        return {P95_METRIC: percentile(samples, 95), SAMPLES_METRIC: float(len(samples))}


@dataclass(frozen=True)
class ScalingDecision:
    replicas: float
    rule: str  # latency_up | scale_down | queue_up | hold


def decide(*, running: int, ongoing: float, target_ongoing: float, p95_ms: float | None, latency_target_ms: float,
           downscale_ratio: float) -> ScalingDecision:
    """The combined rule (see the module docstring); `replicas` may be fractional (Serve rounds up)."""
    queue_replicas = ongoing / target_ongoing
    if p95_ms is not None and p95_ms > latency_target_ms:
        return ScalingDecision(max(queue_replicas, running + 1), "latency_up")
    queue_short = math.ceil(queue_replicas) < running
    latency_low = p95_ms is None or p95_ms < latency_target_ms * downscale_ratio
    if queue_short and latency_low:
        return ScalingDecision(queue_replicas, "scale_down")
    if queue_replicas > running:
        return ScalingDecision(queue_replicas, "queue_up")
    return ScalingDecision(running, "hold")


def deployment_p95_ms(aggregated_metrics: dict[str, dict[Any, float]] | None) -> float | None:
    """Worst replica p95 among replicas that reported latency samples in the window (None = no traffic)."""
    if not aggregated_metrics:
        return None
    per_replica = aggregated_metrics.get(P95_METRIC) or {}
    values = [v for v in per_replica.values() if v is not None and not math.isnan(v)]
    return max(values) if values else None


class QueueLatencyPolicy:
    """Serve autoscaling policy (`AutoscalingPolicy(policy_function=POLICY_IMPORT_PATH, policy_kwargs=...)`);
    Serve instantiates it once per deployment and calls it with an `AutoscalingContext` every tick."""

    def __init__(self, latency_target_ms: float, latency_downscale_ratio: float = 0.8):
        self.latency_target_ms = float(latency_target_ms)
        self.latency_downscale_ratio = float(latency_downscale_ratio)

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        if ctx.current_num_replicas == 0:  # scale-from-zero is Serve's cold-start path
            return ctx.target_num_replicas, {}
        p95 = deployment_p95_ms(ctx.aggregated_metrics)
        decision = decide(
            running=ctx.current_num_replicas, ongoing=ctx.total_num_requests,
            target_ongoing=ctx.config.get_target_ongoing_requests(), p95_ms=p95,
            latency_target_ms=self.latency_target_ms, downscale_ratio=self.latency_downscale_ratio,
        )
        return decision.replicas, {"rule": decision.rule, "p95_ms": p95}
