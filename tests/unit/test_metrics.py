"""Metrics without Ray: the metric registry, dashboard JSON lint, alert rules, the relabel rules shipped for
Prometheus, the docs table, and what the ingress records per request (in-process app, recording instruments). The
alert rules through the real promtool: tests/integration/test_metrics.py; the dashboards' vLLM metrics against vLLM's
own definitions: tests/engine/test_metrics.py."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from service.observability.metrics import (
    METRIC_RELABEL_CONFIGS,
    METRICS,
    METRICS_BY_NAME,
    MAX_ZEROED_TENANTS,
    IngressMetrics,
    MetricSpec,
    reference_table,
)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
METRIC_NAME = re.compile(r"\b((?:ocr_(?!release\b)|vllm:)[a-zA-Z0-9_:]+)")
SCOPE_SELECTOR = 'namespace=~"$namespace", ocr_release=~"$release"'


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def exprs_of(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def exported_names() -> set[str]:
    return {name for spec in METRICS for name in spec.exported_names}


# --- registry ------------------------------------------------------------------------------------------------------


def test_metric_registry_is_bounded_and_prefixed():
    assert len({spec.name for spec in METRICS}) == len(METRICS)
    for spec in METRICS:
        assert re.fullmatch(r"ocr_[a-z0-9_]+", spec.name), spec.name
        assert not spec.name.endswith("_total"), "counters are named without _total (the exporter appends it)"
        assert spec.description
        # Serve adds these; per-request ids would make the series count unbounded
        assert not set(spec.labels) & {"deployment", "replica", "application", "request_id", "id", "key", "path"}
        assert (spec.buckets is not None) == (spec.kind == "histogram"), spec.name
        if spec.buckets:
            assert list(spec.buckets) == sorted(set(spec.buckets)) and spec.buckets[0] > 0


def test_reference_table_is_in_the_docs():
    assert reference_table() in (ROOT / "docs" / "METRICS.md").read_text()


# --- dashboards ----------------------------------------------------------------------------------------------------


def test_dashboards_exist_and_have_unique_uids():
    names = {p.stem for p in DASHBOARDS}
    assert {"overview", "engine", "capacity", "tenants"} <= names
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids)) and all(uids)
    titles = [load(p)["title"] for p in DASHBOARDS]
    assert len(titles) == len(set(titles))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_lint(path: Path):
    dash = load(path)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}"
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        where = f"{dash['uid']} / {panel['title']}"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{where}: no unit"
        assert defaults["thresholds"]["steps"], f"{where}: no thresholds"
        assert panel["targets"], where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, where
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", where
            assert target["expr"].count("(") == target["expr"].count(")"), where


def dashboard_metric_names() -> dict[str, set[str]]:
    """Every metric name a dashboard query references, by dashboard file name."""
    return {path.name: {name for expr in exprs_of(load(path)) for name in METRIC_NAME.findall(expr)}
            for path in DASHBOARDS}


def test_dashboards_reference_only_defined_metrics():
    """Our metrics here; the vLLM ones against vLLM's own definitions in tests/engine/test_metrics.py."""
    known = exported_names()
    referenced: set[str] = set()
    for dashboard, names in dashboard_metric_names().items():
        referenced |= names
        for name in names:
            if name.startswith("ocr_"):
                assert name in known, f"{dashboard}: {name} is not defined in service/observability/metrics.py"
    assert any(name.startswith("vllm:") for name in referenced)
    # every metric the service records is on some dashboard
    unused = [spec.name for spec in METRICS if not set(spec.exported_names) & referenced]
    assert not unused, unused


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboards_are_scoped_by_namespace_and_release(path: Path):
    """Every metric selector of every query filters on the namespace and release variables (with `All`, one
    release's panels can still be picked apart: the variables list each)."""
    dash = load(path)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["namespace"]["query"]["query"] == "label_values(ocr_requests_total, namespace)"
    assert variables["release"]["query"]["query"] == \
        'label_values(ocr_requests_total{namespace=~"$namespace"}, ocr_release)'
    exprs = exprs_of(dash) + [v["query"]["query"] for v in variables.values()
                              if v["type"] == "query" and v["name"] not in ("namespace", "release")]
    for expr in exprs:
        for match in re.finditer(r"\b((?:ocr_(?!release\b)|vllm:)[a-zA-Z0-9_:]+)(\{[^}]*\})?", expr):
            assert match.group(2) and match.group(2)[1:].startswith(SCOPE_SELECTOR), (path.name, expr)


# --- alerts --------------------------------------------------------------------------------------------------------


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load((GRAFANA / "alerts.yaml").read_text())["groups"] for rule in group["rules"]]


def test_every_alert_is_scoped_and_has_a_runbook_section():
    runbook = (ROOT / "docs" / "RUNBOOK.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
               for line in runbook.splitlines() if line.startswith("## ")}
    for rule in alert_rules():
        name = rule["alert"]
        # every aggregation keeps the scope labels, so one release's health never hides another's
        for grouping in re.findall(r"\b(?:sum|max|min|count|group|avg)\s*(?:by\s*\(([^)]*)\))?\s*\(", rule["expr"]):
            assert {"namespace", "ocr_release"} <= {g.strip() for g in grouping.split(",")}, (name, rule["expr"])
        assert "{{ $labels.ocr_release }}" in rule["annotations"]["summary"], name
        url = rule["annotations"]["runbook_url"]
        assert url.endswith(f"docs/RUNBOOK.md#{name.lower()}"), (name, url)
        assert name.lower() in anchors, f"docs/RUNBOOK.md has no section `## {name}`"
        section = runbook.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("What it means", "What to check", "What to do"):
            assert f"**{part}**" in section, (name, part)



def test_alert_rules_reference_defined_metrics():
    known = exported_names()
    for group in yaml.safe_load((GRAFANA / "alerts.yaml").read_text())["groups"]:
        for rule in group["rules"]:
            for name in METRIC_NAME.findall(rule["expr"]):
                # vLLM's names: those the dashboards use (checked against vLLM's definitions in tests/engine)
                assert name in known or name in set().union(*dashboard_metric_names().values()), (rule["alert"], name)


# --- scrape configuration shipped for Prometheus --------------------------------------------------------------------


def _camel(config: dict) -> dict:
    names = {"source_labels": "sourceLabels", "target_label": "targetLabel"}
    return {names.get(k, k): v for k, v in config.items()}


def test_shipped_scrape_configs_use_the_relabel_rules():
    scrape = yaml.safe_load((GRAFANA / "prometheus-scrape.yaml").read_text())
    for job in scrape["scrape_configs"]:
        assert job["metric_relabel_configs"] == METRIC_RELABEL_CONFIGS, job["job_name"]
    pod_monitor = yaml.safe_load((GRAFANA / "podmonitor.yaml").read_text())
    assert pod_monitor["kind"] == "PodMonitor"
    for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["metricRelabelings"] == [_camel(c) for c in METRIC_RELABEL_CONFIGS]


def test_relabel_rules_drop_rays_per_process_labels_from_product_series_only():
    """Applied as Prometheus does (a `replace` to an empty value deletes the label): WorkerId/SessionName change at
    every replica or node restart, so they leave the product's series; Ray's own per-worker series keep them."""
    def relabel(labels: dict[str, str]) -> dict[str, str]:
        labels = dict(labels)
        for rule in METRIC_RELABEL_CONFIGS:
            if rule.get("action") == "labeldrop":
                labels = {k: v for k, v in labels.items() if not re.fullmatch(rule["regex"], k)}
                continue
            value = ";".join(labels.get(name, "") for name in rule["source_labels"])
            match = re.fullmatch(rule["regex"], value)
            if match:
                new = match.expand(rule["replacement"].replace("$1", r"\g<1>"))
                if new:
                    labels[rule["target_label"]] = new
                else:
                    labels.pop(rule["target_label"], None)
        return labels

    ray_labels = {"WorkerId": "abc", "SessionName": "session_2026", "replica": "OCRIngress#x1", "Component": "core"}
    assert relabel({"__name__": "ray_ocr_requests_total", **ray_labels}) == {
        "__name__": "ocr_requests_total", "replica": "OCRIngress#x1", "Component": "core"}
    assert "WorkerId" not in relabel({"__name__": "ray_vllm_num_requests_running", **ray_labels})
    assert relabel({"__name__": "ray_component_cpu_percentage", **ray_labels})["WorkerId"] == "abc"


def test_relabel_rules_map_ray_names_to_product_names():
    """The regexes as Prometheus applies them (fully anchored, $1 = first group)."""
    def relabel(name: str) -> str:
        for rule in METRIC_RELABEL_CONFIGS:
            if rule.get("target_label") == "__name__":
                match = re.fullmatch(rule["regex"], name)
                if match:
                    return rule["replacement"].replace("$1", match.group(1))
        return name

    assert relabel("ray_ocr_requests_total") == "ocr_requests_total"
    assert relabel("ray_vllm_num_requests_waiting") == "vllm:num_requests_waiting"
    assert relabel("ray_vllm_time_to_first_token_seconds_bucket") == "vllm:time_to_first_token_seconds_bucket"
    assert relabel("ray_serve_deployment_replica_healthy") == "ray_serve_deployment_replica_healthy"


# --- what the ingress records (in-process app, no Ray) --------------------------------------------------------------


class Recorder:
    """Instrument factory that keeps every call: (metric, method, value, tags)."""

    def __init__(self):
        self.calls: list[tuple[str, str, float, dict]] = []

    def __call__(self, spec: MetricSpec):
        recorder = self

        class Instrument:
            def inc(self, value=1.0, tags=None):
                recorder.calls.append((spec.name, "inc", value, tags or {}))

            def zero(self, tags=None):
                recorder.calls.append((spec.name, "zero", 0, tags or {}))

            def set(self, value, tags=None):
                recorder.calls.append((spec.name, "set", value, tags or {}))

            def observe(self, value, tags=None):
                recorder.calls.append((spec.name, "observe", value, tags or {}))

        return Instrument()

    def of(self, name: str) -> list[tuple[str, str, float, dict]]:
        return [c for c in self.calls if c[0] == name]


def png_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def test_ingress_records_requests_pages_and_errors():
    import httpx

    from service.http.app import create_app
    from service.pipeline.context import AppContext
    from service.engine.mock import MockEngine
    from service.config import Settings

    recorder = Recorder()
    # three tokens: the two good requests and the bad base64 (paid for before it is decoded)
    settings = Settings(engine="mock", default_rate=0.001, default_burst=3, max_body_bytes=4096)
    metrics = IngressMetrics(recorder)
    metrics.publish_config(settings)
    ctx = AppContext(settings=settings, engine=MockEngine(), metrics=metrics)
    transport = httpx.ASGITransport(app=create_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        ok = await client.post("/v1/ocr", json={"image": png_b64(), "task": "spotting"})
        assert ok.status_code == 200, ok.text
        bad = await client.post("/v1/ocr", json={"image": "%%%", "task": "spotting"})
        assert bad.status_code == 400
        too_big = await client.post("/v1/ocr", content=b"{" + b" " * 8000 + b"}",
                                    headers={"content-type": "application/json"})
        assert too_big.status_code == 413
        await client.post("/v1/ocr", json={"image": png_b64(), "task": "text"})  # uses the last token
        limited = await client.post("/v1/ocr", json={"image": png_b64(), "task": "text"})
        assert limited.status_code == 429
        assert (await client.get("/healthz")).status_code == 200  # not an API request: not counted

    requests = [(c[3]["task"], c[3]["status"], c[3]["code"]) for c in recorder.of("ocr_requests")]
    # an unreadable body has no task yet: `unknown`
    assert requests == [("spotting", "200", "ok"), ("spotting", "400", "invalid_base64"),
                        ("unknown", "413", "payload_too_large"), ("text", "200", "ok"), ("text", "429", "rate_limited")]
    tenants = [(c[3]["tenant"], c[3]["status"]) for c in recorder.of("ocr_tenant_requests")]
    assert tenants == [("anonymous", "200"), ("anonymous", "400"), ("unknown", "413"), ("anonymous", "200"),
                       ("anonymous", "429")]
    assert [c[3] for c in recorder.of("ocr_rate_limited")] == [{"tenant": "anonymous"}]
    outcomes = [c[3]["outcome"] for c in recorder.of("ocr_request_duration_seconds")]
    assert outcomes == ["ok", "client_error", "client_error", "ok", "client_error"]
    assert [c[3] for c in recorder.of("ocr_pages")] == [{"task": "spotting", "source": "image"},
                                                        {"task": "text", "source": "image"}]
    stages = {c[3]["stage"] for c in recorder.of("ocr_stage_duration_seconds")}
    assert stages == {"decode", "queue", "engine", "parse"}
    assert all(c[2] > 0 for c in recorder.of("ocr_output_tokens"))  # the mock engine reports tokens
    waiting = [c[2] for c in recorder.of("ocr_ingress_waiting_requests")]
    assert waiting[-1] == 0 and max(waiting) == 1
    assert ("ocr_autoscaling_config", "set", 8.0, {"setting": "target_ongoing_requests"}) in recorder.calls
    assert ("ocr_latency_slo_seconds", "set", settings.observability.latency_slo_s, {}) in recorder.calls


def test_backend_error_hook_and_refresh():
    recorder = Recorder()
    metrics = IngressMetrics(recorder)
    metrics.limiter_backend_error(ConnectionError("redis down"))
    assert recorder.of("ocr_ratelimit_backend_errors") == [
        ("ocr_ratelimit_backend_errors", "inc", 1.0, {"error": "ConnectionError"})]
    metrics.publish_config(__import__("service.config", fromlist=["Settings"]).Settings())
    before = len(recorder.of("ocr_latency_slo_seconds"))
    metrics.refresh()  # idle replicas re-set their gauges so Ray's agent keeps the series
    assert len(recorder.of("ocr_latency_slo_seconds")) == before + 1


def test_metrics_can_be_switched_off():
    from service.config import Settings

    assert IngressMetrics.for_settings(Settings(metrics_enabled=False)).enabled is False
    assert METRICS_BY_NAME["ocr_requests"].exported_names == ("ocr_requests_total",)


def test_engine_adapter_use_counts_hits_loads_and_refused_adapters():
    from service.errors import OCRError
    from service.observability.metrics import EngineMetrics

    recorder = Recorder()
    metrics = EngineMetrics(recorder, engine="vllm")
    with metrics.adapter_use("invoices", already_loaded=False):
        pass
    with metrics.adapter_use("invoices", already_loaded=True):
        pass
    with pytest.raises(OCRError), metrics.adapter_use("broken", already_loaded=False):
        raise OCRError("invalid_adapter", "rank too large")
    with pytest.raises(OCRError), metrics.adapter_use("no-such-adapter", already_loaded=False):
        raise OCRError("unknown_adapter", "does not exist")  # never a label
    with metrics.adapter_use(None, already_loaded=False):
        pass
    assert [c[3] for c in recorder.of("ocr_adapter_loads")] == [{"adapter": "invoices", "outcome": "ok"},
                                                               {"adapter": "broken", "outcome": "error"}]
    assert [c[3] for c in recorder.of("ocr_adapter_cache_hits")] == [{"adapter": "invoices"}]
    with metrics.ongoing():
        assert recorder.of("ocr_engine_ongoing_requests")[-1][2] == 1
    assert recorder.of("ocr_engine_ongoing_requests")[-1][2] == 0


# --- label sets at 0 (a first increment must be an increase) --------------------------------------------------------


def zeroed(recorder: Recorder, name: str) -> list[dict]:
    return [c[3] for c in recorder.of(name) if c[1] == "zero"]


def test_ingress_starts_the_alerts_label_sets_at_zero_and_no_more(tmp_path):
    from service.admission.auth import make_authenticator
    from service.cli.keys import add_key
    from service.config import Settings
    from service.tasks import TASKS

    keys_file = tmp_path / "keys.yaml"
    add_key(keys_file, tenant="acme")
    settings = Settings(engine="mock", api_keys_file=str(keys_file), redis_url="redis://127.0.0.1:1/0")
    recorder = Recorder()
    metrics = IngressMetrics(recorder)
    metrics.start_at_zero(settings)
    authenticator = make_authenticator(settings, on_tenants=metrics.tenants_known)
    requests = zeroed(recorder, "ocr_requests")
    # every endpoint x task x (its successes, 429s, the load-related 503s); 401s (before the task is read) as
    # `unknown`; not the whole error table
    for endpoint in ("ocr", "jobs"):
        for task in (*TASKS, "unknown"):
            for status, code in [("200", "ok"), ("429", "rate_limited"), ("503", "overloaded"),
                                 ("503", "engine_unavailable")]:
                assert {"endpoint": endpoint, "task": task, "status": status, "code": code} in requests
        assert {"endpoint": endpoint, "task": "unknown", "status": "401", "code": "unauthorized"} in requests
    assert {"endpoint": "jobs", "task": "text", "status": "202", "code": "ok"} in requests
    assert {r["code"] for r in requests} == {"ok", "rate_limited", "overloaded", "engine_unavailable", "unauthorized"}
    assert len(requests) == len({tuple(sorted(t.items())) for t in requests}) == 101  # each once
    tenants = zeroed(recorder, "ocr_tenant_requests")
    assert {"tenant": "acme", "status": "429", "code": "rate_limited"} in tenants
    assert {"tenant": "acme", "status": "200", "code": "ok"} in tenants
    assert {"tenant": "unknown", "status": "401", "code": "unauthorized"} in tenants
    assert not any(t["tenant"] == "anonymous" for t in tenants)  # a key file: no anonymous requests
    assert zeroed(recorder, "ocr_rate_limited") == [{"tenant": "acme"}]
    assert {"task": "spotting"} in zeroed(recorder, "ocr_image_tokens")
    assert {"task": "spotting"} in zeroed(recorder, "ocr_repetition_cutoffs")
    assert {"outcome": "timeout"} in zeroed(recorder, "ocr_webhook_deliveries")
    assert {"status": "failed"} in zeroed(recorder, "ocr_jobs_finished")
    assert {"data": "lost"} in zeroed(recorder, "ocr_redis_resets") and zeroed(recorder, "ocr_jobs_lost") == [{}]
    assert {"reason": "unauthorized"} in zeroed(recorder, "ocr_auth_failures")

    # a tenant added to the key file gets its label sets at the reload; the known ones are not exported again
    before = len(recorder.calls)
    add_key(keys_file, tenant="globex")
    authenticator._next_check = 0
    authenticator._maybe_reload()
    added = recorder.calls[before:]
    assert {c[3]["tenant"] for c in added if c[0] == "ocr_tenant_requests"} == {"globex"}
    assert metrics.zero_series_count == len({(c[0], tuple(sorted(c[3].items()))) for c in recorder.calls
                                             if c[1] == "zero"})
    # bounded: requests' label sets do not grow with tenants, and the tenants zeroed stop at MAX_ZEROED_TENANTS
    assert metrics.zero_series_count < 2 * len(requests) + 4 * len(tenants)
    metrics.tenants_known([f"tenant-{i:04d}" for i in range(5000)])
    zeroed_tenants = {t["tenant"] for t in zeroed(recorder, "ocr_tenant_requests")} - {"unknown"}
    assert len(zeroed_tenants) == MAX_ZEROED_TENANTS and {"acme", "globex"} <= zeroed_tenants
    # a node's agent keeps 2000 series per metric for every replica that ran there: a replica takes a fraction
    assert len(requests) * 10 < 2000


def test_open_mode_starts_anonymous_and_no_redis_series_without_redis():
    from service.config import Settings

    recorder = Recorder()
    metrics = IngressMetrics(recorder)
    metrics.start_at_zero(Settings(engine="mock"))
    assert {"tenant": "anonymous", "status": "200", "code": "ok"} in zeroed(recorder, "ocr_tenant_requests")
    assert zeroed(recorder, "ocr_rate_limited") == [{"tenant": "anonymous"}]
    assert not zeroed(recorder, "ocr_redis_resets") and not zeroed(recorder, "ocr_ratelimit_backend_errors")


def test_zero_is_exported_without_incrementing_a_ray_counter():
    """Ray's Counter.inc refuses 0; RayCounter.zero records 0 through the record call underneath it."""
    from service.observability.metrics import RayCounter

    class FakeRayCounter:
        def __init__(self):
            self.records = []

        def inc(self, value=1.0, tags=None):
            if value <= 0:
                raise ValueError("value must be >0")
            self._record(value, tags=tags)

        def _record(self, value, tags=None):
            self.records.append((value, tags))

    fake = FakeRayCounter()
    counter = RayCounter(fake)
    counter.zero(tags={"code": "rate_limited"})
    counter.inc(2.0, tags={"code": "rate_limited"})
    assert fake.records == [(0, {"code": "rate_limited"}), (2.0, {"code": "rate_limited"})]


def test_limiter_fallback_gauge_follows_the_limiter():
    import asyncio

    from service.admission.ratelimit import FailoverLimiter

    class Broken:
        async def acquire(self, *args):
            raise ConnectionError("redis down")

        async def close(self):
            pass

    recorder = Recorder()
    metrics = IngressMetrics(recorder)
    limiter = FailoverLimiter(Broken(), fail_mode="open", on_backend_error=metrics.limiter_backend_error,
                              on_fallback=metrics.limiter_fallback)
    assert recorder.of("ocr_ratelimit_fallback")[-1][2:] == (0.0, {"fail_mode": "open"})
    asyncio.run(limiter.acquire("acme", 1, 1.0, 5.0))
    assert recorder.of("ocr_ratelimit_fallback")[-1][2:] == (1.0, {"fail_mode": "open"})


def test_job_and_webhook_outcomes_match_the_job_module():
    from service.jobs import model, webhook
    from service.observability.metrics import JOB_END_STATES, WEBHOOK_OUTCOMES

    assert set(WEBHOOK_OUTCOMES) == set(webhook.OUTCOMES)
    assert set(JOB_END_STATES) == set(model.TERMINAL)


# --- `ocr-serve metrics prometheus-config` and `ocr-serve serve` agree on the metrics port ---------------------------


def test_prometheus_config_scrapes_the_port_serve_exports_on(monkeypatch, capsys):
    from service.cli.main import main
    from service.config import Settings

    for name in [n for n in __import__("os").environ if n.startswith("OCR_")]:
        monkeypatch.delenv(name)
    assert Settings().observability.metrics_export_port == 8080  # serve's default (KubeRay's port too)
    assert main(["metrics", "prometheus-config"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)["scrape_configs"][0]
    assert job["static_configs"] == [{"targets": ["127.0.0.1:8080"],
                                      "labels": {"namespace": "local", "ocr_release": "ocr"}}]
    assert job["metric_relabel_configs"] == METRIC_RELABEL_CONFIGS

    monkeypatch.setenv("OCR_METRICS_EXPORT_PORT", "9464")
    assert main(["metrics", "prometheus-config", "--release", "canary"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)["scrape_configs"][0]
    assert job["static_configs"] == [{"targets": ["127.0.0.1:9464"],
                                      "labels": {"namespace": "local", "ocr_release": "canary"}}]

    # a free port each start: the command cannot know it and says what to pass
    monkeypatch.setenv("OCR_METRICS_EXPORT_PORT", "")
    assert main(["metrics", "prometheus-config"]) == 2
    assert "--target" in capsys.readouterr().err


def test_serve_refuses_a_taken_metrics_port_in_one_line():
    import socket

    from service.serve.local import PortInUse, check_metrics_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=f"metrics port {port} on 127.0.0.1: .*OCR_METRICS_EXPORT_PORT"):
            check_metrics_port(port)
    check_metrics_port(port)  # free again


def test_gauges_are_re_set_within_ray_s_report_interval():
    """Ray's agent drops a gauge not re-reported for two report intervals: the refresher runs every half interval,
    whatever the interval (tests run Ray at 2 s, where a fixed 5 s refresh let gauges vanish between scrapes)."""
    from service.observability.metrics import gauge_refresh_s

    assert gauge_refresh_s({}) == 5.0  # Ray's default 10 s
    assert gauge_refresh_s({"RAY_metrics_report_interval_ms": "2000"}) == 1.0
    assert gauge_refresh_s({"RAY_metrics_report_interval_ms": "not-a-number"}) == 5.0
    assert gauge_refresh_s({"RAY_metrics_report_interval_ms": "0"}) == 5.0
