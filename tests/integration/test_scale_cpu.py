"""Horizontal scale on CPU: `python -m loadtest bench scale --cpu` (loadtest/bench_scale.py) on a Ray cluster of
four `ray start` nodes on this machine, three worker nodes declaring two GPUs each, the service deployed by its own
code with engine replicas asking for one GPU each, at most one per node (the chart's engine.maxReplicasPerNode), and the mock engine timed like one vLLM engine on an H200
(docs/design/scaling-model.md). The benchmark measures; this test holds it to what the service promises: one engine
per GPU spread across nodes, two replicas serve about twice one's ID cards within the (stretched) bound, the
autoscaler goes up under a step load and back down, and a worker node killed under load loses no request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.common import REPO_ROOT

# two replicas against one, side by side in one run: the goal is 0.95 (docs/BENCHMARKS.md); a loaded 2-core machine
# shares its cores between the load generator, the ingress and both engines' event loops
MIN_EFFICIENCY = 0.7


@pytest.fixture(scope="module")
def scale_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale-cpu")
    # Beside the rest of the suite the 2-core machine is busy: the mock engine's time stretched 12× (not the CPU
    # default's 8) and 4 clients per replica (not 8) keep each request's time the mock's own, well within the
    # stretched bound; the step load is held 24 s (not 14) as a new replica's start on a worker node takes longer
    proc = subprocess.run([sys.executable, "-m", "loadtest", "bench", "scale", "--cpu", "--time-scale", "12",
                           "--id-levels", "4", "--step-up-s", "24", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    results = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0 and not results["errors"], proc.stdout[-4000:] + proc.stderr[-4000:]
    return results


@pytest.mark.ray
@pytest.mark.timeout(330)
def test_replicas_one_per_gpu_spread_across_nodes_and_scaling(scale_results):
    one, two = scale_results["sweep"]["1"]["placement"], scale_results["sweep"]["2"]["placement"]
    assert one["gpus_total"] == 6 and one["gpus_free"] == 5
    assert two["gpus_free"] == 4 and sorted(two["engine_replicas_per_node"].values()) == [1, 1]
    scaling = scale_results["scaling"]["id_card"]
    assert scaling["1"]["best_within_bound"] and scaling["2"]["best_within_bound"], scaling
    assert scaling["2"]["efficiency"] >= MIN_EFFICIENCY, scaling
    blocks = [b for n in ("1", "2") for b in scale_results["sweep"][n]["blocks"]["id_card"]]
    assert all(set(b["outcomes"]) == {"200"} for b in blocks), [b["outcomes"] for b in blocks]


@pytest.mark.ray
@pytest.mark.timeout(330)
def test_worker_node_killed_under_load_loses_nothing(scale_results):
    kill = scale_results["nodekill"]
    assert kill["requests_in_flight_at_kill"] > 0
    assert kill["replicas_back_after_s"] is not None, kill["ticks"]
    assert kill["killed"] not in kill["after"]["engine_replicas_per_node"]
    assert kill["after"]["engine_replicas"] == 2
    assert kill["outcomes"] == {"200": kill["requests"]}, kill["outcomes"]


@pytest.mark.ray
@pytest.mark.timeout(330)
def test_autoscaling_follows_a_step_load_up_and_down(scale_results):
    auto = scale_results["autoscale"]
    assert auto["reached_most_after_s"] is not None and auto["max_running"] == auto["most"] == 2, auto["timeline"]
    assert auto["back_to_one_after_s"] is not None, auto["timeline"]
    assert auto["outcomes"] == {"200": auto["requests"]}, auto["outcomes"]
