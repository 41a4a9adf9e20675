"""Metrics end to end: the Serve app (embedded engine, API keys, Redis limiter) and a real Prometheus scraping the Ray
metrics agent with the product's relabel rules. Traffic includes successes, bad input (4xx), auth failures, 429s and
a Redis outage; then every query of every Grafana dashboard panel must return data through Prometheus' HTTP API.

Panels fed only by a VLM engine (vLLM's `vllm:*`, the per-request token histograms, LoRA adapters) have no data with
the embedded engine; `VLM_ONLY` names them and tests/engine/test_metrics_vllm.py covers them. The token and
repetition cut-off counters read 0 here (exported at 0 when the replica starts).
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.observability.metrics import LOCAL_NAMESPACE, LOCAL_RELEASE
from tests.conftest import METRICS_REPORT_S
from tests.fixtures.documents import render_document
from tests.integration.test_metrics import ALERT_NAMES

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
ALERTS = ROOT / "deploy" / "grafana" / "alerts.yaml"
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes here (scrape interval 2 s)
VLM_ONLY = ("vllm:", "ocr_request_image_tokens", "ocr_request_output_tokens", "ocr_adapter_")


def live_ingress_replica_ids() -> list[str]:
    """Unique ids of this app's live ingress replicas (Serve names its replica actors `...#OCRIngress#<id>`)."""
    import ray

    ids = [actor["name"].rsplit("#", 1)[-1] for actor in ray.util.list_named_actors(all_namespaces=True)
           if "#OCRIngress#" in actor["name"]]
    assert ids, "no live ingress replica"
    return ids


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) of every panel target."""
    out = []
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out.append((dash["uid"], panel["title"], target["expr"]))
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, variable, label_values(selector, label)) of every query variable."""
    out = []
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        dash = json.loads(path.read_text())
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                out.append((dash["uid"], var["name"], var["query"]["query"]))
    return out


def substitute(expr: str) -> str:
    """Grafana's variables as Grafana would render them with `All` selected, the namespace and release of
    prometheus_config's local targets."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", RATE_INTERVAL)
    expr = expr.replace("$namespace", LOCAL_NAMESPACE).replace("$release", LOCAL_RELEASE)
    return re.sub(r"\$\{?(task|tenant)\}?", ".*", expr)


def is_vlm_only(expr: str) -> bool:
    return any(name in expr for name in VLM_ONLY)


@dataclass
class Stack:
    url: str
    prom: object
    redis: object
    keys: dict[str, str]

    def ocr(self, tenant: str | None, body: dict, key: str | None = None) -> httpx.Response:
        headers = {}
        if key or tenant:
            headers["Authorization"] = f"Bearer {key or self.keys[tenant]}"
        return httpx.post(self.url + "/v1/ocr", json=body, headers=headers, timeout=120)


def small_page_b64() -> str:
    doc = render_document(["Invoice 2024-117", "Total 42.00 EUR"], size=(640, 320), top=60, gap=120, left=40)
    buf = io.BytesIO()
    doc.image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def stack(serve_app, prometheus_server, redis_server_module, tmp_path_factory) -> Stack:
    from service.cli.keys import add_key

    keys_file = tmp_path_factory.mktemp("metrics-keys") / "keys.yaml"
    keys = {"globex": add_key(keys_file, tenant="globex")[0],
            "acme": add_key(keys_file, tenant="acme", rate=0.05, burst=2)[0]}  # 2 requests, then 429s
    # one request per engine replica and one queued at the ingress: a concurrent burst gets 503 `overloaded`
    url = serve_app(engine="embedded", api_keys_file=str(keys_file), redis_url=redis_server_module.url,
                    rate_limit_fail_mode="open", default_rate=100.0, default_burst=100.0,
                    max_ongoing_requests=1, max_queued_requests=1)
    prom = prometheus_server(rule_files=[ALERTS])
    return Stack(url, prom, redis_server_module, keys)


def drive_traffic(stack: Stack, image: str) -> dict[int, int]:
    """One round of mixed traffic; returns the count per HTTP status."""
    statuses: dict[int, int] = {}

    def count(resp: httpx.Response) -> None:
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1

    for _ in range(2):
        resp = stack.ocr("globex", {"image": image, "task": "spotting"})
        assert resp.status_code == 200, resp.text
        count(resp)
    resp = stack.ocr("globex", {"image": image, "task": "text"})
    assert resp.status_code == 200, resp.text
    count(resp)
    with httpx.stream("POST", stack.url + "/v1/ocr", json={"image": image, "task": "spotting", "stream": True},
                      headers={"Authorization": f"Bearer {stack.keys['globex']}"}, timeout=120) as resp:
        assert resp.status_code == 200
        assert "event: result" in resp.read().decode()
        count(resp)
    for body, code in [({"image": "!!!not base64!!!", "task": "spotting"}, "invalid_base64"),
                       ({"image": image, "task": "sing-a-song"}, "unknown_task")]:
        resp = stack.ocr("globex", body)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == code, resp.text
        count(resp)
    for key in (None, "not-a-real-key"):
        resp = httpx.post(stack.url + "/v1/ocr", json={"image": image, "task": "spotting"}, timeout=60,
                          headers={"Authorization": f"Bearer {key}"} if key else {})
        assert resp.status_code == 401, resp.text
        count(resp)
    for _ in range(4):  # burst 2 at 0.05 tokens/s: at least two 429s
        count(stack.ocr("acme", {"image": image, "task": "spotting"}))
    with ThreadPoolExecutor(6) as pool:  # more than one running + one queued: 503 `overloaded` (a real 5xx)
        for resp in pool.map(lambda _: stack.ocr("globex", {"image": image, "task": "spotting"}), range(6)):
            assert resp.status_code in (200, 503), resp.text
            count(resp)
    return statuses


def series_value(result: list[dict]) -> float:
    return sum(float(sample["value"][1]) for sample in result)


def test_every_dashboard_query_returns_data(stack: Stack):
    prom = stack.prom
    image = small_page_b64()
    first = drive_traffic(stack, image)
    assert first.get(429, 0) >= 2 and first.get(401) == 2 and first.get(400) == 2 and first.get(503), first
    # Ray's processes report their metrics every METRICS_REPORT_S: wait until this round is in Prometheus, then make
    # a second one so that every counter grows inside the rate window
    prom.wait_for('sum(ocr_requests_total{code="rate_limited"}) > 0')  # (its series exist at 0 from the start)
    prom.wait_for('sum(ocr_engine_healthy)')
    stack.redis.kill()  # Redis outage: the limiter fails open and counts backend errors
    second = drive_traffic(stack, image)
    assert second.get(200, 0) >= 4, second
    prom.wait_for("sum(ocr_ratelimit_backend_errors_total) > 0")
    time.sleep(METRICS_REPORT_S + 1)  # one more report interval with Redis down
    third = drive_traffic(stack, image)
    assert third.get(200, 0) >= 4, third
    sent = sum(first.values()) + sum(second.values()) + sum(third.values())
    # every request counted once, all rounds in Prometheus; only this app's ingress replicas count (in-process apps of
    # other test modules record into the same Ray session, and series of replaced replicas linger two report intervals)
    replicas = "|".join(live_ingress_replica_ids())
    prom.wait_for(f'sum(ocr_requests_total{{deployment="OCRIngress", replica=~".*({replicas})"}}) == {sent}')
    prom.wait_for(f'sum(increase(ocr_ratelimit_backend_errors_total[{RATE_INTERVAL}])) > 0')

    empty, checked, skipped = [], 0, []
    for uid, title, expr in dashboard_queries():
        if is_vlm_only(expr):
            skipped.append(f"{uid} / {title}")
            continue
        result = prom.query(substitute(expr))
        checked += 1
        finite = [s for s in result if math.isfinite(float(s["value"][1]))]
        if not finite:
            empty.append(f"{uid} / {title}: {substitute(expr)} -> {result}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    assert checked >= 30, checked
    print(f"\n{checked} dashboard queries returned data; VLM-only panels not checked here: {sorted(set(skipped))}")

    for uid, name, query in variable_queries():
        selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query).groups()
        values = prom.api(f"label/{label}/values", **{"match[]": substitute(selector)})
        assert values, (uid, name, query)
        if name == "tenant":
            assert {"acme", "globex"} <= set(values), values
        if name == "task":
            assert {"spotting", "text"} <= set(values), values
        if name in ("namespace", "release"):
            assert values == [LOCAL_NAMESPACE if name == "namespace" else LOCAL_RELEASE], values

    # label values are the bounded ones the service defines
    codes = {s["metric"]["code"] for s in prom.query("ocr_requests_total > 0")}
    assert {"ok", "invalid_base64", "unknown_task", "unauthorized", "rate_limited", "overloaded"} <= codes, codes
    assert prom.query(f'sum(rate(ocr_requests_total{{status="503"}}[{RATE_INTERVAL}])) > 0')
    assert {s["metric"]["tenant"] for s in prom.query('ocr_tenant_requests_total{code="unauthorized"} > 0')} == \
        {"unknown"}
    assert series_value(prom.query('sum(ocr_auth_failures_total{reason="unauthorized"})')) >= 6
    assert series_value(prom.query('sum(ocr_rate_limited_total{tenant="acme"})')) >= 6
    assert series_value(prom.query("sum(ocr_engine_healthy)")) == 1
    assert series_value(prom.query("sum(ocr_ingress_waiting_requests)")) == 0  # nothing in flight now
    stages = {s["metric"]["stage"] for s in prom.query("ocr_stage_duration_seconds_count")}
    assert {"decode", "queue", "engine", "parse"} <= stages, stages
    # the Ray names never reach the product's queries; vLLM-style names keep their colon
    assert not prom.query('{__name__=~"ray_ocr_.+"}')


def test_alert_rules_load_and_stay_quiet(stack: Stack):
    rules = stack.prom.rules()
    names = {rule["name"] for rule in rules}
    assert names == ALERT_NAMES
    assert all(rule["health"] == "ok" for rule in rules), rules
    by_name = {rule["name"]: rule for rule in rules}
    assert by_name["OCRNoReadyEngineReplica"]["state"] == "inactive"  # the engine replica is healthy
    assert by_name["OCRRising429s"]["state"] != "firing"  # `for: 10m` cannot have elapsed
    # Redis went down but lost nothing it came back to: this app's replicas counted no loss (the alert itself sums
    # the whole Ray session, where other test modules' apps restart their own Redis)
    replicas = "|".join(live_ingress_replica_ids())
    assert not stack.prom.query(f'ocr_redis_resets_total{{data="lost", replica=~".*({replicas})"}} > 0')
    # every alert expression evaluates against the real series without error
    for rule in rules:
        stack.prom.query(rule["query"])
