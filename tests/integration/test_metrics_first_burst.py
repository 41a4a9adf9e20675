"""`ocr-serve serve` as its README recipe runs it, scraped by a real Prometheus configured by `ocr-serve metrics
prometheus-config`: the CLI prints the metrics port it exports on, the scrape configuration targets that port by
default, and the first burst of successes, 401s and 429s after a replica's start is counted by `increase()` and the
alert expressions (the label sets alerts and SLO panels divide by are exported at 0 before the first request)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from loadtest.common import free_port
from tests.fixtures.documents import render_document
from tests.fixtures.prometheus import SCRAPE_INTERVAL, Prometheus
from tests.fixtures.reliability import ServeProcess

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "grafana" / "alerts.yaml"
WINDOW = "3m"  # covers the whole run: the burst comes within a minute of the replica's first report


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from service.cli.keys import add_key

    workdir = tmp_path_factory.mktemp("first-burst")
    keys_file = workdir / "keys.yaml"
    keys = {"globex": add_key(keys_file, tenant="globex")[0],
            "acme": add_key(keys_file, tenant="acme", rate=0.01, burst=2)[0]}  # 2 requests, then 429s
    metrics_port = free_port()
    env = {"OCR_METRICS_EXPORT_PORT": str(metrics_port), "OCR_API_KEYS_FILE": str(keys_file)}
    proc = ServeProcess(workdir / "serve.log", env)
    try:
        yield proc, keys, metrics_port
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def prometheus(service):
    """A real Prometheus with the configuration `ocr-serve metrics prometheus-config` prints for the service's
    environment (no --target), scraping every 2 s (SCRAPE_INTERVAL), with the product's alert rules."""
    proc, _, _ = service
    out = subprocess.run([sys.executable, "-m", "service.cli", "metrics", "prometheus-config",
                          "--scrape-interval", SCRAPE_INTERVAL], env=proc.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    config["rule_files"] = [str(ALERTS)]
    workdir = Path(tempfile.mkdtemp(prefix="ocr-prometheus-"))
    prom = Prometheus(workdir, [], [], config=config).start()
    try:
        yield prom
    finally:
        prom.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_serve_prints_the_metrics_port_the_scrape_config_targets(service, prometheus):
    proc, _, metrics_port = service
    line = re.search(r"ocr-serve: metrics at (\S+) \(scrape config: `([^`]+)`\)", proc.log())
    assert line, proc.log()[-3000:]
    assert line.group(1) == f"http://127.0.0.1:{metrics_port}/metrics"
    assert line.group(2) == "ocr-serve metrics prometheus-config"  # the port is the configured one: no --target
    job = prometheus.config["scrape_configs"][0]
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{metrics_port}"]
    assert job["static_configs"][0]["labels"] == {"namespace": "local", "ocr_release": "ocr"}
    prometheus.wait_for('up{job="ray"} == 1', 60)
    prometheus.wait_for("ocr_latency_slo_seconds", 90)  # the ingress replica's first report


def value(prom: Prometheus, expr: str) -> float:
    return sum(float(sample["value"][1]) for sample in prom.query(expr))


def test_first_burst_of_errors_and_429s_is_counted(service, prometheus):
    proc, keys, _ = service
    prom = prometheus
    prom.wait_for("ocr_latency_slo_seconds", 90)
    time.sleep(12)  # one more report interval of Ray's metrics agent: whatever the replica exports at start is in
    statuses: dict[tuple[str, int], int] = {}
    page = {"image": base64.b64encode(render_document(["Total 42.00"], size=(200, 80)).png()).decode(),
            "task": "text"}
    for tenant, key, count in [("acme", keys["acme"], 12), ("globex", keys["globex"], 8), (None, "not-a-key", 6)]:
        for _ in range(count):  # each charged to the tenant's bucket first; the mock engine reads the page
            resp = httpx.post(proc.url + "/v1/ocr", json=page, headers={"Authorization": f"Bearer {key}"},
                              timeout=30)
            statuses[(tenant, resp.status_code)] = statuses.get((tenant, resp.status_code), 0) + 1
    sent = sum(statuses.values())
    # acme's bucket holds 2: the rest of its requests are 429s
    assert statuses[("acme", 429)] >= 8 and statuses[("globex", 200)] == 8 and statuses[(None, 401)] == 6, statuses
    prom.wait_for(f"sum(ocr_requests_total) == {sent}", 90)
    time.sleep(3)  # a few more scrapes of the final values

    def increase(selector: str) -> float:
        return value(prom, f"sum(increase({selector}[{WINDOW}]))")

    counted = {
        "429": (increase('ocr_requests_total{code="rate_limited"}'), statuses[("acme", 429)]),
        "200": (increase('ocr_requests_total{code="ok"}'), statuses[("globex", 200)] + statuses.get(("acme", 200), 0)),
        "401": (increase('ocr_requests_total{code="unauthorized"}'), statuses[(None, 401)]),
        "429 of acme": (increase('ocr_rate_limited_total{tenant="acme"}'), statuses[("acme", 429)]),
        "requests of globex": (increase('ocr_tenant_requests_total{tenant="globex"}'), 8),
        "auth failures": (increase('ocr_auth_failures_total{reason="unauthorized"}'), statuses[(None, 401)]),
    }
    print(f"\nfirst burst: increase() over {WINDOW} vs sent: {counted}")
    # increase() extrapolates to the window's edges: the counts come back within a wide margin, never as 0
    for name, (seen, count) in counted.items():
        assert 0.5 * count <= seen <= 2 * count, (name, counted)

    # the alert expression sees the burst (a third of the requests were 429s)
    rising = prom.query(next(rule["query"] for rule in prom.rules() if rule["name"] == "OCRRising429s"))
    assert [s["metric"] for s in rising] == [{"namespace": "local", "ocr_release": "ocr"}], rising
    # known label sets that saw no request are there at 0 (an image-token panel of the CPU engine reads 0, not
    # "No data")
    assert prom.query('ocr_requests_total{code="engine_unavailable", endpoint="ocr", task="text"} == 0')
    assert prom.query('ocr_image_tokens_total{task="spotting"} == 0')
    assert prom.query('ocr_repetition_cutoffs_total{task="text"} == 0')
    # every request counter series keeps its labels: the overflow alert's expression finds nothing on real data
    overflow = next(rule["query"] for rule in prom.rules() if rule["name"] == "OCRMetricsSeriesOverflow")
    assert prom.query(overflow) == []
    assert prom.query('count(ocr_requests_total{replica!=""}) > 0')
    # one replica's share of the agent's 2000 series per metric stays small (service/observability/metrics.py)
    assert value(prom, "count(ocr_requests_total)") <= 110 and value(prom, "count(ocr_tenant_requests_total)") <= 10
    # Ray's per-process labels are gone from the product's series
    assert not prom.query('{__name__=~"ocr_.+", WorkerId!=""}')
    assert prom.query('ocr_replica_start_time_seconds{deployment="OCRIngress"}')
