"""Where a HunyuanOCR page's GPU time goes inside vLLM: the vision tower (ViT) timed on its own, per image and per
batch of images, with the top CUDA kernels of one A4 page, on the real vLLM model class (dummy weights).

    python -m loadtest bench encoder --out results/encoder          # on the GPU machine (vLLM + CUDA)

vLLM 0.26's HunyuanOCR tower runs every layer once per image (a Python loop over the images of a step), so the
numbers are given for batches of 1, 4 and 8 images: if ms/image falls with the batch, the step's images gain from
one varlen pass. `batched` is that pass, our plugin's replacement forward (`vllm_plugin.batched_vision_forward`: all
images' patches through each layer at once, attention kept per image with cu_seqlens); `vllm` is vLLM's own
forward (the plugin keeps it as `per_image_forward`). Achieved TFLOP/s uses the same FLOP count
as the roofline (`bench_gpu.page_flops`). Writes OUT/encoder.json.

`--attn-backends` also times the tower's attention with each backend vLLM can run it with
(`mm_encoder_attn_backend`): FlashAttention 3 (vLLM's pick on an H200), vLLM's Triton kernel, and PyTorch's SDPA,
alone and limited to each of its kernels (`TORCH_SDPA:CUDNN_ATTENTION`, …). Head size 72 is not one FlashAttention 3
is built for, so its kernels run at 96; another kernel might waste less (on the H200 none was faster:
docs/BENCHMARKS.md, thirty-first session). Each backend is timed on one attention call
(the sizes of one ID card, four ID cards in one call, one A4 page) and on the whole batched tower, and checked
against FlashAttention's output. The switch is in place on the loaded model (the attribute vLLM reads per call), so
all backends run on the same weights in one process.

`--compile` times the batched tower with each block's dense part under torch.compile (`compiled_tower_forward`):
vLLM 0.26's `compile_mm_encoder` and encoder CUDA graphs do not cover HunyuanOCR's tower, so this measures what
compiling it would gain before anyone builds it into the engine. Each mode is checked against eager's output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

GRIDS = {"id_card": (1, 40, 62), "a4": (1, 110, 78)}  # 1000×630 and 1240×1754 after smart_resize (patches of 16)
# (document, images in one call): what one step's vision work holds for one card, a prefill step at 16 clients
# (4.4 cards on average, nineteenth session) and one A4 page
ATTENTION_CASES = (("id_card", 1), ("id_card", 4), ("a4", 1))
# vLLM's encoder attention backends on CUDA; TORCH_SDPA:KERNEL limits PyTorch's SDPA to one of its kernels
ATTENTION_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "TORCH_SDPA", "TORCH_SDPA:CUDNN_ATTENTION",
                      "TORCH_SDPA:FLASH_ATTENTION", "TORCH_SDPA:EFFICIENT_ATTENTION")


def encoder_attention_modules(model) -> list:
    """Every MMEncoderAttention of a model (the vision tower's, one per layer)."""
    from vllm.model_executor.layers.attention import MMEncoderAttention

    return [m for m in model.modules() if isinstance(m, MMEncoderAttention)]


@contextlib.contextmanager
def attention_backend(modules: list, name: str):
    """Run `modules` (MMEncoderAttention) with backend `name` (ATTENTION_BACKENDS) inside the block, then restore
    them. vLLM picks the backend once, in the module's __init__, and reads these attributes on every call."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend_name, _, sdpa_kernel = name.partition(":")
    backend = AttentionBackendEnum[backend_name]
    saved = [(m.attn_backend, m.is_flash_attn_backend, m._fa_version) for m in modules]
    flash = backend == AttentionBackendEnum.FLASH_ATTN
    fa_version = None
    if flash:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        fa_version = get_flash_attn_version(head_size=modules[0].head_size)
    for m in modules:
        m.attn_backend, m.is_flash_attn_backend, m._fa_version = backend, flash, fa_version
    try:
        if sdpa_kernel:
            from torch.nn.attention import SDPBackend, sdpa_kernel as only

            with only([getattr(SDPBackend, sdpa_kernel)]):
                yield
        else:
            yield
    finally:
        for m, (b, f, v) in zip(modules, saved):
            m.attn_backend, m.is_flash_attn_backend, m._fa_version = b, f, v


def timed_ms(fn, repeats: int, device) -> float:
    """Mean ms per call of `fn` after two unmeasured calls; CUDA events on a GPU, the wall clock elsewhere."""
    import torch

    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) * 1000 / repeats


def measure_attention(module, cases: list[tuple[str, list[int]]], backends: list[str], repeats: int, device,
                      dtype) -> list[dict[str, Any]]:
    """One attention call of `module` (an MMEncoderAttention) per case (name, image lengths in patches) and
    backend, as the batched tower calls it: q, k and v are views into one qkv projection, images kept apart by
    cu_seqlens. The first backend is the reference of `max_abs_diff`; a backend that fails is recorded, not fatal.
    `tflops` counts the attention's useful FLOPs (QKᵀ and PV: 4·n²·hidden per image, no padding)."""
    import torch

    hidden = module.num_heads * module.head_size
    rows: list[dict[str, Any]] = []
    for case, lengths in cases:
        generator = torch.Generator(device="cpu").manual_seed(0)
        qkv = torch.randn(1, sum(lengths), 3 * hidden, generator=generator).to(device=device, dtype=dtype)
        q, k, v = qkv.chunk(3, dim=-1)
        cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        max_seqlen = torch.tensor(max(lengths), dtype=torch.int32)
        flop = sum(4 * n * n * hidden for n in lengths)
        reference = None
        for name in backends:
            row: dict[str, Any] = {"case": case, "images": len(lengths), "backend": name}
            try:
                with torch.inference_mode(), attention_backend([module], name):
                    call = lambda: module(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)  # noqa: E731
                    out = call().float()
                    ms = timed_ms(call, repeats, device)
            except Exception as exc:  # a backend this machine cannot run: recorded, the others still measured
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            else:
                row.update(ms=round(ms, 3), tflops=float(f"{flop / (ms / 1000) / 1e12:.4g}"))
                if reference is None:
                    reference = out
                else:
                    row["max_abs_diff"] = float((out - reference).abs().max())
            rows.append(row)
            print(row, flush=True)
    return rows


def measure_tower_backends(visual, backends: list[str], repeats: int) -> list[dict[str, Any]]:
    """The whole batched tower (our plugin's forward) with each attention backend, per ATTENTION_CASES; the first
    backend is the reference of `max_abs_diff` (of the merged embeddings)."""
    import torch

    from service.engine.vllm_plugin import batched_vision_forward

    modules = encoder_attention_modules(visual)
    rows: list[dict[str, Any]] = []
    for kind, n in ATTENTION_CASES:
        grids = [list(GRIDS[kind])] * n
        x = torch.randn(n * GRIDS[kind][1] * GRIDS[kind][2], 768, device=visual.device, dtype=torch.float32)
        reference = None
        for name in backends:
            row: dict[str, Any] = {"case": kind, "images": n, "backend": name}
            try:
                with torch.inference_mode(), attention_backend(modules, name):
                    call = lambda: batched_vision_forward(visual, x, grids)  # noqa: E731
                    out = [o.float() for o in call()]
                    ms = timed_ms(call, repeats, visual.device)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            else:
                row.update(ms=round(ms, 2), ms_per_image=round(ms / n, 2))
                if reference is None:
                    reference = out
                else:
                    row["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(out, reference))
            rows.append(row)
            print(row, flush=True)
    return rows


# torch.compile modes `--compile` may time (`default` is inductor's; the other autotunes its GEMM templates)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def gelu_approximation(act_fn) -> str:
    """F.gelu's `approximate` for a tower's activation module: vLLM's GELU (exact) or GELUTanh, or torch's GELU."""
    import torch

    if isinstance(act_fn, torch.nn.GELU):
        return act_fn.approximate
    name = type(act_fn).__name__
    if name in ("GELU", "GELUTanh"):
        return "none" if name == "GELU" else "tanh"
    raise ValueError(f"the tower's activation {name} is not a GELU; the compiled blocks only know GELU")


def compiled_tower_forward(visual, mode: str = "default", backend: str = "inductor"):
    """The batched tower (our plugin's forward) with each block's dense part under torch.compile: what vLLM 0.26's
    `compile_mm_encoder` would do, which its HunyuanOCR tower does not support (no `support_torch_compile` on it,
    nor encoder CUDA graphs). Per block, two compiled functions fuse what lies between the GEMMs (LayerNorm,
    residual adds, GELU): norm → qkv, and o_proj + residual → norm → MLP + residual; the attention call between them
    stays vLLM's (FlashAttention 3 on the H200). Both functions take the weights as arguments, so one compiled graph
    serves all 27 layers; the patch count is marked dynamic, so every page size reuses it."""
    import torch
    import torch.nn.functional as F

    from service.engine.vllm_plugin import batched_tower_input, merged_per_image

    layers = list(visual.layers)
    approximate = gelu_approximation(layers[0].mlp.act_fn)
    eps = {float(n.eps) for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len(eps) != 1:
        raise ValueError(f"the tower's layer norms differ in eps ({sorted(eps)}); one compiled graph needs one")
    eps_value = eps.pop()

    def norm_then_qkv(hidden, norm_w, norm_b, qkv_w, qkv_b):
        return F.linear(F.layer_norm(hidden, (hidden.shape[-1],), norm_w, norm_b, eps_value), qkv_w, qkv_b)

    def rest_of_block(hidden, attn_out, o_w, o_b, norm_w, norm_b, up_w, up_b, down_w, down_b):
        hidden = hidden + F.linear(attn_out, o_w, o_b)
        up = F.linear(F.layer_norm(hidden, (hidden.shape[-1],), norm_w, norm_b, eps_value), up_w, up_b)
        return hidden + F.linear(F.gelu(up, approximate=approximate), down_w, down_b)

    options = {} if mode == "default" else {"mode": mode}
    first = torch.compile(norm_then_qkv, backend=backend, **options)
    rest = torch.compile(rest_of_block, backend=backend, **options)

    def forward(x, grid_thw):
        hidden, lengths, cu_seqlens, max_seqlen = batched_tower_input(visual, x, grid_thw)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            torch._dynamo.mark_dynamic(hidden, 1)
            qkv = first(hidden, norm1.weight, norm1.bias, attn.qkv.weight, attn.qkv.bias)
            q, k, v = qkv.chunk(3, dim=-1)
            out = attn.attn(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            torch._dynamo.mark_dynamic(out, 1)
            hidden = rest(hidden, out, attn.o_proj.weight, attn.o_proj.bias, norm2.weight, norm2.bias,
                          mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias, mlp.dense_4h_to_h.weight,
                          mlp.dense_4h_to_h.bias)
        return merged_per_image(visual, hidden, lengths, grid_thw)

    return forward


def measure_tower_compiled(visual, modes: list[str], repeats: int, backend: str = "inductor",
                           grids: dict[str, tuple[int, int, int]] | None = None,
                           cases: tuple[tuple[str, int], ...] = ATTENTION_CASES,
                           patch_dim: int = 768) -> list[dict[str, Any]]:
    """The batched tower eager, then with each torch.compile mode (compiled_tower_forward), per case (document,
    images in one call). Each mode starts from a reset dynamo cache and records its first call (the compile) as
    `first_call_s`; `max_abs_diff` compares the merged embeddings with eager's. A mode that fails is recorded.
    `patch_dim`: a patch's pixel values (3·16·16 for HunyuanOCR)."""
    import torch

    from service.engine.vllm_plugin import batched_vision_forward

    grids = grids or GRIDS
    inputs = {(kind, n): ([list(grids[kind])] * n,
                          torch.randn(n * grids[kind][1] * grids[kind][2], patch_dim, device=visual.device,
                                      dtype=torch.float32,
                                      generator=torch.Generator(device=visual.device).manual_seed(n)))
              for kind, n in cases}
    rows: list[dict[str, Any]] = []
    eager: dict[tuple[str, int], tuple[float, list]] = {}
    with torch.inference_mode():
        # a fresh process's first calls set up cuBLAS and the attention kernels: every case once before any is timed
        for g, x in inputs.values():
            batched_vision_forward(visual, x, g)
        for (kind, n), (g, x) in inputs.items():
            ms = timed_ms(lambda: batched_vision_forward(visual, x, g), repeats, visual.device)
            eager[(kind, n)] = (ms, [o.float() for o in batched_vision_forward(visual, x, g)])
            rows.append({"case": kind, "images": n, "variant": "eager", "ms": round(ms, 2),
                         "ms_per_image": round(ms / n, 2)})
            print(rows[-1], flush=True)
        for mode in modes:
            torch._dynamo.reset()
            try:
                forward = compiled_tower_forward(visual, mode, backend)
            except Exception as exc:
                rows.append({"variant": f"compile:{mode}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(rows[-1], flush=True)
                continue
            for (kind, n), (g, x) in inputs.items():
                row: dict[str, Any] = {"case": kind, "images": n, "variant": f"compile:{mode}"}
                try:
                    started = time.perf_counter()
                    out = [o.float() for o in forward(x, g)]
                    if visual.device.type == "cuda":
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - started, 2)
                    ms = timed_ms(lambda: forward(x, g), repeats, visual.device)
                except Exception as exc:  # a mode this machine cannot compile: recorded, the others still run
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                else:
                    eager_ms, reference = eager[(kind, n)]
                    row.update(ms=round(ms, 2), ms_per_image=round(ms / n, 2),
                               vs_eager=round(ms / eager_ms, 3),
                               max_abs_diff=max(float((a - b).abs().max()) for a, b in zip(out, reference)))
                rows.append(row)
                print(row, flush=True)
    return rows


def compile_report(rows: list[dict[str, Any]]) -> str:
    """A markdown table of measure_tower_compiled's rows: ms per call (× eager; first call s; max |Δ|)."""
    cases = list(dict.fromkeys((r["case"], r["images"]) for r in rows if "case" in r))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["**The batched tower, eager and with its blocks under torch.compile**, ms per call (× eager; the "
             "first call's s, compile included; max |Δ| against eager)", "",
             "| variant | " + " | ".join(f"{c} ×{n}" for c, n in cases) + " |", "|---|" + "---:|" * len(cases)]
    for variant in variants:
        cells = []
        for c, n in cases:
            row = next((r for r in rows if r["variant"] == variant and r.get("case") == c and r.get("images") == n),
                       None)
            if row is None or "error" in row:
                cells.append("error")
            elif variant == "eager":
                cells.append(f"{row['ms']:g}")
            else:
                cells.append(f"{row['ms']:g} ({row['vs_eager']:.3f}×; {row['first_call_s']:g} s; "
                             f"Δ {row['max_abs_diff']:.2g})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    errors = [f"- {r['variant']}{' (' + r['case'] + ' ×' + str(r['images']) + ')' if 'case' in r else ''}: "
              f"{r['error']}" for r in rows if "error" in r]
    return "\n".join(lines + (["", *errors] if errors else []) + [""])


def attention_report(result: dict[str, Any]) -> str:
    """Markdown tables of the attention backends: one call, and the whole tower (ms; ratio to the first)."""
    lines: list[str] = []
    for key, title, unit in (("attention_backends", "One attention call (one layer)", "ms"),
                             ("tower_backends", "The whole batched tower", "ms")):
        rows = result.get(key) or []
        if not rows:
            continue
        cases = list(dict.fromkeys((r["case"], r["images"]) for r in rows))
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        lines += [f"**{title}**, {unit} (× the first backend's time; max |Δ| against it)", "",
                  "| backend | " + " | ".join(f"{c} ×{n}" for c, n in cases) + " |",
                  "|---|" + "---:|" * len(cases)]
        for b in backends:
            cells = []
            for c, n in cases:
                row = next(r for r in rows if r["case"] == c and r["images"] == n and r["backend"] == b)
                first = next(r for r in rows if r["case"] == c and r["images"] == n and r["backend"] == backends[0])
                if "error" in row:
                    cells.append("error")
                    continue
                ratio = f" ({row['ms'] / first['ms']:.2f}×)" if first.get("ms") and b != backends[0] else ""
                extra = f", {row['tflops']} TFLOP/s" if "tflops" in row else ""
                diff = f", Δ {row['max_abs_diff']:.2g}" if "max_abs_diff" in row else ""
                cells.append(f"{row['ms']:g}{ratio}{extra}{diff}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        errors = [f"- {r['backend']} ({r['case']} ×{r['images']}): {r['error']}" for r in rows if "error" in r]
        lines += ["", *errors, ""] if errors else [""]
    return "\n".join(lines)


def measure(model, vit_tflop: dict[str, float], repeats: int, attn_backends: list[str],
            loop: bool = True, compile_modes: list[str] | None = None) -> dict[str, Any]:
    import torch

    from service.engine.vllm_plugin import batched_vision_forward

    visual = model.visual
    # vLLM's own forward (a loop over images), also where our plugin already replaced it
    per_image = getattr(type(visual), "per_image_forward", type(visual).forward)
    out: dict[str, Any] = {"dtype": str(visual.dtype), "plugin_active": per_image is not type(visual).forward,
                           "runs": []}
    if attn_backends:
        modules = encoder_attention_modules(visual)
        out["attention_backend_default"] = modules[0].attn_backend.name
        cases = [(kind, [GRIDS[kind][1] * GRIDS[kind][2]] * n) for kind, n in ATTENTION_CASES]
        out["attention_backends"] = measure_attention(modules[0], cases, attn_backends, repeats * 4, visual.device,
                                                      visual.dtype)
        out["tower_backends"] = measure_tower_backends(visual, attn_backends, repeats)
    if compile_modes:
        out["tower_compiled"] = measure_tower_compiled(visual, compile_modes, repeats)
        try:  # what the first mode's kernels are for one A4 page (the fusions it made)
            torch._dynamo.reset()
            forward = compiled_tower_forward(visual, compile_modes[0])
            x = torch.randn(GRIDS["a4"][1] * GRIDS["a4"][2], 768, device=visual.device, dtype=torch.float32)
            with torch.inference_mode():
                forward(x, [list(GRIDS["a4"])])
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                        torch.profiler.ProfilerActivity.CPU]) as prof:
                    forward(x, [list(GRIDS["a4"])])
                    torch.cuda.synchronize()
            out["compiled_a4_top_kernels"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                                                       max_name_column_width=70)
        except Exception as exc:
            out.setdefault("errors", []).append(f"compiled kernel table: {type(exc).__name__}: {exc}")
    if not loop:
        return out

    with torch.inference_mode():
        for kind, grid in GRIDS.items():
            for n in (1, 4, 8):
                grids = [list(grid)] * n
                x = torch.randn(n * grid[1] * grid[2], 768, device="cuda", dtype=torch.float32)
                for variant, fn in (("vllm", lambda: per_image(visual, x, grids)),
                                    ("batched", lambda: batched_vision_forward(visual, x, grids))):
                    try:
                        ms = timed_ms(fn, repeats, visual.device)
                    except Exception as exc:  # the experiment must not cost the measured baseline
                        out.setdefault("errors", []).append(f"{variant} {kind}x{n}: {type(exc).__name__}: {exc}")
                        print(out["errors"][-1], flush=True)
                        continue
                    ms_each = ms / n
                    out["runs"].append({"kind": kind, "images": n, "variant": variant, "ms": round(ms, 2),
                                        "ms_per_image": round(ms_each, 2),
                                        "tflops": round(vit_tflop[kind] / (ms_each / 1000), 1)})
                    print(out["runs"][-1], flush=True)
                try:
                    ref = per_image(visual, x, grids)
                    alt = batched_vision_forward(visual, x, grids)
                    out.setdefault("batched_max_abs_diff", {})[f"{kind}x{n}"] = max(
                        float((a.float() - b.float()).abs().max()) for a, b in zip(ref, alt))
                except Exception as exc:
                    out.setdefault("errors", []).append(f"compare {kind}x{n}: {type(exc).__name__}: {exc}")
        x = torch.randn(GRIDS["a4"][1] * GRIDS["a4"][2], 768, device="cuda", dtype=torch.float32)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            per_image(visual, x, [list(GRIDS["a4"])])
            torch.cuda.synchronize()
        out["a4_top_kernels"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--attn-backends", default="", help="comma-separated encoder attention backends to time, first "
                   f"the reference (e.g. {','.join(ATTENTION_BACKENDS)}; `all` for these); default none")
    p.add_argument("--no-loop", action="store_true", help="skip the per-image loop against the batched pass and "
                   "the kernel table (only the attention backends and compile modes)")
    p.add_argument("--compile", default="", help="comma-separated torch.compile modes to time the tower's blocks "
                   f"with, against eager ({', '.join(COMPILE_MODES)}; `all` for these); default none")
    args = p.parse_args(argv)
    compile_modes = list(COMPILE_MODES) if args.compile == "all" else \
        [m.strip() for m in args.compile.split(",") if m.strip()]
    for m in compile_modes:
        if m not in COMPILE_MODES:
            p.error(f"unknown compile mode {m!r} (known: {', '.join(COMPILE_MODES)})")
    backends = list(ATTENTION_BACKENDS) if args.attn_backends == "all" else \
        [b.strip() for b in args.attn_backends.split(",") if b.strip()]
    for b in backends:
        name, _, kernel = b.partition(":")
        if name not in {x.split(":")[0] for x in ATTENTION_BACKENDS} or (kernel and name != "TORCH_SDPA"):
            p.error(f"unknown attention backend {b!r} (known: {', '.join(ATTENTION_BACKENDS)})")
    if args.no_loop and not backends and not compile_modes:
        p.error("--no-loop leaves nothing to measure without --attn-backends or --compile")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model lives in this process: apply_model

    from service.modelkit import write_kit
    from loadtest.bench_gpu import page_flops
    from vllm import LLM

    kit = Path(tempfile.mkdtemp(prefix="ocr-encoder-kit-"))
    write_kit(kit, tiny=False, weights=False)
    config = json.loads((kit / "config.json").read_text())
    pre = json.loads((kit / "preprocessor_config.json").read_text())
    vit = {kind: page_flops(config, pre, g[2] * 16, g[1] * 16, 0, 1)["vit_tflop"] for kind, g in GRIDS.items()}
    started = time.perf_counter()
    llm = LLM(model=str(kit), load_format="dummy", dtype="bfloat16", max_model_len=8192, enforce_eager=True,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              mm_processor_cache_gb=0, limit_mm_per_prompt={"image": 1})
    load_s = time.perf_counter() - started
    result = llm.apply_model(lambda model: measure(model, vit, args.repeats, backends, loop=not args.no_loop,
                                                   compile_modes=compile_modes))[0]
    result.update(load_s=round(load_s, 1), vit_tflop_per_image=vit)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "encoder.json").write_text(json.dumps(result, indent=2))
    if backends:
        (args.out / "attention.md").write_text(attention_report(result))
        print(attention_report(result), flush=True)
    if compile_modes:
        (args.out / "compile.md").write_text(compile_report(result.get("tower_compiled", [])))
        print(compile_report(result.get("tower_compiled", [])), flush=True)
    for key in ("a4_top_kernels", "compiled_a4_top_kernels"):
        if key in result:
            print(result[key], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
