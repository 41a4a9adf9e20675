"""Request and response models of the public OCR API (`POST /v1/ocr`). The OpenAPI document is generated from them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


def integral_float(value: Any) -> Any:
    """For the integer fields of JSON bodies (a `before` validator): validated strictly (a string or a boolean is no
    number), `10.0` is 10 — JSON has one number type, and JSON Schema's `integer` (the OpenAPI document's) takes
    it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class OCRRequest(BaseModel):
    """JSON body of `POST /v1/ocr` (multipart uploads carry the same fields as form fields plus `file`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    image: str | None = Field(
        None, description="The image (or single-page PDF) as base64 or a `data:` URL. Multipart uploads use `file`."
    )
    task: str = Field("spotting", description="spotting | text | document | table | formula | chart | extract | "
                      "translate | subtitles | layout")
    language: str | None = Field(None, max_length=64, description="Optional language hint, e.g. `en`, `zh`.")
    fields: list[str] | None = Field(None, description="Field names for `extract`.")
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="JSON Schema for `extract` (its properties name the fields)."
    )
    target_language: str | None = Field(None, min_length=1, max_length=64, description="Target language for `translate`.")
    adapter: str | None = Field(None, max_length=128, description="LoRA adapter name (vLLM engine).")
    max_tokens: int | None = Field(None, ge=1, description="Output token limit (capped by the image budget).")
    stream: bool = Field(False, description="Send Server-Sent Events: partial output, then the final result.")
    confidence: bool = Field(
        True, description="Compute confidences from the sampled tokens' logprobs. `false`: the VLM engine is not "
        "asked for logprobs, which saves GPU time (docs/design/engine-settings.md), and the confidences that come from them "
        "are null (the embedded engine's own scores, per line and for the document, cost nothing and stay)."
    )
    include_raw: bool = Field(
        False, description="Add `raw` to the response: the model's raw output, its token logprobs and the rendered "
        "prompt (replay with `ocr-serve parse --raw-json`)."
    )

    _integers = field_validator("max_tokens", mode="before")(integral_float)


class Line(BaseModel):
    text: str
    box: list[int] = Field(description="[x1, y1, x2, y2] in pixels of the uploaded image.")
    polygon: list[list[int]] = Field(description="4 points [[x, y], ...] clockwise from top-left, pixels.")
    confidence: float | None = Field(None, description="0-1; see docs/API.md for the formula.")
    category: str | None = Field(None, description="Layout category (task `layout`), e.g. `title`, `table`.")


class FieldValue(BaseModel):
    value: Any = Field(None, description="The extracted value (coerced to the schema's simple types).")
    confidence: float | None = Field(None, description="0-1: geometric-mean probability of the value's tokens.")
    valid: bool = Field(True, description="False when the value is missing or fails the schema.")


class RawToken(BaseModel):
    token: str = Field(description="Decoded text of the sampled token.")
    logprob: float = Field(description="Natural-log probability of the sampled token.")


class RawOutput(BaseModel):
    """What the model produced, for debugging and replay (`include_raw: true`)."""

    text: str = Field(description="The model's output text, unparsed.")
    tokens: list[RawToken] | None = Field(None, description="Sampled tokens with logprobs, in order.")
    rendered_prompt: str | None = Field(None, description="The full prompt as the engine sent it to the model.")


class ImageInfo(BaseModel):
    width: int = Field(description="Width of the uploaded image (after EXIF orientation).")
    height: int
    engine_width: int | None = Field(None, description="Width of the image the model saw.")
    engine_height: int | None = None
    scale: float = Field(1.0, description="engine pixels per uploaded pixel.")


class Usage(BaseModel):
    prompt_tokens: int = 0
    image_tokens: int = 0
    output_tokens: int = 0
    pages: int = 1


class OCRResponse(BaseModel):
    id: str
    model: str
    task: str
    text: str = Field(description="Plain text (lines joined) or the task's main output (markdown, HTML, LaTeX, JSON).")
    lines: list[Line] = Field(default_factory=list)
    fields: dict[str, FieldValue] | None = Field(None, description="Extraction results (task `extract`).")
    errors: list[str] | None = Field(None, description="Extraction validation errors.")
    confidence: float | None = Field(None, description="Document confidence (0-1).")
    image: ImageInfo
    usage: Usage
    timings_ms: dict[str, float]
    finish_reason: str = "stop"
    warnings: list[str] = Field(default_factory=list)
    adapter: str | None = None
    raw: RawOutput | None = Field(None, description="Raw model output (only with `include_raw: true`).")

