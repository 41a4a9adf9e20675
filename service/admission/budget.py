"""Image-token budget of HunyuanOCR: how many tokens an image costs, and how far to downscale it to fit the context.

HunYuanVLImageProcessor resizes to multiples of patch·merge = 32 within [min_pixels, max_pixels] (`smart_resize`),
then the vision tower emits one token per 32×32 block plus one newline token per row plus start/end:
    tokens = (H/32) · (W/32 + 1) + 2
An A4 page at 150 dpi (1240×1754) costs ≈ 2.2k tokens; at 300 dpi it would not fit a 4k context, so the service
shrinks the image until image tokens + prompt + output fit `max_model_len`, and reports the scale so boxes map back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.errors import OCRError

FACTOR = 32  # patch_size 16 × spatial_merge 2
# Embedded engine: longest side sent to the engine (the detector itself works at embedded_det_limit_side_len)
EMBEDDED_MAX_SIDE = 4096
# A typical request's text tokens (chat template + task prompt): only for sizing what is rendered before the request's
# own prompt is planned (PDF pages); each page's plan uses its own prompt's bound (prompt_token_bound).
PROMPT_OVERHEAD_TOKENS = 160
# Chat-template tokens around the user text, for an engine that does not measure its own (EngineInfo)
TEMPLATE_TOKENS = 32


def prompt_token_bound(user_text: str | None, template_tokens: int | None = None) -> int:
    """At most how many text tokens a prompt takes: the chat template's own tokens plus one per UTF-8 byte of the
    user text. A byte-level BPE or byte-fallback tokenizer never makes more tokens than bytes, and the ingress has no
    tokenizer to count exactly. Loose for English (3-4 bytes a token), tight for CJK prompts (the model kit's
    tokenizer: 203 tokens for the 209 bytes of 1.5's doc_parse prompt)."""
    return (TEMPLATE_TOKENS if template_tokens is None else template_tokens) + len((user_text or "").encode("utf-8"))


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = FACTOR) -> tuple[int, int]:
    """(height, width) the processor resizes to: multiples of `factor`, area within [min_pixels, max_pixels]."""
    if height <= 0 or width <= 0:
        raise ValueError("image sides must be positive")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_tokens_for(height: int, width: int, min_pixels: int, max_pixels: int) -> int:
    """Tokens the processor produces for an image of this size (after smart_resize)."""
    h, w = smart_resize(height, width, min_pixels, max_pixels)
    return (h // FACTOR) * (w // FACTOR + 1) + 2


@dataclass(frozen=True)
class ImagePlan:
    """How an uploaded image is sent to the engine."""

    width: int  # pixels of the image sent to the engine
    height: int
    scale: float  # engine pixels per uploaded pixel (≤ 1)
    image_tokens: int  # tokens the model spends on it (0 for engines without a token budget)
    max_tokens: int  # output tokens granted


def plan_for_vlm(
    width: int,
    height: int,
    *,
    max_model_len: int,
    max_tokens: int,
    min_pixels: int,
    max_pixels: int,
    prompt_overhead: int,
) -> ImagePlan:
    """Downscale (never upscale) until image tokens + prompt + `max_tokens` fit `max_model_len`.

    `prompt_overhead`: the request's text tokens (prompt_token_bound). Shrinking stops where the processor would
    upscale the image back (area min_pixels): below that the token count no longer falls. If even that image leaves
    less than `max_tokens` of room, the output budget shrinks instead; if it leaves no room for one output token, the
    text is too long for any image (400 `prompt_too_long`).
    """
    room = max_model_len - prompt_overhead - max_tokens
    # the processor upscales anything smaller than min_pixels, so a smaller image saves no tokens
    min_scale = min(1.0, math.sqrt(min_pixels / (width * height)))
    scale = 1.0
    w, h = width, height
    for _ in range(64):
        tokens = image_tokens_for(h, w, min_pixels, max_pixels)
        if tokens <= room or scale <= min_scale:
            break
        # tokens ≈ area/1024: shrink the area by the excess ratio, then a little more per retry
        step = min(0.98, 1 / math.sqrt(tokens / room)) if room > 0 else 0.0
        scale = max(min_scale, scale * step)
        w, h = max(1, round(width * scale)), max(1, round(height * scale))
    tokens = image_tokens_for(h, w, min_pixels, max_pixels)
    if tokens + prompt_overhead + 1 > max_model_len:
        raise OCRError("prompt_too_long", f"the request's text takes up to {prompt_overhead} of the model's "
                       f"{max_model_len} context tokens, and the image needs {tokens} even at its smallest; send "
                       "less text (fewer or shorter fields, a shorter message)")
    if tokens + prompt_overhead + max_tokens > max_model_len:
        max_tokens = max_model_len - prompt_overhead - tokens
    return ImagePlan(width=w, height=h, scale=w / width if scale < 1 else 1.0, image_tokens=tokens, max_tokens=max_tokens)


def plan_for_embedded(width: int, height: int, *, max_side: int) -> ImagePlan:
    """The embedded engine has no token budget; cap the longest side to bound transfer and memory."""
    longest = max(width, height)
    if longest <= max_side:
        return ImagePlan(width, height, 1.0, 0, 0)
    scale = max_side / longest
    w, h = max(1, round(width * scale)), max(1, round(height * scale))
    return ImagePlan(w, h, w / width, 0, 0)
