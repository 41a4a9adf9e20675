"""The service runs HunyuanOCR's HF image processor with the torchvision backend where vLLM pins PIL
(settings.engine.vllm.image_processor_backend). Both backends give the same patches: exactly for a page already at the
processor's size, within interpolation rounding for a page they resize. And the page the engine hands the processor
(a numpy array, decoded from the PNG or wrapping the ingress's pixels) gives each backend exactly what the decoded PIL
image gives it."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from service.engine.protocol import EngineRequest
from tests.fixtures.documents import render_document

PAGES = {"ID card": (1000, 630), "A4 page": (1240, 1754)}


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    pytest.importorskip("torchvision")
    from transformers import AutoImageProcessor

    from service.cli.modelkit import write_kit

    kit = tmp_path_factory.mktemp("kit")
    write_kit(kit, tiny=False, weights=False)
    return {backend: AutoImageProcessor.from_pretrained(kit, backend=backend) for backend in ("pil", "torchvision")}


def page(size: tuple[int, int]) -> tuple[bytes, Image.Image]:
    """Text over colour noise: every pixel and every channel differs from its neighbours."""
    doc = render_document(["Invoice 2026-0117", "Total 1,234.56 EUR"], size=size, top=60, gap=120)
    pixels = np.asarray(Image.open(io.BytesIO(doc.png())).convert("RGB")).astype(np.int16)
    noise = np.random.default_rng(size[0]).integers(-40, 40, pixels.shape)
    image = Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), image


def values(processor, image):
    return processor(images=[image], return_tensors="pt")["pixel_values"].float()


@pytest.mark.parametrize("size", PAGES.values(), ids=PAGES.keys())
def test_both_backends_give_the_same_patches(processors, size):
    _, image = page(size)
    grid = processors["pil"](images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    exact = image.resize((grid[2] * 16, grid[1] * 16))  # already at the processor's size: no resize inside
    pil, torchvision = values(processors["pil"], exact), values(processors["torchvision"], exact)
    assert pil.shape == torchvision.shape and float((pil - torchvision).abs().max()) < 1e-5
    pil, torchvision = values(processors["pil"], image), values(processors["torchvision"], image)
    assert pil.shape == torchvision.shape and float((pil - torchvision).abs().mean()) < 1e-3  # rounding only


@pytest.mark.parametrize("transport", ["png", "pixels"])
def test_the_engines_page_gives_each_backend_what_the_pil_image_gives_it(processors, transport):
    from service.engine.vllm.engine import engine_image

    png, image = page(PAGES["ID card"])
    pixels = {"image_rgb": image.tobytes()} if transport == "pixels" else {"image_png": png}
    request = EngineRequest(request_id="t", task="text", width=image.width, height=image.height, **pixels)
    array = engine_image(request)
    for processor in processors.values():
        assert float((values(processor, array) - values(processor, image)).abs().max()) == 0.0
