"""Prometheus metrics of the service: every `ocr_*` metric is defined here, in request order.

How metrics leave the processes (docs/METRICS.md has the whole story): the ingress and engine replicas are separate Ray
processes, possibly on different pods, so they record through Ray Serve's metrics API (`ray.serve.metrics`, which adds
the `deployment`, `replica` and `application` labels). Each node's Ray metrics agent exports what the processes of
that node recorded on the node's metrics port (KubeRay: 8080 on every head/worker pod). Ray prefixes every
application metric with `ray_` (and counters get `_total`), and vLLM's Ray stat logger turns `vllm:x` into
`ray_vllm_x`; `METRIC_RELABEL_CONFIGS` renames them back at scrape time to `ocr_*` and `vllm:*`. The chart's
PodMonitor, deploy/grafana/prometheus-scrape.yaml and the test's prometheus.yml all use exactly these rules.

Labels are bounded: task names come from the task table (else `unknown`), status/code from the error table (and
499 `client_disconnected` for a client gone before its answer), tenants from the key file (`unknown` before
authentication), adapters only after the engine accepted them.
Ray histograms keep exact bucket counts but approximate `_sum` (bucket midpoints): exact totals (tokens) are
separate counters.

Counters start at 0: a series that first appears already at 1 (or 36) is one that `rate()`/`increase()` read as no
increase, so a replica's first errors would be invisible. Each replica therefore exports the label sets of the
alerts' first burst at 0 before it counts anything (`start_at_zero`: successes and ZEROED_CODES x endpoint x task,
the first MAX_ZEROED_TENANTS tenants of the key file and those a reload adds, adapters); `zero_series_count` says
how many that is. Not every label set: Ray's agent keeps at most 2000 series per metric on a node.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

from service.errors import ERROR_CODES
from service.tasks import TASKS

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram"]
Process = Literal["ingress", "engine", "replica"]  # replica: every replica records it (both kinds)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
IMAGE_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
OUTPUT_TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)

STAGES = ("decode", "queue", "engine", "preprocess", "first_token", "generate", "delivery", "parse")
# `endpoint` label → the statuses of its successes (code `ok`); service/http/middleware.py COUNTED_ENDPOINTS maps
# routes to these names
ENDPOINT_SUCCESS_STATUSES = {"ocr": ("200",), "jobs": ("200", "202")}
AUTH_FAILURE_CODES = ("unauthorized", "forbidden", "ambiguous_credentials")
# service/jobs/webhook.py OUTCOMES and the terminal job states of service/jobs/model.py (tests keep them equal)
WEBHOOK_OUTCOMES = ("delivered", "redirect", "http_error", "timeout", "unreachable", "error")
JOB_END_STATES = ("succeeded", "partial", "failed", "cancelled")
# what a failing Redis call raises most (redis-py's ConnectionError and TimeoutError): started at 0 where Redis is used
COMMON_BACKEND_ERRORS = ("ConnectionError", "TimeoutError")
TENANT_UNKNOWN = "unknown"  # a request refused before authentication

AUTOSCALING_SETTINGS = ("min_replicas", "max_replicas", "target_ongoing_requests", "latency_target_seconds")
# Ray's metrics agent drops a gauge series that was not re-reported for 2 report intervals, and a process reports only
# values set since its last report: gauges are re-set every half report interval so idle replicas keep their series.
# The interval is Ray's `metrics_report_interval_ms` (10 s unless RAY_metrics_report_interval_ms says otherwise).
RAY_REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
RAY_DEFAULT_REPORT_INTERVAL_S = 10.0


def gauge_refresh_s(environ: Mapping[str, str] = os.environ) -> float:
    """How often gauges are re-set: half of Ray's metrics report interval in this process's environment."""
    try:
        report_s = float(environ.get(RAY_REPORT_INTERVAL_ENV, "")) / 1000
    except ValueError:
        report_s = RAY_DEFAULT_REPORT_INTERVAL_S
    if not report_s > 0:
        report_s = RAY_DEFAULT_REPORT_INTERVAL_S
    return max(0.2, report_s / 2)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: `name` as the service records it (counters without `_total`, which the exporter appends)."""

    name: str
    kind: Kind
    process: Process
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    @property
    def exported_names(self) -> tuple[str, ...]:
        """Series names as Prometheus stores them (after METRIC_RELABEL_CONFIGS)."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        return (self.name,)

    @property
    def query_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


# The registry, in request order: ingress (HTTP → admission → engine call → parse) then engine replicas.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("ocr_requests", "counter", "ingress",
               "Finished API requests by endpoint, task, HTTP status and error code (`ok` on success); a client that "
               "disconnected before its whole answer was sent: status 499, code `client_disconnected`.",
               ("endpoint", "task", "status", "code")),
    MetricSpec("ocr_tenant_requests", "counter", "ingress",
               "The same requests by tenant (`unknown` before authentication), HTTP status and error code.",
               ("tenant", "status", "code")),
    MetricSpec("ocr_request_duration_seconds", "histogram", "ingress",
               "End-to-end request latency in the ingress (body read to last byte sent); outcome "
               "ok | client_error | server_error.", ("endpoint", "task", "outcome"), LATENCY_BUCKETS_S),
    MetricSpec("ocr_auth_failures", "counter", "ingress",
               "Requests refused by authentication/authorisation; reason = error code (unauthorized, forbidden, "
               "ambiguous_credentials).",
               ("reason",)),
    MetricSpec("ocr_rate_limited", "counter", "ingress", "Requests answered 429 `rate_limited`, by tenant.",
               ("tenant",)),
    MetricSpec("ocr_ratelimit_backend_errors", "counter", "ingress",
               "Failed rate-limiter backend (Redis) calls; error = exception class.", ("error",)),
    MetricSpec("ocr_ratelimit_fallback", "gauge", "ingress",
               "1 while this ingress replica's rate limiter decides without Redis (after a failed call, until a "
               "probe succeeds): fail_mode open = its local share of each bucket, closed = 503 "
               "`rate_limiter_unavailable`; 0 with Redis in use. Only where a Redis URL is set; requests update it.",
               ("fail_mode",)),
    MetricSpec("ocr_redis_resets", "counter", "ingress",
               "Redis restarts, failovers and losses of the service's Redis state noticed by an ingress replica "
               "(each replica counts each event once); data = lost: the state was gone (rate-limit buckets full "
               "again, running jobs lost), kept: a new server run_id with the state intact.", ("data",)),
    MetricSpec("ocr_ingress_waiting_requests", "gauge", "ingress",
               "Admitted requests this ingress replica sent to the engine deployment and still waits for "
               "(queued for a replica + running)."),
    MetricSpec("ocr_stage_duration_seconds", "histogram", "ingress",
               "Per-stage latency of successful pages: decode (admission CPU work), queue (waiting for an engine "
               "replica), engine (inside the engine; the vLLM engine also reports preprocess: image decode + HF "
               "processor, first_token: engine start to first output, generate: the engine core's first to last token, "
               "delivery: its last token to the engine seeing it, all inside engine), parse.",
               ("task", "stage"), LATENCY_BUCKETS_S),
    MetricSpec("ocr_pages", "counter", "ingress", "Pages recognised; source = image | pdf.", ("task", "source")),
    MetricSpec("ocr_image_tokens", "counter", "ingress", "Image tokens sent to the model (VLM engines).", ("task",)),
    MetricSpec("ocr_request_image_tokens", "histogram", "ingress", "Image tokens per page (VLM engines).",
               ("task",), IMAGE_TOKEN_BUCKETS),
    MetricSpec("ocr_output_tokens", "counter", "ingress", "Output tokens generated (VLM engines).", ("task",)),
    MetricSpec("ocr_request_output_tokens", "histogram", "ingress", "Output tokens per page (VLM engines).",
               ("task",), OUTPUT_TOKEN_BUCKETS),
    MetricSpec("ocr_repetition_cutoffs", "counter", "ingress",
               "Outputs cut by the repetition guard (finish_reason `repetition`).", ("task",)),
    MetricSpec("ocr_confidence", "histogram", "ingress", "Document confidence (0-1) of successful pages.",
               ("task",), CONFIDENCE_BUCKETS),
    MetricSpec("ocr_adapter_requests", "counter", "ingress", "Successful pages served by a LoRA adapter.",
               ("adapter",)),
    MetricSpec("ocr_webhook_deliveries", "counter", "ingress",
               "Job webhook deliveries by final outcome: delivered | redirect | http_error | timeout | unreachable | "
               "error.", ("outcome",)),
    MetricSpec("ocr_jobs_finished", "counter", "ingress",
               "Jobs that ended, by final status: succeeded | partial (some pages failed) | failed (every page failed, "
               "or its state was lost) | cancelled.", ("status",)),
    MetricSpec("ocr_jobs_lost", "counter", "ingress",
               "Running jobs whose stored state vanished from the job store (Redis restarted or failed over without "
               "its data, or evicted it); the replica running each marks it failed with `job_lost`."),
    MetricSpec("ocr_latency_slo_seconds", "gauge", "ingress",
               "The p95 end-to-end latency objective (settings.latency_slo_s), for dashboards and alerts."),
    MetricSpec("ocr_autoscaling_config", "gauge", "ingress",
               "Engine autoscaling settings: min_replicas, max_replicas, target_ongoing_requests, "
               "latency_target_seconds (only when set).", ("setting",)),
    MetricSpec("ocr_replica_start_time_seconds", "gauge", "replica",
               "Unix time this replica's process started (one series per Serve replica: restarts and replacements "
               "show as new series)."),
    MetricSpec("ocr_engine_healthy", "gauge", "engine",
               "1 while this engine replica passes its health check, 0 after a failed one.", ("engine",)),
    MetricSpec("ocr_engine_ongoing_requests", "gauge", "engine", "Requests inside this engine replica now."),
    MetricSpec("ocr_engine_gpus", "gauge", "engine", "GPUs reserved by this engine replica."),
    MetricSpec("ocr_adapter_loads", "counter", "engine",
               "LoRA adapter loads on engine replicas; outcome = ok | error.", ("adapter", "outcome")),
    MetricSpec("ocr_adapter_cache_hits", "counter", "engine",
               "Adapter requests served by a replica that already had the adapter loaded.", ("adapter",)),
)

METRICS_BY_NAME = {spec.name: spec for spec in METRICS}


# Labels Ray's exporter puts on every series that name the process and the Ray session: they change whenever a
# replica's process or the node restarts, while the series' identity is already `replica` (Serve's) or `ReplicaId`
# (vLLM's). Dropped from the product's series only: Ray's own per-worker metrics need WorkerId to stay distinct.
CHURNING_RAY_LABELS = ("WorkerId", "SessionName")

# Prometheus `metric_relabel_configs`: Ray's exported names back to the product's names, then the churning labels
# removed from them (a `replace` with an empty result deletes the label).
METRIC_RELABEL_CONFIGS: list[dict[str, Any]] = [
    {"source_labels": ["__name__"], "regex": "ray_(ocr_.+)", "target_label": "__name__", "replacement": "$1"},
    {"source_labels": ["__name__"], "regex": "ray_vllm_(.+)", "target_label": "__name__", "replacement": "vllm:$1"},
    {"action": "labeldrop", "regex": "otel_scope_.+"},
    *({"source_labels": ["__name__"], "regex": "(ocr_|vllm:).+", "target_label": label, "replacement": ""}
      for label in CHURNING_RAY_LABELS),
]

# The labels that scope every alert and dashboard query: the Kubernetes namespace and the Helm release (added by the
# scrape configuration: the chart's monitors, deploy/grafana/prometheus-scrape.yaml, or prometheus_config below).
SCOPE_LABELS = ("namespace", "ocr_release")
LOCAL_NAMESPACE = "local"  # what prometheus_config labels a local service with (no Kubernetes namespace)
LOCAL_RELEASE = "ocr"


def prometheus_config(targets: list[str], *, scrape_interval: str = "15s", job: str = "ray",
                      rule_files: list[str] | None = None, namespace: str = LOCAL_NAMESPACE,
                      release: str = LOCAL_RELEASE) -> dict[str, Any]:
    """A prometheus.yml scraping Ray metrics ports (`host:port` of every node) with the product's relabel rules;
    the targets are labelled with `namespace` and `ocr_release` like the chart's, so the dashboards and alerts work
    unchanged."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{
            "job_name": job,
            "scrape_interval": scrape_interval,
            "static_configs": [{"targets": list(targets), "labels": {"namespace": namespace, "ocr_release": release}}],
            "metric_relabel_configs": METRIC_RELABEL_CONFIGS,
        }],
    }
    if rule_files:
        config["rule_files"] = list(rule_files)
    return config


# --- recording ---------------------------------------------------------------------------------------------------


class _Off:
    """Instrument of a disabled metrics object (settings.metrics_enabled = false, or no Ray process)."""

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        return None

    def zero(self, tags: dict[str, str] | None = None) -> None:
        return None

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        return None

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        return None


InstrumentFactory = Callable[[MetricSpec], Any]


class RayCounter:
    """A `ray.serve.metrics.Counter` that can also export a label set at 0 before its first increment.

    Ray 2.60's `Counter.inc` refuses 0 ("value must be >0"), but the record underneath it (`Metric._record`, which
    `inc` calls after that check) takes 0: the metrics agent adds it to the series' total and exports the series at 0
    as a counter (tests/integration/test_metrics_first_burst.py checks this end to end)."""

    def __init__(self, counter: Any):
        self._counter = counter

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._counter.inc(value, tags=tags)

    def zero(self, tags: dict[str, str] | None = None) -> None:
        self._counter._record(0, tags=tags)


def ray_serve_instrument(spec: MetricSpec) -> Any:
    """A `ray.serve.metrics` instrument (adds deployment/replica/application labels inside a replica)."""
    from ray.serve import metrics as serve_metrics

    if spec.kind == "counter":
        return RayCounter(serve_metrics.Counter(spec.name, description=spec.description, tag_keys=spec.labels))
    if spec.kind == "gauge":
        return serve_metrics.Gauge(spec.name, description=spec.description, tag_keys=spec.labels)
    return serve_metrics.Histogram(spec.name, description=spec.description, boundaries=list(spec.buckets or ()),
                                   tag_keys=spec.labels)


def instrument_factory(settings) -> InstrumentFactory | None:
    """Ray Serve instruments when metrics are on and this process is part of a Ray cluster, else None (off)."""
    if not settings.observability.metrics_enabled:
        return None
    try:
        import ray
    except ImportError:
        return None
    return ray_serve_instrument if ray.is_initialized() else None


def process_start_time() -> float:
    """Unix time this process started (psutil comes with Ray); now where it cannot be read."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil, or no /proc
        return time.time()


class _Metrics:
    """Instruments of one process kind; a failing metric call is logged, never raised into a request."""

    process: Process

    def __init__(self, factory: InstrumentFactory | None):
        self.enabled = factory is not None
        self._instruments: dict[str, Any] = {}
        for spec in METRICS:
            if spec.process in (self.process, "replica"):
                self._instruments[spec.name] = factory(spec) if factory else _Off()
        self._gauge_values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()  # gauge values are read by the refresher thread
        self._stop = threading.Event()
        self._in_flight_counts: dict[str, int] = {}
        self._zeroed: set[tuple[str, tuple[tuple[str, str], ...]]] = set()  # label sets exported at 0 (bounded)

    def start_refresher(self, interval_s: float | None = None) -> None:
        """Re-set every gauge periodically (default: `gauge_refresh_s()`) from a daemon thread; `close()` stops it."""
        if not self.enabled:
            return
        interval_s = interval_s or gauge_refresh_s()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.refresh()

        threading.Thread(target=loop, name=f"ocr-{self.process}-metrics", daemon=True).start()

    @contextmanager
    def _in_flight(self, gauge: str) -> Iterator[None]:
        """`gauge` counts the blocks running inside this context (requests waiting, requests ongoing)."""
        self._in_flight_counts[gauge] = self._in_flight_counts.get(gauge, 0) + 1
        self._set(gauge, self._in_flight_counts[gauge])
        try:
            yield
        finally:
            self._in_flight_counts[gauge] -= 1
            self._set(gauge, self._in_flight_counts[gauge])

    def refresh(self) -> None:
        with self._lock:
            values = list(self._gauge_values.items())
        for (name, tags), value in values:
            self._call(name, "set", value, dict(tags))

    def close(self) -> None:
        self._stop.set()

    def publish_start_time(self) -> None:
        self._set("ocr_replica_start_time_seconds", process_start_time())

    def _inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value > 0:  # Ray counters reject 0 (label sets start at 0 through _zero)
            self._call(name, "inc", value, tags)

    def _zero(self, name: str, label_sets: Iterable[dict[str, str]]) -> None:
        """Export each label set of counter `name` at 0, once (its first increment is then a visible increase)."""
        if not self.enabled:
            return
        for tags in label_sets:
            key = (name, tuple(sorted(tags.items())))
            if key not in self._zeroed:
                self._zeroed.add(key)
                self._call(name, "zero", 0, tags)

    def _set(self, name: str, value: float, **tags: str) -> None:
        with self._lock:
            self._gauge_values[(name, tuple(sorted(tags.items())))] = value
        self._call(name, "set", value, tags)

    def _observe(self, name: str, value: float, **tags: str) -> None:
        self._call(name, "observe", value, tags)

    def _call(self, name: str, method: str, value: float, tags: dict[str, str]) -> None:
        try:
            instrument = self._instruments[name]
            if method == "zero":
                instrument.zero(tags=tags or None)
            else:
                getattr(instrument, method)(value, tags=tags or None)
        except Exception:  # metrics must never fail a request
            log.exception("metric %s.%s failed", name, method)

    @property
    def zero_series_count(self) -> int:
        """Counter series this replica exported at 0 (the cardinality zero-initialisation adds)."""
        return len(self._zeroed)


def task_label(task: Any) -> str:
    return task if isinstance(task, str) and task in TASKS else "unknown"


def outcome_label(status: int) -> str:
    return "ok" if status < 400 else ("client_error" if status < 500 else "server_error")


TASK_LABELS = (*TASKS, "unknown")


# Ray's metrics agent keeps at most 2000 series per metric on a node (OpenTelemetry's default cardinality limit),
# for every replica that ever ran there: past it, new label sets lose their labels. So only what the alerts' first
# burst needs starts at 0: successes, 429s and the load-related 503s per endpoint x task, and 401s (refused before
# the task is read: task `unknown`). 101 `ocr_requests` series per ingress replica, not one per error code (~870).
ZEROED_CODES = ("rate_limited", "overloaded", "engine_unavailable")
ZEROED_BEFORE_TASK = (("401", "unauthorized"),)
# tenants of a key file whose label sets start at 0 (the first ones, sorted): a key file of thousands of tenants
# must not fill the agent's series budget before the first request
MAX_ZEROED_TENANTS = 50
TENANT_ZEROED_OUTCOMES = (("200", "ok"), ("429", "rate_limited"))


def zeroed_request_labels() -> Iterator[dict[str, str]]:
    """The `ocr_requests` label sets that start at 0: each endpoint's successes and ZEROED_CODES for every task,
    ZEROED_BEFORE_TASK for task `unknown`."""
    for endpoint, successes in ENDPOINT_SUCCESS_STATUSES.items():
        outcomes = [(status, "ok") for status in successes] + [(str(ERROR_CODES[c][0]), c) for c in ZEROED_CODES]
        for task in TASK_LABELS:
            for status, code in outcomes:
                yield {"endpoint": endpoint, "task": task, "status": status, "code": code}
        for status, code in ZEROED_BEFORE_TASK:
            yield {"endpoint": endpoint, "task": "unknown", "status": status, "code": code}


class IngressMetrics(_Metrics):
    """What the ingress replica records (one per AppContext)."""

    process = "ingress"

    def __init__(self, factory: InstrumentFactory | None = None):
        super().__init__(factory)
        self._zeroed_tenants: set[str] = set()

    @classmethod
    def for_settings(cls, settings) -> "IngressMetrics":
        metrics = cls(instrument_factory(settings))
        metrics.publish_config(settings)
        metrics.start_at_zero(settings)
        metrics.start_refresher()
        return metrics

    def publish_config(self, settings) -> None:
        self._set("ocr_latency_slo_seconds", settings.observability.latency_slo_s)
        fewest, most = settings.serve.engine_replicas(settings.engine.kind)
        values = {"min_replicas": fewest, "max_replicas": most,
                  "target_ongoing_requests": settings.serve.autoscaling()["target_ongoing_requests"],
                  "latency_target_seconds": (settings.serve.latency_target_ms / 1000
                                             if settings.serve.latency_target_ms else None)}
        for setting, value in values.items():
            if value is not None:
                self._set("ocr_autoscaling_config", float(value), setting=setting)
        self._set("ocr_ingress_waiting_requests", 0)
        self.publish_start_time()

    # label sets at 0 (module docstring)
    def start_at_zero(self, settings) -> None:
        """The label sets this replica can know before its first request: every endpoint x task x (status, code),
        the tenant-free counters, the pre-authentication tenant `unknown` (and `anonymous` without a key file:
        key-file tenants come through `tenants_known`), Redis' counters where Redis is used."""
        self._zero("ocr_requests", zeroed_request_labels())
        # a request refused before authentication: 401, or 429 from the per-address limit
        self._zero("ocr_tenant_requests", ({"tenant": TENANT_UNKNOWN, "status": status, "code": code}
                                           for status, code in (("401", "unauthorized"), ("429", "rate_limited"))))
        if settings.auth.api_keys_file is None:
            self.tenants_known(["anonymous"])
        self._zero("ocr_auth_failures", ({"reason": code} for code in AUTH_FAILURE_CODES))
        for name in ("ocr_image_tokens", "ocr_output_tokens", "ocr_repetition_cutoffs"):
            self._zero(name, ({"task": task} for task in TASKS))
        self._zero("ocr_pages", ({"task": task, "source": source} for task in TASKS for source in ("image", "pdf")))
        self._zero("ocr_webhook_deliveries", ({"outcome": outcome} for outcome in WEBHOOK_OUTCOMES))
        self._zero("ocr_jobs_finished", ({"status": status} for status in JOB_END_STATES))
        if settings.redis.url is not None:
            self._zero("ocr_ratelimit_backend_errors", ({"error": error} for error in COMMON_BACKEND_ERRORS))
            self._zero("ocr_redis_resets", ({"data": data} for data in ("lost", "kept")))
            self._zero("ocr_jobs_lost", [{}])

    def tenants_known(self, tenants: Iterable[str]) -> None:
        """The tenants of the key file, at start and after each reload: their successes and 429s at 0 (new ones
        only, the first MAX_ZEROED_TENANTS in all)."""
        for tenant in sorted(set(tenants)):
            if len(self._zeroed_tenants) >= MAX_ZEROED_TENANTS:
                return
            if tenant in self._zeroed_tenants:
                continue
            self._zeroed_tenants.add(tenant)
            self._zero("ocr_tenant_requests", ({"tenant": tenant, "status": status, "code": code}
                                               for status, code in TENANT_ZEROED_OUTCOMES))
            self._zero("ocr_rate_limited", [{"tenant": tenant}])

    def adapters_known(self, adapters: Iterable[str]) -> None:
        """Adapters the engine lists (at the first engine info, after an admin load): their label sets at 0."""
        self._zero("ocr_adapter_requests", ({"adapter": adapter} for adapter in sorted(set(adapters))))

    # request level (called by RequestMetricsMiddleware)
    def request_finished(self, *, endpoint: str, task: str, status: int, code: str, tenant: str,
                         seconds: float) -> None:
        self._inc("ocr_requests", endpoint=endpoint, task=task, status=str(status), code=code)
        self._inc("ocr_tenant_requests", tenant=tenant, status=str(status), code=code)
        self._observe("ocr_request_duration_seconds", seconds, endpoint=endpoint, task=task,
                      outcome=outcome_label(status))
        if code in AUTH_FAILURE_CODES:
            self._inc("ocr_auth_failures", reason=code)
        elif code == "rate_limited":
            self._inc("ocr_rate_limited", tenant=tenant)

    # admission
    def limiter_backend_error(self, exc: BaseException) -> None:
        """`on_backend_error` hook of the failover rate limiter."""
        self._inc("ocr_ratelimit_backend_errors", error=type(exc).__name__)

    def limiter_fallback(self, fail_mode: str, on: bool) -> None:
        """`on_fallback` hook of the failover rate limiter: it decides without Redis (True) or with it again."""
        self._set("ocr_ratelimit_fallback", 1.0 if on else 0.0, fail_mode=fail_mode)

    def redis_state_changed(self, data: str) -> None:
        """`on_change` hook of the Redis state watch (service/admission/redis_state.py): `lost` or `kept`."""
        self._inc("ocr_redis_resets", data=data)

    # engine call
    def waiting_for_engine(self) -> AbstractContextManager[None]:
        return self._in_flight("ocr_ingress_waiting_requests")

    # after parsing
    def page_done(self, *, task: str, source: str, timings_ms: dict[str, float], image_tokens: int,
                  output_tokens: int, confidence: float | None, finish_reason: str, adapter: str | None) -> None:
        task = task_label(task)
        for stage in STAGES:
            if stage in timings_ms:
                self._observe("ocr_stage_duration_seconds", timings_ms[stage] / 1000, task=task, stage=stage)
        self._inc("ocr_pages", task=task, source=source)
        if image_tokens > 0:
            self._inc("ocr_image_tokens", image_tokens, task=task)
            self._observe("ocr_request_image_tokens", image_tokens, task=task)
        if output_tokens > 0:
            self._inc("ocr_output_tokens", output_tokens, task=task)
            self._observe("ocr_request_output_tokens", output_tokens, task=task)
        if confidence is not None:
            self._observe("ocr_confidence", confidence, task=task)
        if finish_reason == "repetition":
            self._inc("ocr_repetition_cutoffs", task=task)
        if adapter:
            self._inc("ocr_adapter_requests", adapter=adapter)

    # after a job
    def webhook_delivered(self, outcome: str) -> None:
        """One job webhook delivery ended (outcomes: service/jobs/webhook.py OUTCOMES)."""
        self._inc("ocr_webhook_deliveries", outcome=outcome)

    def job_finished(self, status: str) -> None:
        """A job ended with this final status (JOB_END_STATES)."""
        self._inc("ocr_jobs_finished", status=status)

    def job_lost(self) -> None:
        """A running job's state vanished from the job store; its runner marked it failed `job_lost`."""
        self._inc("ocr_jobs_lost")


class EngineMetrics(_Metrics):
    """What an engine replica records."""

    process = "engine"

    def __init__(self, factory: InstrumentFactory | None = None, engine: str = "unknown"):
        super().__init__(factory)
        self.engine = engine

    @classmethod
    def for_settings(cls, settings) -> "EngineMetrics":
        metrics = cls(instrument_factory(settings), engine=settings.engine.kind)
        metrics._set("ocr_engine_gpus", float(settings.engine_deployment["ray_actor_options"].get("num_gpus", 0)))
        metrics._set("ocr_engine_ongoing_requests", 0)
        metrics.publish_start_time()
        metrics.start_refresher()
        return metrics

    def adapters_known(self, adapters: Iterable[str]) -> None:
        """Adapters the engine lists at start: their label sets at 0."""
        names = sorted(set(adapters))
        self._zero("ocr_adapter_loads", ({"adapter": a, "outcome": o} for a in names for o in ("ok", "error")))
        self._zero("ocr_adapter_cache_hits", ({"adapter": a} for a in names))

    def healthy(self, ok: bool) -> None:
        self._set("ocr_engine_healthy", 1.0 if ok else 0.0, engine=self.engine)

    def ongoing(self) -> AbstractContextManager[None]:
        return self._in_flight("ocr_engine_ongoing_requests")

    def adapter_loaded(self, adapter: str, ok: bool) -> None:
        self._inc("ocr_adapter_loads", adapter=adapter, outcome="ok" if ok else "error")

    def adapter_cache_hit(self, adapter: str) -> None:
        self._inc("ocr_adapter_cache_hits", adapter=adapter)

    @contextmanager
    def adapter_use(self, adapter: str | None, already_loaded: bool) -> Iterator[None]:
        """Around one engine call with an adapter: a cache hit when this replica had it loaded, else a load (ok, or
        error when the engine refused the adapter files). Unknown names are not counted (unbounded labels); two
        concurrent first requests for one adapter count two loads."""
        if not adapter:
            yield
            return
        try:
            yield
        except Exception as exc:
            if not already_loaded and getattr(exc, "code", None) == "invalid_adapter":
                self.adapter_loaded(adapter, ok=False)
            raise
        if already_loaded:
            self.adapter_cache_hit(adapter)
        else:
            self.adapter_loaded(adapter, ok=True)


def vllm_stat_loggers(settings) -> list | None:
    """`stat_loggers` for vLLM's AsyncLLM: its Ray stat logger inside a Ray process (exports `vllm:*` through the
    same Ray metrics agent, renamed back by METRIC_RELABEL_CONFIGS), else None (vLLM's defaults)."""
    if instrument_factory(settings) is None:
        return None
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]


# --- documentation -------------------------------------------------------------------------------------------------


def reference_table() -> str:
    """The metric reference of docs/METRICS.md (a test keeps the two in sync)."""
    rows = ["| Metric (as queried) | Type | Process | Labels | Meaning |", "|---|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        rows.append(f"| `{spec.query_name}` | {spec.kind} | {spec.process} | {labels} | {spec.description} |")
    return "\n".join(rows)
