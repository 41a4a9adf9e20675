"""Tune vLLM's Triton LoRA kernels (shrink and expand) for HunyuanOCR's LoRA layers on this GPU.

    python -m loadtest bench lora-kernels --out tuned/        # GPU: search, write vLLM's config files and a report
    python -m loadtest bench lora-kernels --plan-only         # the shapes, token counts and candidates (no GPU)

vLLM runs each LoRA layer as two Triton kernels: shrink (x·A, the layer's input down to the rank) and expand (·B,
the rank up to the layer's outputs, added onto the base layer's result). Without tuned configs it logs "Using
default LoRA kernel configs" and launches one block shape for every size; on the H200 those cost 0.8 ms per
decode step of this model (docs/BENCHMARKS.md, twenty-fifth session).

This script takes the layers vLLM builds for the model (q/k/v packed as 3 slices, gate/up as 2, o and down), the
slots' rank and the token counts of the engine's steps, and times every candidate config of each kernel inside a
CUDA graph, as the engine runs them, with every token on one adapter. The fastest per (slices, tokens, K, N) goes
into vLLM's own format, `{gpu}_SHRINK.json` and `{gpu}_EXPAND_TRUE.json`, for `VLLM_TUNED_CONFIG_FOLDER`. vLLM
looks configs up by the nearest token count, K and N, so the files serve every step size. `report.json` holds
vLLM's default config against the tuned one, in µs per kernel and per engine step (all layers' kernels summed).

Candidates compile first in parallel worker processes (Triton keeps them in its disk cache), then this process
times them one after another, so no two timings share the GPU. The best few and the default are timed again and
the median kept, so one lucky sample does not pick a config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.engine.lora_kernels import (PACKED_LAYERS, KernelShape, config_key, kernel_shapes,  # noqa: E402
                                         vllm_config)

# the token counts of the engine's steps: its CUDA-graph sizes for decode batches, then prefill chunks up to the
# H200's default max_num_batched_tokens (8192); vLLM picks the nearest for counts in between
TOKEN_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192)
# Triton compiles one variant per integer-argument class (== 1, divisible by 16, other): one token count of each
COMPILE_TOKEN_COUNTS = (1, 8, 16)
RETIME_BEST = 3
RETIME_REPEATS = 5


def check_packed_layers() -> None:
    """The layers tuned must be the ones vLLM builds: its native HunYuan text model packs q/k/v and gate/up."""
    from vllm.model_executor.models.hunyuan_v1 import HunyuanV1ModelBase

    ours = {packed: list(parts) for packed, parts in PACKED_LAYERS if len(parts) > 1}
    if HunyuanV1ModelBase.packed_modules_mapping != ours:
        raise RuntimeError(f"vLLM packs {HunyuanV1ModelBase.packed_modules_mapping}, this script assumes {ours}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def candidates(shape: KernelShape) -> list[dict]:
    """The configs to try. Shrink splits K across blocks (split_k); a split longer than K only launches idle
    blocks, so those are left out. Expand's K is the rank: one block covers it."""
    configs = []
    if shape.op == "shrink":
        block_n = max(16, min(64, next_power_of_2(shape.n)))
        for block_m in (16, 32, 64):
            for block_k in (32, 64, 128, 256):
                for split_k in (1, 2, 4, 8, 16, 32, 64):
                    if block_k * split_k > max(shape.k, block_k):
                        continue
                    for num_warps in (4, 8):
                        for num_stages in (2, 3):
                            configs.append(dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                                                num_warps=num_warps, num_ctas=1, group_size_m=8,
                                                num_stages=num_stages, max_nreg=None))
    else:
        block_k = max(16, next_power_of_2(shape.k))  # one pass over K: pipeline stages change nothing
        for block_m in (16, 32, 64, 128):
            for block_n in (32, 64, 128, 256):
                for num_warps in (4, 8):
                    configs.append(dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                                        num_ctas=1, num_stages=2, max_nreg=None))
    return configs


@dataclass
class Timing:
    shape: KernelShape
    tokens: int
    default_config: dict
    default_us: float
    best_config: dict
    best_us: float
    tried: int
    failed: int


def tune(shapes: list[KernelShape], token_counts: Iterable[int],
         measure: Callable[[KernelShape, int, dict], float | None],
         default: Callable[[KernelShape, int], dict], log: Callable[[str], None] = print) -> list[Timing]:
    """Time every candidate (and vLLM's default) of each shape at each token count with `measure` (µs per call,
    None when the config cannot run), then time the best few and the default again and keep medians."""
    results = []
    for shape in shapes:
        for tokens in token_counts:
            base = default(shape, tokens)
            pool = {config_key(c): c for c in [base, *candidates(shape)]}
            first = {key: measure(shape, tokens, config) for key, config in pool.items()}
            ran = {key: us for key, us in first.items() if us is not None}
            if config_key(base) not in ran:
                raise RuntimeError(f"vLLM's default config does not run for {shape.label} at {tokens} tokens")
            finalists = sorted(ran, key=ran.get)[:RETIME_BEST]
            medians = {}
            for key in dict.fromkeys([config_key(base), *finalists]):
                samples = [measure(shape, tokens, pool[key]) for _ in range(RETIME_REPEATS)]
                medians[key] = statistics.median(s for s in samples if s is not None)
            best = min(medians, key=medians.get)
            row = Timing(shape=shape, tokens=tokens, default_config=base, default_us=medians[config_key(base)],
                         best_config=pool[best], best_us=medians[best], tried=len(pool),
                         failed=len(pool) - len(ran))
            log(f"{shape.label} @ {tokens}: default {row.default_us:.2f} µs, best {row.best_us:.2f} µs "
                f"({row.default_us / row.best_us:.2f}x) of {row.tried} ({row.failed} failed)")
            results.append(row)
    return results


def config_files(results: list[Timing], max_loras: int, gpu_name: str) -> dict[str, dict]:
    """vLLM's tuned-config files: {file name: config_data[max_loras][num_slices][m][k][n]}. vLLM keys max_loras
    by its slot count plus one (the no-adapter id), so the files are written under that."""
    gpu = gpu_name.replace(" ", "_").replace("-", "_")
    names = {"shrink": f"{gpu}_SHRINK.json", "expand": f"{gpu}_EXPAND_TRUE.json"}
    files: dict[str, dict] = {}
    for row in results:
        s = row.shape
        data = files.setdefault(names[s.op], {}).setdefault(str(max_loras + 1), {})
        data.setdefault(str(s.num_slices), {}).setdefault(str(row.tokens), {}).setdefault(str(s.k), {})[
            str(s.n)] = row.best_config
    return files


def step_totals(results: list[Timing]) -> list[dict]:
    """Per token count: the LoRA kernels of one engine step (every layer), default against tuned, in µs."""
    totals: dict[int, dict] = {}
    for row in results:
        t = totals.setdefault(row.tokens, {"tokens": row.tokens, "default_us": 0.0, "tuned_us": 0.0})
        t["default_us"] += row.default_us * row.shape.calls_per_step
        t["tuned_us"] += row.best_us * row.shape.calls_per_step
    return [dict(t, default_us=round(t["default_us"], 1), tuned_us=round(t["tuned_us"], 1),
                 speedup=round(t["default_us"] / t["tuned_us"], 3)) for t in sorted(totals.values(),
                                                                                   key=lambda t: t["tokens"])]


# --- on the GPU ---------------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _weights(shape: KernelShape, max_loras: int, device: str):
    """Stacked A (shrink) or B (expand) weights per slice for every slot, as vLLM's LoRA layers hold them. Kept for
    the whole run: vLLM caches their pointers by address, so a freed tensor's address must never come back."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    rank = shape.n if shape.op == "shrink" else shape.k
    sizes = ([(rank, shape.k)] * shape.num_slices if shape.op == "shrink"
             else [(out, rank) for out in shape.output_slices])
    return [torch.randn(max_loras, 1, *size, dtype=torch.bfloat16, device=device, generator=generator) * 0.01
            for size in sizes]


@lru_cache(maxsize=4)
def _kernel_inputs(shape: KernelShape, tokens: int, max_loras: int, device: str):
    """The arguments vLLM's punica wrapper passes: the layer's input (shrink) or output (expand), the float32 buffer
    between the two, and the kernel metadata with every token on slot 0."""
    import torch
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    rank = shape.n if shape.op == "shrink" else shape.k
    generator = torch.Generator(device=device).manual_seed(tokens)
    meta = LoRAKernelMeta.make(max_loras, tokens, device)
    meta.prepare_tensors(torch.zeros(tokens, dtype=torch.int32, device=device))
    meta_args = meta.meta_args(tokens, False)  # vLLM's default: no specialize_active_lora
    buffer = torch.randn(shape.num_slices, tokens, rank, dtype=torch.float32, device=device, generator=generator)
    if shape.op == "shrink":
        x = torch.randn(tokens, shape.k, dtype=torch.bfloat16, device=device, generator=generator)
        return "shrink", (x, _weights(shape, max_loras, device), buffer, *meta_args, 1.0), {}
    y = torch.zeros(tokens, sum(shape.output_slices), dtype=torch.bfloat16, device=device)
    weights = _weights(shape, max_loras, device)
    return "expand", (buffer, weights, y, *meta_args), {"offset_start": 0, "add_inputs": True}


def _launcher(shape: KernelShape, tokens: int, max_loras: int, config: dict,
              device: str = "cuda") -> Callable[[], None]:
    """Calls vLLM's own op function (its checks, its grid, its kernel) with `config` in place of its lookup."""
    from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op

    op, args, kwargs = _kernel_inputs(shape, tokens, max_loras, device)
    module, function = ((lora_shrink_op, lora_shrink_op._lora_shrink) if op == "shrink"
                        else (lora_expand_op, lora_expand_op._lora_expand))

    def launch() -> None:
        lookup = module.get_lora_op_configs
        module.get_lora_op_configs = lambda *a, **kw: config
        try:
            function(*args, **kwargs)
        finally:
            module.get_lora_op_configs = lookup
    return launch


def gpu_measure(shape: KernelShape, tokens: int, config: dict, *, max_loras: int, calls: int = 20,
                replays: int = 5) -> float | None:
    """µs per call: `calls` launches captured in one CUDA graph (decode steps replay graphs), replayed `replays`
    times between events. None when Triton cannot build or launch the config."""
    import torch

    launch = _launcher(shape, tokens, max_loras, config)
    try:
        launch()  # compiles or loads the kernel, fills vLLM's pointer cache outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                launch()
    except Exception:
        torch.cuda.synchronize()
        return None
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def _compile(task: tuple[KernelShape, int, int, dict]) -> str | None:
    """Worker: run one config once, so Triton compiles it into its disk cache. Returns why it failed, or None."""
    import torch

    shape, tokens, max_loras, config = task
    try:
        _launcher(shape, tokens, max_loras, config)()
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def precompile(shapes: list[KernelShape], max_loras: int, jobs: int, log: Callable[[str], None]) -> dict:
    import multiprocessing

    tasks = [(shape, tokens, max_loras, config) for shape in shapes for config in candidates(shape)
             for tokens in COMPILE_TOKEN_COUNTS]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [error for error in pool.map(_compile, tasks, chunksize=8) if error]
    summary = {"tasks": len(tasks), "failed": len(errors), "jobs": jobs,
               "seconds": round(time.perf_counter() - started, 1), "errors": sorted(set(errors))[:5]}
    log(f"precompiled {json.dumps(summary)}")
    return summary


# --- command ------------------------------------------------------------------------------------------------------

def plan(shapes: list[KernelShape], token_counts: tuple[int, ...]) -> dict:
    tries = sum(len(candidates(s)) for s in shapes)
    return {"shapes": [dict(asdict(s), label=s.label, candidates=len(candidates(s))) for s in shapes],
            "token_counts": list(token_counts), "compile_tasks": tries * len(COMPILE_TOKEN_COUNTS),
            "timings": tries * len(token_counts)}


def report_markdown(report: dict) -> str:
    lines = [f"LoRA kernels on {report['device']} (vllm {report['vllm']}, rank {report['rank']}, "
             f"{report['max_loras']} slots), µs per launch inside a CUDA graph:", "",
             "| kernel | " + " | ".join(str(t) for t in report["token_counts"]) + " |",
             "|---|" + "---|" * len(report["token_counts"])]
    by_label: dict[str, dict[int, dict]] = {}
    for row in report["kernels"]:
        by_label.setdefault(row["label"], {})[row["tokens"]] = row
    for label, rows in by_label.items():
        cells = [f"{rows[t]['default_us']:.1f} → {rows[t]['best_us']:.1f}" if t in rows else "-"
                 for t in report["token_counts"]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Per engine step (all layers' LoRA kernels, µs, default → tuned):", "",
              "| tokens | default | tuned | speedup |", "|---|---|---|---|"]
    lines += [f"| {t['tokens']} | {t['default_us']} | {t['tuned_us']} | {t['speedup']}x |" for t in report["steps"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for vLLM's config files, report.json and report.md")
    parser.add_argument("--model", help="a model directory (config.json); default: the HunyuanOCR-1.5 shape kit")
    parser.add_argument("--rank", type=int, default=16, help="the slots' max_lora_rank (default 16, the service's)")
    parser.add_argument("--max-loras", type=int, default=4, help="LoRA slots (default 4, the service's)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)),
                        help="token counts per step to tune for (comma-separated)")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling candidates in parallel (default: CPUs − 2, at most 14)")
    parser.add_argument("--plan-only", action="store_true", help="print what would be tuned and exit (no GPU)")
    args = parser.parse_args(argv)

    from service.modelkit import write_kit

    model_dir = Path(args.model) if args.model else Path(tempfile.mkdtemp(prefix="hunyuan-kit-"))
    if not args.model:
        write_kit(model_dir, tiny=False, weights=False)
    token_counts = tuple(int(t) for t in args.tokens.split(","))
    shapes = kernel_shapes(model_dir, args.rank)
    if args.plan_only:
        print(json.dumps(plan(shapes, token_counts), indent=2))
        return 0
    if not args.out:
        parser.error("--out is required (except with --plan-only)")

    import torch
    import vllm

    if not torch.cuda.is_available():
        parser.error("this tunes Triton kernels: it needs a CUDA GPU (--plan-only runs anywhere)")
    check_packed_layers()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat()
    compiled = precompile(shapes, args.max_loras, args.jobs, lambda line: print(line, flush=True))
    tuning_started = time.perf_counter()
    results = tune(shapes, token_counts,
                   measure=lambda s, t, c: gpu_measure(s, t, c, max_loras=args.max_loras),
                   default=lambda s, t: vllm_config(s, args.max_loras, t, tuned=False),
                   log=lambda line: print(line, flush=True))
    device = torch.cuda.get_device_name()
    for name, data in config_files(results, args.max_loras, device).items():
        (out / name).write_text(json.dumps(data, indent=1) + "\n")
    report = {"started_at": started, "device": device, "vllm": vllm.__version__, "torch": torch.__version__,
              "rank": args.rank, "max_loras": args.max_loras, "token_counts": list(token_counts),
              "precompile": compiled, "timing_s": round(time.perf_counter() - tuning_started, 1),
              "command": "python -m loadtest bench lora-kernels " + " ".join(sys.argv[1:] if argv is None else argv),
              "kernels": [dict(label=r.shape.label, op=r.shape.op, num_slices=r.shape.num_slices, k=r.shape.k,
                               n=r.shape.n, calls_per_step=r.shape.calls_per_step, tokens=r.tokens,
                               default_us=round(r.default_us, 2), best_us=round(r.best_us, 2),
                               default_config=r.default_config, best_config=r.best_config, tried=r.tried,
                               failed=r.failed) for r in results],
              "steps": step_totals(results)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(report))
    print(report_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
