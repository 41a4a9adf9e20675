"""Image-token budget (service/admission/budget.py), from 32×32 to 8000×6000: the admission plan fits the context
with the request's own prompt, and text too long for any image is a 400. The image tokens against what vLLM's
multi-modal processor really produces for HunyuanOCR: tests/engine/test_budget.py."""

from __future__ import annotations

import pytest

from service.admission.budget import PROMPT_OVERHEAD_TOKENS, image_tokens_for, plan_for_vlm

MIN_PIXELS, MAX_PIXELS = 512 * 512, 2048 * 2048
SIZES = [(32, 32), (1, 1), (33, 17), (100, 3000), (3000, 100), (320, 200), (511, 513), (512, 512), (640, 480),
         (1000, 630), (1240, 1754), (1754, 1240), (2048, 2048), (2049, 2047), (2480, 3508), (4000, 3000),
         (4961, 7016), (8000, 6000), (6000, 8000)]


@pytest.mark.parametrize("width,height", SIZES)
@pytest.mark.parametrize("max_model_len,max_tokens", [(8192, 2048), (4096, 1024), (2048, 64), (1024, 900)])
def test_plan_fits_the_context(width, height, max_model_len, max_tokens):
    plan = plan_for_vlm(width, height, max_model_len=max_model_len, max_tokens=max_tokens, min_pixels=MIN_PIXELS,
                        max_pixels=MAX_PIXELS, prompt_overhead=PROMPT_OVERHEAD_TOKENS)
    assert plan.image_tokens == image_tokens_for(plan.height, plan.width, MIN_PIXELS, MAX_PIXELS)
    assert plan.image_tokens + PROMPT_OVERHEAD_TOKENS + plan.max_tokens <= max_model_len
    assert plan.width <= width and plan.height <= height  # never upscaled by the service (the processor does it)
    assert 1 <= plan.max_tokens <= max_tokens
    if plan.max_tokens == max_tokens and (plan.width, plan.height) != (width, height):
        # shrunk only as far as needed: a few percent larger would not fit
        bigger = image_tokens_for(round(plan.height * 1.05), round(plan.width * 1.05), MIN_PIXELS, MAX_PIXELS)
        assert bigger + PROMPT_OVERHEAD_TOKENS + max_tokens > max_model_len or bigger == plan.image_tokens


def test_prompt_token_bound_counts_utf8_bytes_over_the_template():
    from service.admission.budget import TEMPLATE_TOKENS, prompt_token_bound
    from service.tasks import HUNYUAN_15_PROMPTS

    assert prompt_token_bound("Total", 5) == 5 + 5
    assert prompt_token_bound("发票", 5) == 5 + 6  # three bytes a character
    assert prompt_token_bound(None) == prompt_token_bound("") == TEMPLATE_TOKENS  # no measured template
    # 1.5's doc_parse prompt is longer than a fixed 160-token allowance for every prompt would be
    assert prompt_token_bound(HUNYUAN_15_PROMPTS["doc_parse"], 5) > PROMPT_OVERHEAD_TOKENS


def test_plan_counts_the_requests_own_prompt():
    """An A4 page with a long prompt is shrunk further than with a short one, and both fit with their prompt."""
    short = plan_for_vlm(1240, 1754, max_model_len=2048, max_tokens=32, min_pixels=MIN_PIXELS,
                         max_pixels=MAX_PIXELS, prompt_overhead=29)
    long = plan_for_vlm(1240, 1754, max_model_len=2048, max_tokens=32, min_pixels=MIN_PIXELS,
                        max_pixels=MAX_PIXELS, prompt_overhead=214)
    assert short.image_tokens + 29 + 32 <= 2048 and long.image_tokens + 214 + 32 <= 2048
    assert long.image_tokens < short.image_tokens and long.max_tokens == short.max_tokens == 32


def test_text_too_long_for_any_image_is_a_400():
    from service.errors import OCRError

    # the page shrunk to min_pixels: smaller, the processor would scale it back up
    scale = (MIN_PIXELS / (1240 * 1754)) ** 0.5
    smallest = image_tokens_for(round(1754 * scale), round(1240 * scale), MIN_PIXELS, MAX_PIXELS)
    fits = plan_for_vlm(1240, 1754, max_model_len=2048, max_tokens=500, min_pixels=MIN_PIXELS,
                        max_pixels=MAX_PIXELS, prompt_overhead=2048 - smallest - 1)
    assert fits.image_tokens == smallest and fits.max_tokens == 1  # the output budget gives way first
    with pytest.raises(OCRError) as raised:
        plan_for_vlm(1240, 1754, max_model_len=2048, max_tokens=500, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                     prompt_overhead=2048 - smallest)
    assert raised.value.code == "prompt_too_long" and raised.value.status == 400
