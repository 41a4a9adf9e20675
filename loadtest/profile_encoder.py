"""Where a HunyuanOCR page's GPU time goes inside vLLM: the vision tower (ViT) timed on its own, per image and per
batch of images, with the top CUDA kernels of one A4 page, on the real vLLM model class (dummy weights).

    python -m loadtest bench encoder --out results/encoder          # on the GPU machine (vLLM + CUDA)

vLLM 0.26's HunyuanOCR tower runs every layer once per image (a Python loop over the images of a step), so the
numbers are given for batches of 1, 4 and 8 images: if ms/image falls with the batch, the step's images gain from
one varlen pass. `batched` is that pass, our plugin's replacement forward (`vllm_plugin.batched_vision_forward`: all
images' patches through each layer at once, attention kept per image with cu_seqlens); `vllm` is vLLM's own
forward (the plugin keeps it as `per_image_forward`). Achieved TFLOP/s uses the same FLOP count
as the roofline (`bench_gpu.page_flops`). Writes OUT/encoder.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

GRIDS = {"id_card": (1, 40, 62), "a4": (1, 110, 78)}  # 1000×630 and 1240×1754 after smart_resize (patches of 16)


def measure(model, vit_tflop: dict[str, float], repeats: int) -> dict[str, Any]:
    import torch

    from service.engine.vllm_plugin import batched_vision_forward

    visual = model.visual
    # vLLM's own forward (a loop over images), also where our plugin already replaced it
    per_image = getattr(type(visual), "per_image_forward", type(visual).forward)
    out: dict[str, Any] = {"dtype": str(visual.dtype), "plugin_active": per_image is not type(visual).forward,
                           "runs": []}

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats

    with torch.inference_mode():
        for kind, grid in GRIDS.items():
            for n in (1, 4, 8):
                grids = [list(grid)] * n
                x = torch.randn(n * grid[1] * grid[2], 768, device="cuda", dtype=torch.float32)
                for variant, fn in (("vllm", lambda: per_image(visual, x, grids)),
                                    ("batched", lambda: batched_vision_forward(visual, x, grids))):
                    try:
                        ms = timed(fn)
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
    args = p.parse_args(argv)
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
    result = llm.apply_model(lambda model: measure(model, vit, args.repeats))[0]
    result.update(load_s=round(load_s, 1), vit_tflop_per_image=vit)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "encoder.json").write_text(json.dumps(result, indent=2))
    print(result["a4_top_kernels"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
