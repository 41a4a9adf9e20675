"""The ingress resizes pages as the engine's image processor would (settings.engine.presize).

- `presize` gives HunyuanOCR's HF image processor exactly the values it computes from the unresized page (max |Δ| 0,
  same patch grid), with both processor backends, for pages it upscales, downscales and rounds to multiples of 32;
- through the API: the engine gets the page at the processor's size, in either transport; an upload already at that
  size still goes on as its own bytes; answers (boxes in upload pixels) do not change;
- it applies only to an engine that reports an image processor, and an ingress without torchvision leaves the
  resize to the engine instead of failing requests.
The real vLLM-CPU engine sees the same tokens for a presized page, without resizing it, in test_vllm_engine_warmup;
the session's vLLM Serve deployment runs with presize on (tests/fixtures/vllm.py).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from service.admission.presize import presize, processor_size
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


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    from service.cli.modelkit import write_kit

    out = tmp_path_factory.mktemp("presize-kit")
    write_kit(out, tiny=False, weights=False)
    return out


SIZES = {
    "ID card, rounded to 992x640": (1000, 630),
    "A4 at 150 dpi, rounded to 1248x1760": (1240, 1754),
    "small, upscaled to min_pixels": (300, 200),
    "large, downscaled to max_pixels": (2600, 3400),
}


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_the_processor_computes_the_same_values_from_a_presized_page(kit, backend):
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(kit, backend=backend)
    for name, size in SIZES.items():
        page = document_page(size)
        sized = presize(page, processor_info(backend))
        assert sized.size != page.size and sized.size == processor_size(*page.size, processor_info(backend)), name
        assert sized.width % 32 == 0 and sized.height % 32 == 0, name
        direct = processor(images=[np.array(page)], return_tensors="pt")
        via_ingress = processor(images=[np.array(sized)], return_tensors="pt")
        assert direct["image_grid_thw"].tolist() == via_ingress["image_grid_thw"].tolist(), name
        assert float((direct["pixel_values"] - via_ingress["pixel_values"]).abs().max()) == 0.0, name


def test_the_kernel_matters(kit):
    """The check above can fail: PIL's bicubic is not what the torchvision processor computes."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(kit, backend="torchvision")
    page = document_page((1000, 630))
    wrong = presize(page, processor_info("pil"))
    direct = processor(images=[np.array(page)], return_tensors="pt")["pixel_values"]
    assert float((direct - processor(images=[np.array(wrong)], return_tensors="pt")["pixel_values"]).abs().max()) > 0


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


@pytest.mark.parametrize("transport", ["png", "pixels"])
async def test_the_engine_gets_the_page_at_its_processor_size(transport):
    page = document_page((1000, 630))
    upload = png_bytes(page)
    on, sent = await post(ProcessorEngine(), upload, engine_image_presize=True, engine_image_transport=transport)
    assert (sent.width, sent.height) == (992, 640)
    assert np.array_equal(sent.rgb_array(), np.asarray(presize(page, processor_info())))
    off, unsized = await post(ProcessorEngine(), upload, engine_image_transport=transport)
    assert (unsized.width, unsized.height) == (1000, 630)
    # the model's 0-1000 boxes map back to the same upload pixels either way; the answer does not change
    assert on["lines"] and [line["box"] for line in on["lines"]] == [line["box"] for line in off["lines"]]
    assert on["image"] == off["image"] and on["image"]["width"] == 1000


async def test_an_upload_at_the_processor_size_goes_on_as_it_is():
    upload = png_bytes(document_page((992, 640)))
    _, sent = await post(ProcessorEngine(), upload, engine_image_presize=True, engine_image_transport="png")
    assert sent.image_png == upload


async def test_a_budget_downscale_is_followed_by_the_processor_resize():
    """A page over the context budget is shrunk first (as without presize), then sized for the processor."""
    page = document_page((2600, 3400))
    engine = ProcessorEngine()
    _, sent = await post(engine, png_bytes(page), engine_image_presize=True, max_model_len=2048,
                         engine_image_transport="pixels")
    _, unsized = await post(ProcessorEngine(), png_bytes(page), max_model_len=2048, engine_image_transport="pixels")
    assert (sent.width, sent.height) == processor_size(unsized.width, unsized.height, processor_info())
    assert np.array_equal(sent.rgb_array(), np.asarray(presize(unsized.pil_image(), processor_info())))


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
