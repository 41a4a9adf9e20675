"""The vLLM metrics the dashboards query exist in the installed vLLM (its metric definitions, read from its source:
importing vLLM takes torch, tens of seconds)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tests.unit.test_metrics import dashboard_metric_names


def test_dashboards_reference_only_vllm_metrics_vllm_defines():
    loggers = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "v1" / "metrics" / "loggers.py"
    vllm_names = set(re.findall(r'name="(vllm:[a-z0-9_]+)"', loggers.read_text()))
    assert "vllm:num_requests_waiting" in vllm_names
    for dashboard, names in dashboard_metric_names().items():
        for name in names:
            if name.startswith("vllm:"):
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                assert base in vllm_names, f"{dashboard}: {name} is not a vLLM metric"
