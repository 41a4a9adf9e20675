"""Image preprocessing benchmark: the CPU work vLLM's frontend does for every HunyuanOCR request (the page as the
engine replica gets it, then the HF `HunYuanVLImageProcessor`: smart_resize, normalise, patchify into (patches, 768)
float32), per backend, input form and thread count. vLLM 0.26 runs it in one frontend process (its renderer pool
has 1 worker by default) and pins the PIL backend, so its cost per image caps a whole GPU's throughput: images/s
here is the most any engine replica can serve with that configuration.

Input forms: `png` = the replica decodes a PNG file into a numpy array; `pixels` = it wraps the RGB pixels the ingress
sent (settings.engine_image_transport; service.engine.vllm_engine.engine_image); `presized` = pixels the ingress
already resized to the processor's size with the backend's own kernel (settings.engine_image_presize), so the
processor skips its resize; `pil` = the decoded PNG as a PIL image, which is what raw vLLM hands the processor (and
our engine did before 2026-11-30). The ingress's side of `presized` (the resize it takes over) is timed too.

    python -m loadtest bench preprocess --out results/preprocess            # needs transformers (no vLLM, no GPU)

Also times what a render process (settings.preprocess_processes) adds per page: the patches pickled there and
unpickled in the engine replica (`render_pool_transfer`, with the last backend given). Also checks that the two
backends pack patches identically (max |Δ| on an image already at the processor's size,
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
from service.engine.vllm_engine import image_processor_info


def _processor(kit: Path, backend: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(kit, backend=backend)


def _page_request(png: bytes, transport: str, presize_for=None):
    """The EngineRequest the ingress sends for this page (pixels decoded, and presized for `presize_for`, there,
    outside the timed work)."""
    import io

    from PIL import Image

    from service.admission.presize import presize
    from service.engine.protocol import EngineRequest

    image = Image.open(io.BytesIO(png)).convert("RGB")
    if transport == "presized":
        image = presize(image, presize_for)
    page = {"image_rgb": image.tobytes()} if transport in ("pixels", "presized") else {"image_png": png}  # pil: PNG
    return EngineRequest(request_id="bench", task="text", width=image.width, height=image.height, **page)


def _decode(png: bytes, transport: str = "png", presize_for=None):
    """The page as the engine replica hands it to vLLM's processor (what runs before the processor there);
    `pil` = the decoded PIL image, as raw vLLM and our engine before 2026-11-30 handed it on."""
    from service.engine.vllm_engine import engine_image

    if transport == "pil":
        return _page_request(png, "png").pil_image()
    return engine_image(_page_request(png, transport, presize_for))


def presize_ms(kit: Path, backend: str, pngs: list[bytes], rounds: int = 5) -> float:
    """The ingress's side of `presized`: ms per page of the resize it takes over from the replica (one thread)."""
    import io

    from PIL import Image

    import torch

    from service.admission.presize import presize

    info = image_processor_info(kit, backend)
    images = [Image.open(io.BytesIO(png)).convert("RGB") for png in pngs]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # an ingress replica's share: Ray gives each one CPU
    try:
        presize(images[0], info)  # warm (torch's first call)
        started = time.perf_counter()
        for _ in range(rounds):
            for image in images:
                presize(image, info)
        return round((time.perf_counter() - started) * 1000 / (rounds * len(images)), 2)
    finally:
        torch.set_num_threads(threads)


def packing_check(kit: Path, png: bytes) -> dict[str, Any]:
    """Both backends on an image already at the processor's output size: they must agree (float rounding only).
    And what the engine hands the processor (a numpy array, from a PNG or from the ingress's pixels) must give
    each backend exactly what the decoded PIL image gives it."""
    pil, tv = _processor(kit, "pil"), _processor(kit, "torchvision")
    image = _page_request(png, "png").pil_image()
    grid = pil(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    exact = image.resize((grid[2] * 16, grid[1] * 16))
    a = pil(images=[exact], return_tensors="pt")["pixel_values"].float()
    b = tv(images=[exact], return_tensors="pt")["pixel_values"].float()
    from_pil = {"pil": pil(images=[image], return_tensors="pt")["pixel_values"].float(),
                "torchvision": tv(images=[image], return_tensors="pt")["pixel_values"].float()}
    engine_diff: dict[str, float] = {}
    for transport in ("png", "pixels", "presized"):
        for name, proc in (("pil", pil), ("torchvision", tv)):
            array = _decode(png, transport, image_processor_info(kit, name))
            values = proc(images=[array], return_tensors="pt")["pixel_values"].float()
            engine_diff[f"{transport}/{name}"] = float((values - from_pil[name]).abs().max())
    return {"shape": list(a.shape), "exact_size_max_abs_diff": float((a - b).abs().max()),
            "resized_mean_abs_diff": float((from_pil["pil"] - from_pil["torchvision"]).abs().mean()),
            "same_shape": a.shape == b.shape and from_pil["pil"].shape == from_pil["torchvision"].shape,
            "engine_image_vs_pil_max_abs_diff": engine_diff}


def pool_transfer(kit: Path, backend: str, png: bytes, rounds: int = 5) -> dict[str, Any]:
    """What a render process adds per page (settings.preprocess_processes): the processor's output pickled in the
    worker the way the pool sends it (tensors as raw bytes, service.engine.render_pool) and unpickled in the engine
    replica. Medians over `rounds`; also checks the tensors come back equal."""
    import pickle
    import statistics

    import torch

    from service.engine.render_pool import _dumps

    batch = _processor(kit, backend)(images=[_decode(png)], return_tensors="pt")
    tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
    dumps, loads = [], []
    for _ in range(rounds + 1):  # the first round warms up
        started = time.perf_counter()
        payload = _dumps(tensors)
        pickled = time.perf_counter()
        back = pickle.loads(payload)
        dumps.append((pickled - started) * 1000)
        loads.append((time.perf_counter() - pickled) * 1000)
    return {"mb": round(len(payload) / 1e6, 2), "pickle_ms": round(statistics.median(dumps[1:]), 2),
            "unpickle_ms": round(statistics.median(loads[1:]), 2),
            "equal": all(torch.equal(back[key], value) for key, value in tensors.items())}


def throughput(kit: Path, backend: str, pngs: list[bytes], threads: int, seconds: float,
               transport: str = "png") -> dict[str, Any]:
    from service.engine.vllm_engine import engine_image

    processor = _processor(kit, backend)
    requests = [_page_request(png, transport, image_processor_info(kit, backend)) for png in pngs]

    def one(request) -> None:
        image = request.pil_image() if transport == "pil" else engine_image(request)
        processor(images=[image], return_tensors="pt")

    one(requests[0])  # warm
    done, started = 0, time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        while time.perf_counter() - started < seconds:
            batch = [requests[(done + i) % len(requests)] for i in range(threads * 2)]
            list(pool.map(one, batch))
            done += len(batch)
    elapsed = time.perf_counter() - started
    return {"backend": backend, "input": transport, "threads": threads, "images": done,
            "images_per_s": round(done / elapsed, 1),
            "ms_per_image_one_thread_equiv": round(elapsed * 1000 * threads / done, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", default="1,2,4,8", help="thread counts to try (comma-separated)")
    p.add_argument("--backends", default="pil,torchvision")
    p.add_argument("--kinds", default="a4,id_card")
    p.add_argument("--inputs", default="pil,png,pixels,presized",
                   help="page forms the processor gets (pil, png, pixels, presized)")
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
                                 "packing": packing_check(kit, pngs[0]), "runs": [],
                                 "ingress_presize_ms": {b: presize_ms(kit, b, pngs) for b in args.backends.split(",")},
                                 "render_pool_transfer": pool_transfer(kit, args.backends.split(",")[-1], pngs[0])}
        for backend in args.backends.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                for transport in args.inputs.split(","):  # side by side: the machine's load changes
                    run = throughput(kit, backend, pngs, threads, args.seconds, transport)
                    entry["runs"].append(run)
                    print(f"{kind:8s} {backend:12s} {transport:6s} threads {threads:2d}: "
                          f"{run['images_per_s']:7.1f} images/s", flush=True)
        result["kinds"][kind] = entry
        print(kind, "packing", entry["packing"], "png decode ms", entry["png_decode_ms"], "ingress presize ms",
              entry["ingress_presize_ms"], "render pool transfer", entry["render_pool_transfer"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "preprocess.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
