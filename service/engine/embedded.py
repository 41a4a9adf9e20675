"""Embedded CPU engine: rapidocr (PP-OCRv6 small det/rec ONNX models shipped in its wheel) on onnxruntime.

The laptop default: no GPU, no downloads at run time (the models are read from the installed wheel; a missing model
file is an error, never a fetch). It detects and recognises lines itself, so it returns structured `lines` and
supports only the `spotting` and `text` tasks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from service.engine.protocol import EngineDelta, EngineInfo, EngineLine, EngineRequest, EngineResult
from service.errors import OCRError

log = logging.getLogger(__name__)

SUPPORTED_TASKS = ("spotting", "text")


def pad_thin_page(image: np.ndarray, det_limit_side_len: int) -> np.ndarray:
    """A page so thin that the detector's resize (longest side to `det_limit_side_len`, sides rounded to multiples of
    32) would round its short side to 0 px, where rapidocr raises (a 16x3200 strip): white margin on the right or at
    the bottom until the short side keeps 32 px. Lines keep their pixel coordinates (the margin comes after them)."""
    height, width = image.shape[:2]
    scale = det_limit_side_len / max(height, width)
    if scale >= 1:
        return image
    needed = math.ceil(32 / scale)
    if min(height, width) >= needed:
        return image
    pad = ((0, needed - height), (0, 0), (0, 0)) if height < width else ((0, 0), (0, needed - width), (0, 0))
    return np.pad(image, pad, constant_values=255)


class EmbeddedEngine:
    """rapidocr behind the engine protocol. Inference runs in a worker thread (onnxruntime releases the GIL)."""

    name = "embedded"

    def __init__(self, *, det_limit_side_len: int = 960, threads: int = 0, model_name: str = "rapidocr-ppocrv6",
                 concurrency: int = 1):
        self._det_limit_side_len = det_limit_side_len
        self._threads = threads
        self._model_name = model_name
        self._ocr = None
        # onnxruntime sessions use all cores per call; running calls one at a time keeps latency predictable
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        import rapidocr
        from rapidocr import RapidOCR

        models_dir = Path(rapidocr.__file__).parent / "models"
        for name in ("PP-OCRv6_det_small.onnx", "PP-OCRv6_rec_small.onnx"):
            if not (models_dir / name).exists():
                raise RuntimeError(f"rapidocr model {name} missing from {models_dir}; reinstall rapidocr==3.10.0")
        threads = self._threads if self._threads > 0 else -1
        params = {
            "Global.log_level": "error",
            "Global.use_cls": False,  # documents arrive upright (EXIF applied at admission)
            "Det.limit_type": "max",
            "Det.limit_side_len": self._det_limit_side_len,
            "EngineConfig.onnxruntime.intra_op_num_threads": threads,
        }
        self._ocr = await asyncio.to_thread(RapidOCR, params=params)
        await self.check_health()

    def _run(self, image: np.ndarray) -> tuple[list[EngineLine], float]:
        assert self._ocr is not None, "engine not started"
        started = time.perf_counter()
        out = self._ocr(pad_thin_page(image, self._det_limit_side_len))
        elapsed_ms = (time.perf_counter() - started) * 1000
        lines: list[EngineLine] = []
        if out.boxes is not None and out.txts is not None:
            for box, txt, score in zip(out.boxes, out.txts, out.scores):
                if not txt.strip():
                    continue
                polygon = [[float(x), float(y)] for x, y in np.asarray(box).reshape(-1, 2)[:4]]
                lines.append(EngineLine(text=txt, polygon=polygon, confidence=float(score)))
        return lines, elapsed_ms

    async def generate(self, request: EngineRequest) -> EngineResult:
        if request.task not in SUPPORTED_TASKS:
            raise OCRError("unsupported_task", f"task {request.task!r} is not supported by the embedded engine "
                           f"(supported: {', '.join(SUPPORTED_TASKS)}); use the vllm engine")
        async with self._slots:
            lines, engine_ms = await asyncio.to_thread(lambda: self._run(request.rgb_array()))
        lines = sort_reading_order(lines)
        return EngineResult(text="\n".join(line.text for line in lines), lines=lines, finish_reason="stop",
                            output_tokens=sum(len(line.text) for line in lines), engine_ms=engine_ms)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        result = await self.generate(request)
        for line in result.lines or []:
            yield EngineDelta(text=line.text + "\n")
        yield EngineDelta(final=result)

    async def check_health(self) -> None:
        """A real tiny inference: a blank 64×32 image must run through det (and return nothing)."""
        await asyncio.to_thread(self._run, np.full((32, 64, 3), 255, dtype=np.uint8))

    async def info(self) -> EngineInfo:
        return EngineInfo(name=self.name, model=self._model_name, supported_tasks=list(SUPPORTED_TASKS),
                          follows_instructions=False, image_transports=["png", "pixels"])

    async def list_adapters(self) -> list[str]:
        return []

    async def load_adapter(self, name: str, path: str | None = None) -> None:
        raise OCRError("unknown_adapter", f"adapter {name!r} does not exist (the embedded engine has no adapters)")

    async def unload_adapter(self, name: str) -> None:
        raise OCRError("unknown_adapter", f"adapter {name!r} does not exist (the embedded engine has no adapters)")

    async def shutdown(self) -> None:
        self._ocr = None


def sort_reading_order(lines: list[EngineLine]) -> list[EngineLine]:
    """Top-to-bottom, then left-to-right for lines on the same row (overlapping vertical spans)."""
    def key_box(line: EngineLine) -> tuple[float, float, float]:
        ys = [p[1] for p in line.polygon]
        xs = [p[0] for p in line.polygon]
        return min(ys), max(ys), min(xs)

    boxes = sorted(lines, key=lambda ln: key_box(ln)[0])
    rows: list[list[EngineLine]] = []
    for line in boxes:
        top, bottom, _ = key_box(line)
        if rows:
            r_top, r_bottom, _ = key_box(rows[-1][0])
            overlap = min(bottom, r_bottom) - max(top, r_top)
            if overlap > 0.5 * min(bottom - top, r_bottom - r_top):
                rows[-1].append(line)
                continue
        rows.append([line])
    return [line for row in rows for line in sorted(row, key=lambda ln: key_box(ln)[2])]
