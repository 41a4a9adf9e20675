"""Image preprocessing benchmark: the CPU work vLLM's frontend does for every HunyuanOCR request (PNG decode, then
the HF `HunYuanVLImageProcessor`: smart_resize, normalise, patchify into (patches, 768) float32), per backend and
thread count. vLLM 0.26 runs it in one frontend process (its renderer pool has 1 worker by default) and pins the PIL
backend, so its cost per image caps a whole GPU's throughput: images/s here is the most any engine replica can
serve with that configuration.

    python -m loadtest bench preprocess --out results/preprocess            # needs transformers (no vLLM, no GPU)

Also checks that the two backends pack patches identically (max |Δ| on an image already at the processor's size,
where no interpolation differs), so switching the backend cannot change what the model sees.
Writes OUT/preprocess.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loadtest.documents import make_documents


def _processor(kit: Path, backend: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(kit, backend=backend)


def _decode(png: bytes):
    """The engine's own PNG decode (what runs before the processor in a replica)."""
    from service.engine.vllm_engine import _png_to_image

    return _png_to_image(png)


def packing_check(kit: Path, png: bytes) -> dict[str, Any]:
    """Both backends on an image already at the processor's output size: they must agree (float rounding only)."""
    pil, tv = _processor(kit, "pil"), _processor(kit, "torchvision")
    image = _decode(png)
    grid = pil(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    exact = image.resize((grid[2] * 16, grid[1] * 16))
    a = pil(images=[exact], return_tensors="pt")["pixel_values"].float()
    b = tv(images=[exact], return_tensors="pt")["pixel_values"].float()
    resized_a = pil(images=[image], return_tensors="pt")["pixel_values"].float()
    resized_b = tv(images=[image], return_tensors="pt")["pixel_values"].float()
    return {"shape": list(a.shape), "exact_size_max_abs_diff": float((a - b).abs().max()),
            "resized_mean_abs_diff": float((resized_a - resized_b).abs().mean()),
            "same_shape": a.shape == b.shape and resized_a.shape == resized_b.shape}


def throughput(kit: Path, backend: str, pngs: list[bytes], threads: int, seconds: float) -> dict[str, Any]:
    processor = _processor(kit, backend)

    def one(png: bytes) -> None:
        processor(images=[_decode(png)], return_tensors="pt")

    one(pngs[0])  # warm
    done, started = 0, time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        while time.perf_counter() - started < seconds:
            batch = [pngs[(done + i) % len(pngs)] for i in range(threads * 2)]
            list(pool.map(one, batch))
            done += len(batch)
    elapsed = time.perf_counter() - started
    return {"backend": backend, "threads": threads, "images": done, "images_per_s": round(done / elapsed, 1),
            "ms_per_image_one_thread_equiv": round(elapsed * 1000 * threads / done, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", default="1,2,4,8", help="thread counts to try (comma-separated)")
    p.add_argument("--backends", default="pil,torchvision")
    p.add_argument("--kinds", default="a4,id_card")
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    args = p.parse_args(argv)

    from service.modelkit import write_kit

    kit = Path(tempfile.mkdtemp(prefix="ocr-preprocess-kit-"))
    write_kit(kit, tiny=False, weights=False)
    import torch
    import transformers

    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpu_count": os.cpu_count(),
                              "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
                              "kinds": {}}
    for kind in args.kinds.split(","):
        pngs = [d.png for d in make_documents(kind, 4)]
        decode_started = time.perf_counter()
        for png in pngs:
            _decode(png)
        entry: dict[str, Any] = {"png_decode_ms": round((time.perf_counter() - decode_started) * 1000 / len(pngs), 1),
                                 "packing": packing_check(kit, pngs[0]), "runs": []}
        for backend in args.backends.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                run = throughput(kit, backend, pngs, threads, args.seconds)
                entry["runs"].append(run)
                print(f"{kind:8s} {backend:12s} threads {threads:2d}: {run['images_per_s']:7.1f} images/s",
                      flush=True)
        result["kinds"][kind] = entry
        print(kind, "packing", entry["packing"], "png decode ms", entry["png_decode_ms"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "preprocess.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
