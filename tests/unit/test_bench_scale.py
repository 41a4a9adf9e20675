"""The scaling benchmark's plan and analysis (loadtest/bench_scale.py), and the mock engine's service-time model
(service/engine/mock.py StepModel, BatchScheduler) against the H200 measurements it was fitted to."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import time
from pathlib import Path

import pytest

from loadtest import bench_scale
from loadtest.__main__ import main as loadtest_main
from service.engine.mock import BatchScheduler, MockEngine, Sequence, StepModel, simulate_closed_loop
from service.engine.protocol import EngineRequest

REPO = Path(__file__).resolve().parents[2]


def plan_of(*argv: str, gpus: int = 4) -> dict:
    return bench_scale.plan(bench_scale.parse_args(list(argv)), gpus)


def test_plan_only_prints_the_cluster_each_deployment_and_every_block_and_starts_nothing(capsys, tmp_path):
    assert loadtest_main(["bench", "scale", "--plan-only", "--gpus", "4", "--replicas", "1,4", "--workloads",
                          "id_card", "--id-levels", "12,16", "--out", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "a").exists()
    lines = text.splitlines()
    assert lines[0].startswith("plan (540s budget, 4 GPUs, replicas [1, 4]): estimated") and "fits" in lines[0]
    assert "start --head --block --node-ip-address NODE_IP --port PORT" in lines[1]
    assert "--num-gpus 4" in lines[1] and "&&" not in lines[1]  # one node: this machine and its GPUs
    deploys = [json.loads(re.search(r"(\{.*\}) \(\d+s\)$", line).group(1)) for line in lines if "deploy (" in line]
    assert [d["engine_deployment"]["num_replicas"] for d in deploys] == [1, 4]
    for d in deploys:
        assert d["engine"] == "vllm" and d["engine_deployment"]["ray_actor_options"]["num_gpus"] == 1
        assert d["engine_kwargs"]["kv_cache_memory_bytes"] == 24 * 2 ** 30 and d["engine_kwargs"]["load_format"] == \
            "dummy"
        assert d["bench_fixed_output_tokens"] is True and d["rate_limit_enabled"] is False
        assert d["ingress_deployment"]["num_replicas"] == 2 * d["engine_deployment"]["num_replicas"]
        assert d["ingress_deployment"]["ray_actor_options"]["resources"] == {"ingress_host": 0.001}
    blocks = [line.strip() for line in lines if "closed loop" in line]
    assert [b.split(",")[1].strip() for b in blocks] == ["12 clients (12 per replica)", "16 clients (16 per replica)",
                                                        "48 clients (12 per replica)", "64 clients (16 per replica)"]
    # everything at once does not fit one device call: it says so and starts nothing
    assert loadtest_main(["bench", "scale", "--gpus", "4", "--out", str(tmp_path / "b")]) == 2
    assert "does not fit" in capsys.readouterr().out and not (tmp_path / "b").exists()


def test_the_documented_gpu_commands_fit_one_device_call():
    """docs/BENCHMARKS.md's `bench scale` commands for a multi-GPU machine (S1…) each fit the 540 s budget."""
    doc = (REPO / "docs" / "BENCHMARKS.md").read_text()
    commands = re.findall(r"^\s+S\d+\s+python -m loadtest bench scale (.+)$", doc, re.M)
    assert len(commands) >= 3, "the GPU commands are listed as S1, S2, …"
    for command in commands:
        argv = shlex.split(command.split("#")[0])
        gpus = int(argv[argv.index("--gpus") + 1])
        p = plan_of(*argv, gpus=gpus)
        assert p["fits"] and "--cpu" not in argv, (command, p["total_s"], p["problems"])


def test_cpu_plan_is_a_multi_node_cluster_with_declared_gpus_and_every_part():
    p = plan_of("--cpu", gpus=4)
    head, *workers = p["steps"][0].split(" && ")
    assert "--num-gpus 0" in head and len(workers) == 3
    assert all("--num-gpus 2" in w and "--num-cpus 1" in w and "--address NODE_IP:PORT" in w for w in workers)
    assert p["replica_counts"] == [1, 2] and p["fits"] and p["total_s"] <= 150
    parts = [d["part"] for d in p["deployments"]]
    assert parts == ["sweep", "sweep", "autoscale"]
    for d in p["deployments"]:
        assert d["settings"]["engine"] == "mock" and d["settings"]["mock_time_scale"] == 8.0
        assert d["settings"]["engine_deployment"]["ray_actor_options"]["num_gpus"] == 1
        assert d["settings"]["engine_deployment"]["max_replicas_per_node"] == 1  # spread, one node free for a kill
    scaling = p["deployments"][-1]["settings"]["engine_deployment"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)  # a killed node's GPUs are gone
    assert p["deployments"][-1]["settings"]["latency_target_ms"] == 500 * 8
    assert any(s.startswith("nodekill: 2 replica(s)") for s in p["steps"])
    with pytest.raises(ValueError, match="nodekill needs --cpu"):
        plan_of("--parts", "nodekill")
    with pytest.raises(ValueError, match="within 1..4"):
        plan_of("--replicas", "1,8")


def block(clients: int, docs: float, p95: float, errors: int = 0, bound: float = 500.0) -> dict:
    return {"clients": clients, "docs_per_s_little": docs, "latency_ms_p95": p95, "errors": errors,
            "bound_ms": bound, "ingress_cpu_ms_per_request": 4.0}


def test_scaling_takes_the_best_block_within_the_bound_and_divides_by_n_times_one():
    sweep = {"1": {"blocks": {"id_card": [block(8, 25.0, 400), block(16, 36.0, 480), block(24, 41.0, 620)]}},
             "2": {"blocks": {"id_card": [block(16, 50.0, 410), block(32, 70.0, 490, errors=1),
                                          block(48, 80.0, 700)]}}}
    out = bench_scale.scaling(sweep)["id_card"]
    assert out["1"]["best_within_bound"] == {"clients": 16, "docs_per_s": 36.0, "p95_ms": 480}
    # 32 clients had an error and 48 were over the bound: 16 clients' 50 docs/s ÷ (2 × 36)
    assert out["2"]["best_within_bound"]["clients"] == 16 and out["2"]["efficiency"] == pytest.approx(0.694, abs=1e-3)
    assert out["1"]["efficiency"] == 1.0 and out["2"]["ingress_cpu_ms_per_request"] == 4.0


# --- the mock engine's service-time model ----------------------------------------------------------------------------

# raw vLLM on one H200, closed loop (docs/bench/h200-2026-12-02s-trace2-results.json, unprofiled means): clients →
# mean end-to-end ms; (prompt tokens, output tokens, image tokens) of each document
H200_E2E_MS = {"a4": {1: 1247.2, 16: 2284.9}, "id_card": {1: 235.8, 16: 439.3}}
SHAPES = {"a4": (2229, 512, 2202), "id_card": (744, 64, 642)}


@pytest.mark.parametrize("workload", ["a4", "id_card"])
def test_the_step_model_reproduces_the_h200_latencies_it_was_fitted_to(workload):
    for clients, measured in H200_E2E_MS[workload].items():
        predicted, _ = simulate_closed_loop(StepModel(), clients, *SHAPES[workload], requests=clients * 12)
        assert predicted == pytest.approx(measured, rel=0.2), (workload, clients)


def test_a_batch_shares_steps_so_throughput_grows_with_clients_and_saturates():
    model = StepModel()
    docs = [simulate_closed_loop(model, clients, *SHAPES["id_card"], requests=clients * 10)[1]
            for clients in (1, 8, 32, 128)]
    assert docs[0] < docs[1] < docs[2] < docs[3] and docs[1] > 4 * docs[0]
    assert docs[3] < 1.5 * docs[2]  # prefill and KV reads bound it: no engine serves unboundedly


def test_the_scheduler_decodes_one_token_per_step_after_a_chunked_prefill():
    scheduler = BatchScheduler(StepModel(max_batched_tokens=1000))
    seq = Sequence(prompt_tokens=2500, output_tokens=3)
    scheduler.add(seq)
    steps = []
    while scheduler.running or scheduler.waiting:
        steps.append(scheduler.step())
    # three prefill chunks (the last brings the first token), then two decode steps
    assert len(steps) == 5 and steps[-1][1] == [seq] and seq.generated == 3
    assert steps[0][0] == pytest.approx(StepModel().step_ms + 1000 * StepModel().prefill_ms_per_token)


def test_the_mock_engine_takes_the_models_time_scaled():
    engine = MockEngine(step_model=StepModel(), time_scale=0.5)
    request = EngineRequest(request_id="r", task="text", image_png=None, image_rgb=b"\0" * (1000 * 630 * 3),
                            width=1000, height=630, max_tokens=64, ignore_eos=True, min_tokens=64)
    started = time.perf_counter()
    result = asyncio.run(engine.generate(request))
    elapsed_ms = (time.perf_counter() - started) * 1000
    alone, _ = simulate_closed_loop(StepModel(), 1, result.prompt_tokens, 64, result.image_tokens, requests=4)
    assert result.output_tokens == 64 and result.image_tokens == 642
    assert 0.5 * alone * 0.9 <= elapsed_ms <= 0.5 * alone * 3  # a loaded machine wakes late, never early


def test_a_killed_nodes_replicas_are_back_only_when_ray_and_serve_both_see_them():
    """Serve's controller reports the killed replica RUNNING until it notices, while Ray already lists it gone: that
    moment (seen in a run: RUNNING 2, one replica alive) is not the replicas coming back."""
    back = bench_scale.replicas_back
    assert not back({"RUNNING": 2}, {"worker_node_0": 1}, 2, "worker_node_1")
    assert not back({"RUNNING": 2}, {"worker_node_0": 1, "worker_node_1": 1}, 2, "worker_node_1")
    assert not back({"RUNNING": 1, "STARTING": 1}, {"worker_node_0": 1, "worker_node_2": 1}, 2, "worker_node_1")
    assert back({"RUNNING": 2}, {"worker_node_0": 1, "worker_node_2": 1}, 2, "worker_node_1")
