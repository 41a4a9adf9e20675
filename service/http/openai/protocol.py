"""Request models of the OpenAI-compatible endpoints (the official `openai` client's bodies): strict types, counts
bounded before validation pays for them item by item (`chat_shape`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.errors import OCRError
from service.schema import integral_float


# --- request models -------------------------------------------------------------------------------------------------

MAX_MESSAGES = 16  # one user turn, plus system/developer messages
MAX_CONTENT_PARTS = 16  # per message: the image and text parts
MAX_MODEL_NAME_CHARS = 128  # the longest adapter name (`adapter` of /v1/ocr)


class _OpenAIModel(BaseModel):
    # OpenAI clients send optional fields this service has no use for (n=1, user, seed, ...): ignore them. Strict:
    # a JSON string is not a number or a boolean (the official client sends real JSON types).
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_OpenAIModel):
    url: str = Field(description="`data:image/...;base64,...` (remote URLs are not fetched).")
    detail: str | None = Field(None, description="Ignored (the image budget decides the resolution).")


class ContentPart(_OpenAIModel):
    type: Literal["text", "image_url", "input_text"] = Field(description="`text` or `image_url`.")
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    # the part count bounds the list only (a string's length is the text limit's: prompt_too_long)
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None


class JSONSchemaFormat(_OpenAIModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_OpenAIModel):
    include_usage: bool = False


class _SamplingFields(_OpenAIModel):
    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS,
                              description="Base model name or LoRA adapter name (see GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Output token limit (capped by the image budget).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, description="Ignored: decoding is greedy.")
    top_p: float | None = Field(None, description="Ignored: decoding is greedy.")
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM extension; default from settings.")
    min_tokens: int = Field(0, ge=0, description="vLLM extension (benchmarks): admin keys only.")
    ignore_eos: bool = Field(False, description="vLLM extension (benchmarks): admin keys only.")

    _integers = field_validator("max_tokens", "min_tokens", mode="before")(integral_float)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only the sampled token is returned.")
    response_format: ResponseFormat | None = Field(None, description="`json_schema` → guided JSON decoding.")

    _chat_integers = field_validator("max_completion_tokens", "top_logprobs", mode="before")(integral_float)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] = Field("", description="The instruction (user text; no special tokens).")
    image: str = Field(description="The image as base64 or a data URL (extension; pass with `extra_body`).")
    logprobs: int | None = Field(None, ge=0, le=5, description="Return the sampled tokens' logprobs.")
    echo: bool = Field(False, description="Not supported (must be false).")

    _completion_integers = field_validator("logprobs", mode="before")(integral_float)


# --- bounds checked before validation ------------------------------------------------------------------------------------------------------

def chat_shape(payload: dict[str, Any]) -> None:
    """Message and content-part counts, checked on the parsed body before validation, whose cost grows with them."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > MAX_MESSAGES:
        raise OCRError("validation_error", f"messages: at most {MAX_MESSAGES} messages")
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
            raise OCRError("validation_error", f"messages.{index}.content: at most {MAX_CONTENT_PARTS} parts")


# --- response models (the OpenAPI document's; the router builds the same shapes) ---------------------------------------

class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = Field(description="Always empty: only the sampled token is returned.")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    """`POST /v1/chat/completions` without `stream`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a chat stream (then `data: [DONE]`); with `stream_options.include_usage` a last chunk has
    no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """`POST /v1/completions` (and each `data:` event of its stream, with `finish_reason` null until the last)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
