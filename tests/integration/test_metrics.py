"""The alert rules through the real promtool (Debian package `prometheus`): they load, and promtool's rule tests
(deploy/grafana/alerts_test.yaml) fire every alert and keep each quiet where it should be."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.unit.test_metrics import GRAFANA

ALERT_NAMES = {"OCRHighP95Latency", "OCRHighErrorRate", "OCRRising429s", "OCRRateLimiterBackendErrors",
               "OCRRateLimiterOnFallback", "OCRNoReadyEngineReplica", "OCRQueueOverTargetAtMaxReplicas",
               "OCRKVCacheSaturated", "OCRReplicaFlapping", "OCRJobFailures", "OCRWebhookFailures",
               "OCRRedisStateLost", "OCRMetricsSeriesOverflow"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (apt-get install --no-install-recommends prometheus)")
    return path


def test_promtool_check_rules():
    out = subprocess.run([promtool(), "check", "rules", str(GRAFANA / "alerts.yaml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 13 rules found" in out.stdout


def test_promtool_test_rules_fires_every_alert():
    out = subprocess.run([promtool(), "test", "rules", "alerts_test.yaml"], cwd=GRAFANA, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {rule["alert"] for group in yaml.safe_load((GRAFANA / "alerts.yaml").read_text())["groups"]
              for rule in group["rules"]}
    assert alerts == ALERT_NAMES
    cases = [case for test in yaml.safe_load((GRAFANA / "alerts_test.yaml").read_text())["tests"]
             for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert fired == alerts and quiet == alerts, (fired, quiet)
