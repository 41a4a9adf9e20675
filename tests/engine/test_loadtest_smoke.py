"""The GPU comparison (`bench gpu --tiny`) run for real on vLLM-CPU: raw `vllm serve` and the service, each with the
tiny model kit. No timing assertions: only that answers arrived, succeeded and were summarised consistently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import VLLM_CPU_DEFAULT_KWARGS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.own_engines
def test_gpu_comparison_dry_run_on_vllm_cpu(tmp_path):
    """`bench gpu --tiny`: raw `vllm serve` and the service started at once on vLLM-CPU with the tiny kit, warmed,
    paired at one client, then a round of closed-loop blocks; every answer a 200 with the fixed output length, the
    raw server configured from the service's own engine arguments, results, report and logs written."""
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, "-m", "loadtest", "bench", "gpu", "--tiny", "--workloads", "id_card",
                           "--pair-s", "4", "--rounds", "1", "--block-s", "2", "--warmup-s", "1", "--docs", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["servers"]) == {"raw", "service"} and results["errors"] == {} and results["dropped"] == []
    assert results["servers"]["service"]["http_listener"] == "haproxy"  # the vLLM engine's default front end
    # the service's own engine arguments passed on: on vLLM's CPU build its CPU defaults
    assert results["raw_engine_args"]["max_num_seqs"] == str(VLLM_CPU_DEFAULT_KWARGS["max_num_seqs"])
    one = results["workloads"]["id_card"]["one_client"]
    assert one["complete_rounds"] >= 1 and {a["errors"] for a in one["arms"].values()} == {0}
    assert {a["output_tokens_mean"] for a in one["arms"].values()} == {16.0}  # fixed output length on both
    blocks = results["workloads"]["id_card"]["blocks"]["2"]
    assert {arm: [b["ok"] > 0 and b["errors"] == 0 for b in bs] for arm, bs in blocks.items()} == {
        "raw": [True], "service": [True]}
    assert blocks["raw"][0]["vllm_mean_ms"]["decode"] > 0 and blocks["service"][0]["engine_ms_p50"] > 0
    ratio = results["analysis"]["id_card"]["levels"]["2"]["service"]["vs_raw"]
    assert ratio["n"] == 1 and ratio["median"] > 0
    report = (out / "report.md").read_text()
    assert "## id_card: one client" in report and "| 2 | service |" in report and "Goals, id_card, service" in report
    assert {p.name for p in (out / "logs").iterdir()} == {"raw.log", "service.log"}
