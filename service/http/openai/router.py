"""OpenAI-compatible endpoints on the ingress: `POST /v1/chat/completions` and `POST /v1/completions` (SSE streaming
for both; `GET /v1/models` lives in health.py). The official `openai` Python client works against them unchanged.

- chat: one user turn with exactly one image as an `image_url` **data URL** (no remote fetches) and optional text
  (the instruction; empty = the `text` task's prompt). `model` = the base model name or a LoRA adapter's name.
- completions (the seed's flow): `prompt` = the instruction, the image as base64 (or a data URL) in the extra body
  field `image` (`client.completions.create(..., extra_body={"image": b64})`).

Same order as `/v1/ocr`: authenticate → validate → one token → image header and estimated cost → decode →
budget/resize → real cost → engine → respond. The body is parsed with its work bounded first and its types checked
strictly (service/http/json_body.py); the user text is refused above `max_text_field_chars` (400 `prompt_too_long`,
before any other work on it) and sanitised (no `<｜…｜>` placeholders) on the admission pool, with the image's
header; the engine builds the real prompt with the model's chat template. Decoding is greedy (HunyuanOCR's recipe):
`temperature`/`top_p` are accepted and ignored. vLLM's benchmark extensions `ignore_eos` and `min_tokens` make a
request generate up to its token limit whatever the model says: admin keys only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from service.admission.auth import Principal
from service.imaging import decode_base64_image
from service.admission.prompts import sanitize_user_text
from service.admission.schemas import check_schema
from service.pipeline.context import AppContext
from service.http.json_body import read_json_model
from service.http.routes.ocr import admit_upload, first_event_then_rest
from service.schema import OCRRequest
from service.engine.protocol import EngineRequest, EngineResult, TokenLogprob
from service.errors import OCRError, openapi_error_responses
from service.tasks import TASKS

log = logging.getLogger(__name__)


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
    content: str | list[ContentPart] | None = Field(None, max_length=MAX_CONTENT_PARTS)


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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only the sampled token is returned.")
    response_format: ResponseFormat | None = Field(None, description="`json_schema` → guided JSON decoding.")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] = Field("", description="The instruction (user text; no special tokens).")
    image: str = Field(description="The image as base64 or a data URL (extension; pass with `extra_body`).")
    logprobs: int | None = Field(None, ge=0, le=5, description="Return the sampled tokens' logprobs.")
    echo: bool = Field(False, description="Not supported (must be false).")


# --- admission ------------------------------------------------------------------------------------------------------

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


async def parse_body(request: Request, ctx: AppContext, model: type[_OpenAIModel],
                     shape: Callable[[dict[str, Any]], None] | None = None) -> Any:
    return await read_json_model(await request.body(), model, ctx.settings.max_json_items, shape)


def check_prompt_length(text: str, max_chars: int, what: str) -> None:
    """Instructions longer than the limit are refused, not cut: a cut instruction asks something else."""
    if len(text) > max_chars:
        raise OCRError("prompt_too_long", f"{what} has {len(text)} characters; at most {max_chars}")


def check_extensions(fields: _SamplingFields, principal: Principal) -> None:
    """`ignore_eos`/`min_tokens` run a request to its token limit whatever the model says (benchmarks)."""
    if (fields.ignore_eos or fields.min_tokens) and principal.role != "admin":
        raise OCRError("forbidden", "`ignore_eos` and `min_tokens` (vLLM benchmark extensions) need an API key "
                       "with the admin role")


def chat_inputs(req: ChatCompletionRequest, max_text_chars: int) -> tuple[str, str]:
    """(image data URL, user text) from the messages: exactly one image, the user's text parts joined (400
    `prompt_too_long` beyond `max_text_chars`, counted before anything else looks at the text)."""
    images: list[str] = []
    texts: list[str] = []
    text_chars = 0
    for message in req.messages:
        if message.role == "assistant":
            raise OCRError("invalid_request", "only one user turn is supported (no assistant messages)")
        parts = [ContentPart(type="text", text=message.content)] if isinstance(message.content, str) else \
            (message.content or [])
        for part in parts:
            if part.type == "image_url":
                if part.image_url is None:
                    raise OCRError("invalid_request", "an image_url part needs `image_url.url`")
                images.append(part.image_url.url)
            elif part.text and message.role == "user":
                text_chars += len(part.text) + (1 if texts else 0)  # joined with newlines
                if text_chars > max_text_chars:
                    raise OCRError("prompt_too_long", f"the user messages' text has more than {max_text_chars} "
                                   "characters")
                texts.append(part.text)
    if not images:
        raise OCRError("empty_image", "send the image as an `image_url` content part (data URL)")
    if len(images) > 1:
        raise OCRError("invalid_request", "exactly one image per request")
    if not images[0].strip().lower().startswith("data:"):
        raise OCRError("invalid_request", "image_url must be a `data:` URL (remote images are not fetched)")
    return images[0], "\n".join(texts)


async def guided_json_of(ctx: AppContext, response_format: ResponseFormat | None) -> dict | None:
    """The JSON Schema that guided decoding enforces, admitted like an extraction `schema` (size, depth, local
    references only, RE2 patterns; off the event loop) before the engine's grammar compiler sees it."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise OCRError("invalid_schema", "response_format.json_schema.schema is required")
    schema = response_format.json_schema.schema_
    await asyncio.to_thread(check_schema, schema, ctx.settings, where="response_format.json_schema.schema")
    return schema


async def resolve_adapter(ctx: AppContext, principal: Principal, model: str | None) -> str | None:
    """`model` → None for the base model, else the adapter name (which the caller must be allowed to use)."""
    info = await ctx.get_engine_info()
    if not model or model == info.model:
        return None
    if not principal.may_use_adapter(model):
        raise OCRError("forbidden", f"this API key may not use adapter {model!r}")
    return model


async def prepare_openai_request(ctx: AppContext, principal: Principal, *, image: str, user_text: str,
                                 model: str | None, max_tokens: int | None, fields: _SamplingFields,
                                 logprobs: bool, guided_json: dict | None
                                 ) -> tuple[EngineRequest, dict[str, str], str]:
    """Rate-limit, decode and budget one OpenAI-style request; returns (engine request, headers, model name)."""
    s = ctx.settings
    info = await ctx.get_engine_info()
    adapter = await resolve_adapter(ctx, principal, model)
    data = decode_base64_image(image, s.max_body_bytes)
    request_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    ocr_req = OCRRequest.model_validate({"task": "text", "adapter": adapter, "max_tokens": max_tokens})

    def prompt() -> str:  # on the admission pool, paid for
        return sanitize_user_text(user_text, s.max_text_field_chars) or TASKS["text"].prompt

    page, headers = await admit_upload(ctx, principal, ocr_req, data, info, request_id, prompt_for=prompt,
                                       allow_pdf=False)
    engine_request = page.engine_request.model_copy(update={
        "logprobs": logprobs,
        "guided_json": guided_json,
        "repetition_penalty": fields.repetition_penalty or s.repetition_penalty,
        "min_tokens": min(max(page.engine_request.min_tokens, fields.min_tokens), page.engine_request.max_tokens),
        "ignore_eos": page.engine_request.ignore_eos or fields.ignore_eos,
    })
    return engine_request, headers, adapter or info.model


# --- responses ------------------------------------------------------------------------------------------------------

def finish_reason(result: EngineResult) -> str:
    # OpenAI clients know stop/length; a generation cut by the repetition guard stopped on our side
    return "length" if result.finish_reason == "length" else "stop"


def usage(result: EngineResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.output_tokens,
            "total_tokens": result.prompt_tokens + result.output_tokens}


def chat_logprobs(tokens: list[TokenLogprob] | None) -> dict | None:
    if tokens is None:
        return None
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
                         "top_logprobs": []} for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    if tokens is None:
        return None
    offsets, position = [], offset
    for t in tokens:
        offsets.append(position)
        position += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{t.token: t.logprob} for t in tokens], "text_offset": offsets}


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(ctx: AppContext, engine_request: EngineRequest, frame, final_frame,
                  include_usage: bool) -> AsyncIterator[str]:
    """OpenAI SSE: one chunk per engine delta, a last chunk with finish_reason, optional usage, `[DONE]`. A failure
    before the first chunk is raised, not sent (`first_event_then_rest` turns it into the response)."""
    sent = False
    try:
        final = None
        async for delta in ctx.engine.stream(engine_request):
            if delta.final is not None:
                final = delta.final
            elif delta.text or delta.tokens:
                sent = True
                yield _sse(frame(delta.text, delta.tokens))
        if final is None:
            raise RuntimeError("engine stream ended without a final result")
        sent = True
        yield _sse(final_frame(final))
        if include_usage:
            yield _sse({**final_frame(final), "choices": [], "usage": usage(final)})
    except OCRError as exc:
        if not sent:
            raise
        yield _sse(exc.body())
    except Exception as exc:
        if not sent:
            raise
        log.error("openai stream failed: %s", type(exc).__name__)
        yield _sse(OCRError("internal_error", "the engine failed while streaming").body())
    yield "data: [DONE]\n\n"


async def _streaming_response(ctx: AppContext, engine_request: EngineRequest, frame, final_frame,
                              stream_options: StreamOptions | None, headers: dict[str, str]) -> StreamingResponse:
    """The SSE response, once the first chunk is there: a failure before it is an ordinary error response."""
    include_usage = bool(stream_options and stream_options.include_usage)
    events = await first_event_then_rest(_stream(ctx, engine_request, frame, final_frame, include_usage),
                                         ctx.settings.request_timeout_s)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


# --- router ---------------------------------------------------------------------------------------------------------

def make_router(ctx: AppContext) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.post("/v1/chat/completions", summary="OpenAI chat completions: one image (data URL) + instruction",
                 responses=openapi_error_responses())
    async def chat_completions(request: Request):
        principal = ctx.authenticator.authenticate(request.headers)
        req: ChatCompletionRequest = await parse_body(request, ctx, ChatCompletionRequest, chat_shape)
        check_extensions(req, principal)
        image, text = chat_inputs(req, ctx.settings.max_text_field_chars)
        guided = await guided_json_of(ctx, req.response_format)
        engine_request, headers, model = await prepare_openai_request(
            ctx, principal, image=image, user_text=text, model=req.model,
            max_tokens=req.max_completion_tokens or req.max_tokens, fields=req, logprobs=req.logprobs,
            guided_json=guided)
        created = int(time.time())
        base = {"id": engine_request.request_id, "object": "chat.completion", "created": created, "model": model}
        if req.stream:
            chunk = {**base, "object": "chat.completion.chunk"}
            first = [True]

            def frame(text: str, tokens):
                delta = {"content": text}
                if first[0]:
                    delta, first[0] = {"role": "assistant", "content": text}, False
                return {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                              "logprobs": chat_logprobs(tokens) if req.logprobs else None}]}

            def final_frame(result: EngineResult):
                return {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason(result),
                                              "logprobs": None}]}

            return await _streaming_response(ctx, engine_request, frame, final_frame, req.stream_options, headers)
        result = await ctx.engine.generate(engine_request)
        body = {**base, "choices": [{
            "index": 0, "message": {"role": "assistant", "content": result.text},
            "logprobs": chat_logprobs(result.tokens) if req.logprobs else None,
            "finish_reason": finish_reason(result),
        }], "usage": usage(result)}
        return JSONResponse(body, headers=headers)

    @router.post("/v1/completions", summary="OpenAI completions: instruction as `prompt`, base64 `image` field",
                 responses=openapi_error_responses())
    async def completions(request: Request):
        principal = ctx.authenticator.authenticate(request.headers)
        req: CompletionRequest = await parse_body(request, ctx, CompletionRequest)
        check_extensions(req, principal)
        if req.echo:
            raise OCRError("invalid_request", "echo is not supported")
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise OCRError("invalid_request", "exactly one prompt per request")
            prompt = prompt[0]
        check_prompt_length(prompt, ctx.settings.max_text_field_chars, "prompt")
        want_logprobs = req.logprobs is not None
        engine_request, headers, model = await prepare_openai_request(
            ctx, principal, image=req.image, user_text=prompt, model=req.model, max_tokens=req.max_tokens,
            fields=req, logprobs=want_logprobs, guided_json=None)
        engine_request = engine_request.model_copy(update={"request_id": "cmpl-" + uuid.uuid4().hex[:24]})
        base = {"id": engine_request.request_id, "object": "text_completion", "created": int(time.time()),
                "model": model}
        if req.stream:
            sent = [0]

            def frame(text: str, tokens):
                logprobs = completion_logprobs(tokens, sent[0]) if want_logprobs else None
                sent[0] += len(text)
                return {**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                             "finish_reason": None}]}

            def final_frame(result: EngineResult):
                return {**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                                             "finish_reason": finish_reason(result)}]}

            return await _streaming_response(ctx, engine_request, frame, final_frame, req.stream_options, headers)
        result = await ctx.engine.generate(engine_request)
        body = {**base, "choices": [{
            "index": 0, "text": result.text,
            "logprobs": completion_logprobs(result.tokens) if want_logprobs else None,
            "finish_reason": finish_reason(result),
        }], "usage": usage(result)}
        return JSONResponse(body, headers=headers)

    return router
