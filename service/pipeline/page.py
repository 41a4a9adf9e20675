"""One page from upload to engine request: what its header tells (probe), how it goes to the engine (plan: size,
prompt, output budget), and the blocking work of decoding or rendering it, resizing and encoding it (run on the
admission pool, service/admission/workpool.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from service.admission.budget import (EMBEDDED_MAX_SIDE, ImagePlan, plan_for_embedded, plan_for_vlm,
                                      prompt_token_bound)
from service.admission.pdf import PdfSession, rendered_size, single_page_pixel_budget
from service.admission.presize import presize, processor_size
from service.admission.prompts import build_prompt, guided_json_for
from service.config import Settings
from service.engine.protocol import EngineInfo, EngineRequest
from service.errors import OCRError
from service.imaging import (RELEASE_AFTER_PIXELS, DecodedImage, decode_base64_image, decode_image, encode_png,
                             probe_image, release_freed_memory, resize_to, sniff_format)
from service.parsing.page import PageGeometry
from service.pipeline.context import AppContext
from service.schema import OCRRequest
from service.tasks import TASKS


@dataclass
class PreparedPage:
    """An admitted page, ready for the engine."""

    engine_request: EngineRequest
    geometry: PageGeometry
    plan: ImagePlan
    decode_ms: float
    source: str = "image"  # image | pdf (metrics label)


@dataclass
class Upload:
    """What admission knows of an uploaded file before decoding it: its format and size in pixels (an image's
    header; for a PDF its page box at the DPI it would be rendered at), and for a PDF the open sandbox session."""

    data: bytes
    format: str
    width: int
    height: int
    pdf: PdfSession | None = None

    def close(self) -> None:
        if self.pdf is not None:
            self.pdf.stop()
            self.pdf.close()


def probe_upload(data: bytes | str, settings: Settings, *, allow_pdf: bool = True) -> Upload:
    """Blocking (admission pool): an image's header, or a single-page PDF opened in the sandbox (its page count and
    box; no page loaded). Nothing is decoded or rendered. A base64 string (a JSON body's `image`) is decoded to its
    bytes first, here rather than on the event loop."""
    s = settings
    if isinstance(data, str):
        data = decode_base64_image(data, s.limits.max_body_bytes)
    if allow_pdf and sniff_format(data) == "PDF":
        session = PdfSession(data, s, single_page=True)
        try:
            (page,) = session.open().pages
        except BaseException:
            session.close()
            raise
        return Upload(data, "PDF", *rendered_size(page, s, single_page_pixel_budget(s)), pdf=session)
    fmt, width, height = probe_image(data, allowed_formats=s.limits.allowed_formats, max_pixels=s.limits.max_image_pixels,
                                     max_side=s.limits.max_image_side)
    return Upload(data, fmt, width, height)


def plan_page(ctx: AppContext, req: OCRRequest, width: int, height: int, engine: EngineInfo,
              prompt: str | None = None) -> tuple[ImagePlan, str | None, int]:
    """How a page of this size goes to the engine: (plan, the prompt sent, the request's output budget). Only the
    size is needed, so it also prices an upload from its header before it is decoded. `prompt`: user text instead
    of the task's (a chat message)."""
    s = ctx.settings
    if max(width, height) > s.limits.max_image_aspect_ratio * min(width, height):
        raise OCRError("unsupported_aspect_ratio", f"the image is {width}x{height}; sides may differ "
                       f"by at most {s.limits.max_image_aspect_ratio:g}x")
    task = TASKS[req.task]
    max_tokens = min(req.max_tokens or task.default_max_tokens, s.engine.max_output_tokens)
    if engine.name == "embedded":
        return plan_for_embedded(width, height, max_side=EMBEDDED_MAX_SIDE), None, max_tokens  # it takes no prompt
    prompt = build_prompt(req, s) if prompt is None else prompt
    # the engine's own processor limits where it reports them (a real 1.5 checkout allows 4096² pixels)
    processor = engine.image_processor
    plan = plan_for_vlm(width, height, max_model_len=s.engine.max_model_len, max_tokens=max_tokens,
                        min_pixels=processor.min_pixels if processor else s.engine.min_image_pixels,
                        max_pixels=processor.max_pixels if processor else s.engine.max_engine_image_pixels,
                        prompt_overhead=prompt_token_bound(prompt, engine.prompt_template_tokens))
    return plan, prompt, max_tokens


def prepare_decoded_page(ctx: AppContext, req: OCRRequest, decoded: DecodedImage, engine: EngineInfo,
                         request_id: str, *, started: float | None = None, source: str = "image",
                         prompt: str | None = None) -> PreparedPage:
    """Budget, resize and prompt an already decoded page (also used by jobs), in the form the engine takes: pixels
    when it can (settings.engine.image_transport), else PNG, where an upload that already is a bare PNG of the
    planned pixels goes on as it is. `prompt`: user text instead of the task's (a chat message); the page's
    context budget counts whichever is sent."""
    s = ctx.settings
    started = time.perf_counter() if started is None else started
    plan, prompt, max_tokens = plan_page(ctx, req, decoded.width, decoded.height, engine, prompt)
    presizing = s.engine.presize and engine.image_processor is not None
    size = (plan.width, plan.height)
    if presizing:
        size = processor_size(*size, engine.image_processor)
    pixels_transport = s.engine.image_transport == "pixels" and "pixels" in engine.image_transports
    if decoded.png is not None and size == (decoded.width, decoded.height) and not pixels_transport:
        # the upload is already the engine's PNG: send it on, decoded here only if admission did not defer that
        page_image, width, height = {"image_png": decoded.png}, decoded.width, decoded.height
    else:
        image = resize_to(decoded.pixels(), plan.width, plan.height)
        if presizing:
            # the engine's processor would resize to multiples of 32 in its busy replica; same kernel, same pixels
            image = presize(image, engine.image_processor)
        if pixels_transport:
            page_image = {"image_rgb": (image if image.mode == "RGB" else image.convert("RGB")).tobytes()}
        else:
            page_image = {"image_png": encode_png(image)}
        width, height = image.width, image.height
    engine_request = EngineRequest(
        request_id=request_id, task=req.task, width=width, height=height, **page_image,
        prompt=prompt, max_tokens=plan.max_tokens or max_tokens, adapter=req.adapter,
        repetition_penalty=s.parsing.repetition_penalty, guided_json=guided_json_for(req, s), logprobs=req.confidence,
    )
    if s.testing.fixed_output_tokens:  # benchmarks: fixed output length, whatever the (random) weights emit
        engine_request.min_tokens, engine_request.ignore_eos = engine_request.max_tokens, True
    geometry = PageGeometry(decoded.width, decoded.height, plan.width, plan.height)
    return PreparedPage(engine_request, geometry, plan, (time.perf_counter() - started) * 1000, source)


def decode_and_prepare(ctx: AppContext, req: OCRRequest, upload: Upload, engine: EngineInfo, request_id: str,
                       prompt: str | None = None) -> PreparedPage:
    """Blocking (admission pool): decode the image (or render the PDF's page), then budget, resize, re-encode. The
    decoded pixels are gone when it returns, their memory given back to the system for a large page."""
    try:
        return _decode_and_prepare(ctx, req, upload, engine, request_id, prompt)
    finally:
        if upload.width * upload.height >= RELEASE_AFTER_PIXELS:
            release_freed_memory()


def _decode_and_prepare(ctx: AppContext, req: OCRRequest, upload: Upload, engine: EngineInfo, request_id: str,
                        prompt: str | None) -> PreparedPage:
    s = ctx.settings
    started = time.perf_counter()
    try:
        if upload.pdf is not None:
            rendered = upload.pdf.render(1, single_page_pixel_budget(s))
            if rendered.error is not None:
                raise rendered.error
            decoded = DecodedImage(image=rendered.image, format="PDF", width=rendered.image.width,
                                   height=rendered.image.height)
        else:
            decoded = decode_image(upload.data, allowed_formats=s.limits.allowed_formats, max_pixels=s.limits.max_image_pixels,
                                   max_side=s.limits.max_image_side, max_frames=s.limits.max_frames,
                                   defer_pixels=s.engine.png_pixel_check == "engine")
    finally:
        upload.close()
    return prepare_decoded_page(ctx, req, decoded, engine, request_id, started=started,
                                source="pdf" if upload.pdf is not None else "image", prompt=prompt)


def prepare_page(ctx: AppContext, req: OCRRequest, data: bytes, engine: EngineInfo,
                 request_id: str) -> PreparedPage:
    """All the CPU work of admitting one upload, in one blocking call (benchmarks): probe, decode, prepare."""
    return decode_and_prepare(ctx, req, probe_upload(data, ctx.settings), engine, request_id)


def rate_limit_cost(ctx: AppContext, plan: ImagePlan, pages: int = 1) -> float:
    mode = ctx.settings.rate_limit.cost
    if mode == "image_tokens":
        # the embedded engine has no image tokens: charge what HunyuanOCR would
        return float(plan.image_tokens or max(1, plan.width * plan.height // 1024))
    if mode == "pages":
        return float(pages)
    return 1.0
