"""The engine seam: what the ingress asks of an OCR engine, and what it gets back.

Engines (embedded rapidocr, vLLM HunyuanOCR, the test mock) implement `Engine`. Everything above this seam (API,
admission, parsing) is engine-agnostic and testable on CPU with the mock. Requests and results are plain pydantic
models so they cross Ray process boundaries unchanged.
"""

from __future__ import annotations

from typing import AsyncIterator, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, model_validator

ImageTransport = Literal["png", "pixels"]


class EngineRequest(BaseModel):
    """One page for one task, already admitted and resized to the engine's image budget: exactly one of
    `image_png` and `image_rgb` holds it (`EngineInfo.image_transports` says which an engine takes). A PNG's pixels
    may not have been decoded yet (an upload passed on as it is): engines decode it through `pil_image`."""

    request_id: str = Field(description="Opaque id for logs and aborts (no document content).")
    task: str = Field(description="Task name from service.tasks.")
    image_png: bytes | None = Field(None, description="The page as a PNG file, exactly what the model sees.")
    image_rgb: bytes | None = Field(
        None, description="The page as 8-bit RGB pixels, row after row (height × width × 3 bytes), exactly what the "
        "model sees: no encode in the ingress, no decode in the engine.")
    width: int = Field(gt=0, description="Width of the page in pixels.")
    height: int = Field(gt=0, description="Height of the page in pixels.")
    prompt: str | None = Field(None, description="User text of the chat turn (VLM engines); no special tokens.")
    max_tokens: int = Field(1024, ge=1, description="Output token limit.")
    min_tokens: int = Field(0, ge=0, description="Minimum output tokens (benchmarks fix output lengths).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks only).")
    adapter: str | None = Field(None, description="LoRA adapter name, None = base model.")
    logprobs: bool = Field(True, description="Return the sampled tokens' logprobs (confidence).")
    guided_json: dict | None = Field(None, description="JSON Schema for guided decoding (extraction retry).")
    repetition_penalty: float = Field(1.0, description="Sampling repetition penalty.")

    @model_validator(mode="after")
    def _one_image(self) -> "EngineRequest":
        if (self.image_png is None) == (self.image_rgb is None):
            raise ValueError("exactly one of image_png and image_rgb must be set")
        if self.image_rgb is not None and len(self.image_rgb) != self.width * self.height * 3:
            raise ValueError(f"image_rgb holds {len(self.image_rgb)} bytes, not {self.width}x{self.height}x3")
        return self

    def rgb_array(self):
        """The page as a (height, width, 3) uint8 numpy array (decoded from PNG when it came as one)."""
        import numpy as np

        if self.image_rgb is not None:
            # a writable copy: torch.from_numpy, which HF image processors call, warns on read-only buffers
            return np.frombuffer(self.image_rgb, dtype=np.uint8).reshape(self.height, self.width, 3).copy()
        return np.array(self.pil_image())  # one copy, writable

    def pil_image(self):
        """The page as an RGB PIL image. A PNG whose pixel stream does not decode raises OCRError `invalid_image`:
        the ingress checks a bare PNG's chunks and header but may leave its pixels to this decode
        (service.imaging), so every engine that takes PNG pages decodes them through here."""
        from PIL import Image

        from service.imaging import decode_png_pixels

        if self.image_rgb is not None:
            return Image.frombytes("RGB", (self.width, self.height), self.image_rgb)
        return decode_png_pixels(self.image_png, self.width, self.height)


class EngineLine(BaseModel):
    """A recognised line from an engine that detects lines itself (embedded engine); pixels of the page sent."""

    text: str
    polygon: list[list[float]] = Field(description="4 points [[x,y],...] clockwise from top-left.")
    confidence: float | None = None


class TokenLogprob(BaseModel):
    token: str = Field(description="Decoded text of the sampled token.")
    logprob: float = Field(description="Natural-log probability of the sampled token.")


class EngineResult(BaseModel):
    text: str = Field(description="Raw model output text (VLM) or the lines joined by newlines (embedded).")
    lines: list[EngineLine] | None = Field(None, description="Structured lines (engines that detect lines).")
    tokens: list[TokenLogprob] | None = Field(None, description="Sampled tokens with logprobs, in order.")
    finish_reason: str = Field("stop", description="stop | length | repetition | abort")
    prompt_tokens: int = 0
    image_tokens: int = 0
    output_tokens: int = 0
    engine_ms: float = 0.0
    preprocess_ms: float | None = Field(None, description="Image decode + model preprocessing, inside engine_ms.")
    first_token_ms: float | None = Field(None, description="Engine start to first output, inside engine_ms.")
    generate_ms: float | None = Field(None, description="First to last output token as the vLLM engine core timed "
                                      "them (vLLM's own decode time), inside engine_ms.")
    delivery_ms: float | None = Field(None, description="From the engine core's last token to this engine seeing "
                                      "that output: what the frontend (detokenizing, logprobs, the per-request "
                                      "queue) lags behind the GPU work, inside engine_ms.")
    rendered_prompt: str | None = Field(None, description="Full prompt as sent to the model (VLM engines; debug).")


class EngineDelta(BaseModel):
    """A streamed piece of output; the last delta carries `final`."""

    text: str = ""
    tokens: list[TokenLogprob] | None = None
    token_count: int = Field(0, ge=0, description="Output tokens generated since the previous delta (0 where the "
                             "engine does not count them); the count when `tokens` is None.")
    final: EngineResult | None = None


class ImageProcessorInfo(BaseModel):
    """The HF image processor an engine runs on every page before the model. It resizes each page to sides in
    multiples of `factor` with an area in [min_pixels, max_pixels] (`smart_resize`); a page already at that size
    skips the resize, so the ingress can do it (settings.engine.presize)."""

    backend: Literal["pil", "torchvision"] = Field(description="Which implementation resizes (its kernel).")
    factor: int = Field(gt=0, description="Sides become multiples of this: patch size × spatial merge.")
    min_pixels: int = Field(gt=0, description="Smaller pages are upscaled to this area.")
    max_pixels: int = Field(gt=0, description="Larger pages are downscaled to this area.")


class EngineInfo(BaseModel):
    name: str = Field(description="Engine kind: embedded | vllm | mock.")
    model: str = Field(description="Served model name.")
    supported_tasks: list[str]
    max_model_len: int | None = None
    adapters: list[str] = Field(default_factory=list)
    adapters_supported: bool = Field(
        False, description="The engine serves LoRA adapters (vLLM with enable_lora; the web UI hides its adapter "
        "field otherwise).")
    image_transports: list[ImageTransport] = Field(
        default_factory=lambda: ["png"], description="Forms of `EngineRequest` image the engine takes.")
    image_processor: ImageProcessorInfo | None = Field(
        None, description="The image processor the engine runs on each page, where it has one (vLLM).")
    follows_instructions: bool = Field(
        True, description="The engine does what a free instruction asks (a VLM); False: it reads the text whatever "
        "it is asked (the embedded engine), so the OpenAI endpoints refuse other instructions.")
    prompt_template_tokens: int | None = Field(
        None, ge=0, description="Prompt tokens besides the image's and the user text's (the chat template), as the "
        "engine measured them; the ingress budgets each page's context with it. None: not measured.")


@runtime_checkable
class Engine(Protocol):
    """What an engine replica holds. All methods are async and safe to call concurrently."""

    async def start(self) -> None:
        """Load models; raise if the engine cannot serve."""

    async def generate(self, request: EngineRequest) -> EngineResult:
        """Run one request to completion."""

    def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        """Run one request, yielding output as it is produced; the last delta has `final` set."""

    async def check_health(self) -> None:
        """Raise if the engine cannot serve (a tiny real inference, or a dead-engine check)."""

    async def info(self) -> EngineInfo:
        """Static facts for /v1/models and task validation."""

    async def list_adapters(self) -> list[str]:
        """LoRA adapters this replica can serve (loaded or loadable)."""

    async def load_adapter(self, name: str, path: str | None = None) -> None:
        """Make an adapter available (raise OCRError `unknown_adapter` when it does not exist)."""

    async def unload_adapter(self, name: str) -> None:
        """Free an adapter slot."""

    async def shutdown(self) -> None:
        """Release resources."""
