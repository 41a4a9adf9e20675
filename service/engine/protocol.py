"""The engine seam: what the ingress asks of an OCR engine, and what it gets back.

Engines (embedded rapidocr, vLLM HunyuanOCR, the test mock) implement `Engine`. Everything above this seam (API,
admission, parsing) is engine-agnostic and testable on CPU with the mock. Requests and results are plain pydantic
models so they cross Ray process boundaries unchanged.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from pydantic import BaseModel, Field


class EngineRequest(BaseModel):
    """One page for one task, already admitted, decoded, re-encoded and resized to the engine's image budget."""

    request_id: str = Field(description="Opaque id for logs and aborts (no document content).")
    task: str = Field(description="Task name from service.tasks.")
    image_png: bytes = Field(description="The page as PNG bytes, exactly what the model sees.")
    width: int = Field(description="Width of `image_png` in pixels.")
    height: int = Field(description="Height of `image_png` in pixels.")
    prompt: str | None = Field(None, description="User text of the chat turn (VLM engines); no special tokens.")
    max_tokens: int = Field(1024, ge=1, description="Output token limit.")
    min_tokens: int = Field(0, ge=0, description="Minimum output tokens (benchmarks fix output lengths).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks only).")
    adapter: str | None = Field(None, description="LoRA adapter name, None = base model.")
    logprobs: bool = Field(True, description="Return the sampled tokens' logprobs (confidence).")
    guided_json: dict | None = Field(None, description="JSON Schema for guided decoding (extraction retry).")
    repetition_penalty: float = Field(1.0, description="Sampling repetition penalty.")


class EngineLine(BaseModel):
    """A recognised line from an engine that detects lines itself (embedded engine); pixels of `image_png`."""

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
    rendered_prompt: str | None = Field(None, description="Full prompt as sent to the model (VLM engines; debug).")


class EngineDelta(BaseModel):
    """A streamed piece of output; the last delta carries `final`."""

    text: str = ""
    tokens: list[TokenLogprob] | None = None
    final: EngineResult | None = None


class EngineInfo(BaseModel):
    name: str = Field(description="Engine kind: embedded | vllm | mock.")
    model: str = Field(description="Served model name.")
    supported_tasks: list[str]
    max_model_len: int | None = None
    adapters: list[str] = Field(default_factory=list)


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
