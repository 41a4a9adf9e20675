"""`presize` (service/admission/presize.py) gives HunyuanOCR's HF image processor (transformers, the model kit's
processor config) exactly the values it computes from the unresized page (max |Δ| 0, same patch grid), with both
processor backends, for pages it upscales, downscales and rounds to multiples of 32; and the check can fail. Through
the API with torchvision's kernel: the engine gets the page at the processor's size, in either transport, and the
answers (boxes in upload pixels) do not change; a page over the context budget is shrunk first, then presized."""

from __future__ import annotations

import numpy as np
import pytest

from service.admission.presize import presize, processor_size
from tests.unit.test_presize import (
    SIZES,
    ProcessorEngine,
    document_page,
    png_bytes,
    post,
    processor_info,
)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    from service.cli.modelkit import write_kit

    out = tmp_path_factory.mktemp("presize-kit")
    write_kit(out, tiny=False, weights=False)
    return out


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


async def test_a_budget_downscale_is_followed_by_the_processor_resize():
    """A page over the context budget is shrunk first (as without presize), then sized for the processor."""
    page = document_page((2600, 3400))
    engine = ProcessorEngine()
    _, sent = await post(engine, png_bytes(page), engine_image_presize=True, max_model_len=2048,
                         engine_image_transport="pixels")
    _, unsized = await post(ProcessorEngine(), png_bytes(page), max_model_len=2048, engine_image_transport="pixels")
    assert (sent.width, sent.height) == processor_size(unsized.width, unsized.height, processor_info())
    assert np.array_equal(sent.rgb_array(), np.asarray(presize(unsized.pil_image(), processor_info())))
