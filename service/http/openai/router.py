"""OpenAI-compatible endpoints on the ingress: `POST /v1/chat/completions` and `POST /v1/completions` (SSE streaming
for both; `GET /v1/models` lives in health.py). The official `openai` Python client works against them unchanged.

- chat: one user turn with exactly one image as an `image_url` **data URL** (no remote fetches) and optional text
  (the instruction; empty = the `text` task's prompt). `model` = the base model name or a LoRA adapter's name.
- completions (the seed's flow): `prompt` = the instruction, the image as base64 (or a data URL) in the extra body
  field `image` (`client.completions.create(..., extra_body={"image": b64})`).

Same order as `/v1/ocr`: authenticate → validate → one token → image header and estimated cost → decode →
budget/resize → real cost → engine → respond. The body is parsed with its work bounded first and its types checked
strictly (service/http/bodies.py); the user text is refused above `max_text_field_chars` (400 `prompt_too_long`,
before any other work on it) and sanitised (no `<｜…｜>` placeholders) on the admission pool, with the image's
header; the engine builds the real prompt with the model's chat template. Decoding is greedy (HunyuanOCR's recipe):
`temperature`/`top_p` are accepted and ignored. vLLM's benchmark extensions `ignore_eos` and `min_tokens` make a
request generate up to its token limit whatever the model says: admin keys only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.admission.auth import Principal
from service.admission.prompts import sanitize_user_text
from service.admission.schemas import check_schema
from service.engine.protocol import EngineInfo, EngineRequest, EngineResult, TokenLogprob
from service.errors import OCRError, openapi_error_responses
from service.http.bodies import read_json_model
from service.http.deps import app_context, principal
from service.http.openai.protocol import (ChatCompletionRequest, CompletionRequest, ContentPart, ResponseFormat,
                                          StreamOptions, _SamplingFields, chat_shape)
from service.http.sse import first_event_then_rest, sse
from service.pipeline.admit import admit_page
from service.pipeline.context import AppContext
from service.pipeline.run import generate
from service.schema import OCRRequest
from service.tasks import HUNYUAN_15_PROMPTS, TASKS

log = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])


# --- admission ------------------------------------------------------------------------------------------------------

def check_prompt_length(text: str, max_chars: int, what: str) -> None:
    """Instructions longer than the limit are refused, not cut: a cut instruction asks something else."""
    if len(text) > max_chars:
        raise OCRError("prompt_too_long", f"{what} has {len(text)} characters; at most {max_chars}", param=what)


def check_extensions(fields: _SamplingFields, principal: Principal) -> None:
    """`ignore_eos`/`min_tokens` run a request to its token limit whatever the model says (benchmarks)."""
    if (fields.ignore_eos or fields.min_tokens) and principal.role != "admin":
        raise OCRError("forbidden", "`ignore_eos` and `min_tokens` (vLLM benchmark extensions) need an API key "
                       "with the admin role", param="ignore_eos" if fields.ignore_eos else "min_tokens")


def chat_inputs(req: ChatCompletionRequest, max_text_chars: int) -> tuple[str, str]:
    """(image data URL, user text) from the messages: exactly one image, the user's text parts joined (400
    `prompt_too_long` beyond `max_text_chars`, counted before anything else looks at the text)."""
    images: list[str] = []
    texts: list[str] = []
    text_chars = 0
    for message in req.messages:
        if message.role == "assistant":
            raise OCRError("invalid_request", "only one user turn is supported (no assistant messages)",
                           param="messages")
        parts = [ContentPart(type="text", text=message.content)] if isinstance(message.content, str) else \
            (message.content or [])
        for part in parts:
            if part.type == "image_url":
                if part.image_url is None:
                    raise OCRError("invalid_request", "an image_url part needs `image_url.url`", param="messages")
                images.append(part.image_url.url)
            elif part.text and message.role == "user":
                text_chars += len(part.text) + (1 if texts else 0)  # joined with newlines
                if text_chars > max_text_chars:
                    raise OCRError("prompt_too_long", f"the user messages' text has more than {max_text_chars} "
                                   "characters", param="messages")
                texts.append(part.text)
    if not images:
        raise OCRError("empty_image", "send the image as an `image_url` content part (data URL)",
                       param="messages")
    if len(images) > 1:
        raise OCRError("invalid_request", "exactly one image per request", param="messages")
    if not images[0].strip().lower().startswith("data:"):
        raise OCRError("invalid_request", "image_url must be a `data:` URL (remote images are not fetched)",
                       param="messages")
    return images[0], "\n".join(texts)


async def guided_json_of(ctx: AppContext, response_format: ResponseFormat | None) -> dict | None:
    """The JSON Schema that guided decoding enforces, admitted like an extraction `schema` (size, depth, local
    references only, RE2 patterns; off the event loop) before the engine's grammar compiler sees it."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise OCRError("invalid_schema", "response_format.json_schema.schema is required",
                       param="response_format")
    schema = response_format.json_schema.schema_
    await asyncio.to_thread(check_schema, schema, ctx.settings, where="response_format.json_schema.schema")
    return schema


async def resolve_model(ctx: AppContext, caller: Principal, model: str | None, info: EngineInfo) -> str | None:
    """The adapter `model` names (None: the base model). A name that is neither the base model nor an adapter the
    engine serves is 404 `model_not_found`, listing what the key may use (what `GET /v1/models` lists); an adapter the
    key may not use stays 403 `forbidden` (admission)."""
    if not model or model == info.model:
        return None
    adapters = await ctx.engine.list_adapters()
    if model not in adapters:
        raise model_not_found(model, info.model, [name for name in adapters if caller.may_use_adapter(name)])
    return model


def model_not_found(model: str, base: str, adapters: list[str]) -> OCRError:
    return OCRError("model_not_found", f"model {model!r} is not served; available: {', '.join([base, *adapters])}",
                    param="model")


# Instructions that ask for exactly what an engine that only reads text does: the text task's own prompts
TEXT_INSTRUCTIONS = frozenset(
    " ".join(prompt.casefold().split()).rstrip(".。 ")
    for prompt in (TASKS["text"].prompt, HUNYUAN_15_PROMPTS[TASKS["text"].hunyuan_task]))


def check_instruction(info: EngineInfo, user_text: str, guided_json: dict | None, param: str) -> None:
    """An engine that reads text whatever it is asked (the embedded one) must not answer an instruction with plain
    OCR text as if it had followed it: any instruction but none or the text task's own prompt is 400
    `unsupported_task`, as `/v1/ocr` answers a task the engine cannot do; so is a JSON response format."""
    if info.follows_instructions:
        return
    if guided_json is not None:
        raise OCRError("unsupported_task", f"the {info.name} engine reads text only and cannot write JSON "
                       "(`response_format`); run the vllm engine", param="response_format")
    normalised = " ".join(user_text.casefold().split()).rstrip(".。 ")
    if normalised and normalised not in TEXT_INSTRUCTIONS:
        raise OCRError("unsupported_task", f"the {info.name} engine reads the text in the image and cannot follow "
                       f"other instructions; send no instruction or {TASKS['text'].prompt!r}, or run the vllm engine",
                       param=param)


async def admit_openai_request(ctx: AppContext, caller: Principal, *, image: str, user_text: str,
                               model: str | None, max_tokens: int | None, fields: _SamplingFields,
                               logprobs: bool, guided_json: dict | None, id_prefix: str, instruction_param: str
                               ) -> tuple[EngineRequest, dict[str, str], str]:
    """One OpenAI-style request through the pipeline's admission as a `text` task (`model` = the base model or an
    adapter): returns (engine request, rate-limit headers, model name). Nothing is paid before the model and the
    instruction are known to be served."""
    s = ctx.settings
    info = await ctx.get_engine_info()
    adapter = await resolve_model(ctx, caller, model, info)
    check_instruction(info, user_text, guided_json, instruction_param)
    req = OCRRequest.model_validate({"task": "text", "adapter": adapter, "max_tokens": max_tokens})

    def prompt() -> str:  # on the admission pool, paid for
        return sanitize_user_text(user_text, s.limits.max_text_field_chars) or TASKS["text"].prompt

    page, headers = await admit_page(ctx, caller, req, image, id_prefix + uuid.uuid4().hex[:24], prompt_for=prompt,
                                     allow_pdf=False)
    engine_request = page.engine_request.model_copy(update={
        "logprobs": logprobs,
        "guided_json": guided_json,
        "repetition_penalty": fields.repetition_penalty or s.parsing.repetition_penalty,
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


async def _stream(ctx: AppContext, engine_request: EngineRequest, frame: Callable, final_frame: Callable,
                  include_usage: bool) -> AsyncIterator[str]:
    """OpenAI SSE: one chunk per engine delta, a last chunk with finish_reason, optional usage, `[DONE]`. A failure
    before the first chunk is raised, not sent (`first_event_then_rest` turns it into the response)."""
    sent = False
    try:
        final = None
        with ctx.metrics.waiting_for_engine():
            async for delta in ctx.engine.stream(engine_request):
                if delta.final is not None:
                    final = delta.final
                elif delta.text or delta.tokens:
                    sent = True
                    yield sse(frame(delta.text, delta.tokens))
        if final is None:
            raise RuntimeError("engine stream ended without a final result")
        sent = True
        yield sse(final_frame(final))
        if include_usage:
            yield sse({**final_frame(final), "choices": [], "usage": usage(final)})
    except OCRError as exc:
        if not sent:
            raise
        yield sse(exc.body())
    except Exception as exc:
        if not sent:
            raise
        log.error("openai stream failed: %s", type(exc).__name__)
        yield sse(OCRError("internal_error", "the engine failed while streaming").body())
    yield sse("[DONE]")


async def _streaming_response(ctx: AppContext, engine_request: EngineRequest, frame: Callable, final_frame: Callable,
                              stream_options: StreamOptions | None, headers: dict[str, str]) -> StreamingResponse:
    """The SSE response, once the first chunk is there: a failure before it is an ordinary error response."""
    include_usage = bool(stream_options and stream_options.include_usage)
    try:
        events = await first_event_then_rest(_stream(ctx, engine_request, frame, final_frame, include_usage),
                                             ctx.settings.server.request_timeout_s)
    except OCRError as exc:
        raise await as_model_error(ctx, exc, engine_request) from None
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _generate(ctx: AppContext, engine_request: EngineRequest) -> EngineResult:
    try:
        return await generate(ctx, engine_request)
    except OCRError as exc:
        raise await as_model_error(ctx, exc, engine_request) from None


async def as_model_error(ctx: AppContext, exc: OCRError, engine_request: EngineRequest) -> OCRError:
    """An adapter that went away between admission and the engine (an admin unload, a replica that lists other
    adapters) is the OpenAI endpoints' `model_not_found` too."""
    if exc.code != "unknown_adapter" or engine_request.adapter is None:
        return exc
    info = await ctx.get_engine_info()
    return model_not_found(engine_request.adapter, info.model, [])


# --- routes ---------------------------------------------------------------------------------------------------------

@router.post("/v1/chat/completions", summary="OpenAI chat completions: one image (data URL) + instruction",
             responses=openapi_error_responses())
async def chat_completions(request: Request, ctx: AppContext = Depends(app_context),
                           caller: Principal = Depends(principal)):
    req = await read_json_model(await request.body(), ChatCompletionRequest, ctx.settings.limits.max_json_items, chat_shape)
    check_extensions(req, caller)
    image, text = chat_inputs(req, ctx.settings.limits.max_text_field_chars)
    guided = await guided_json_of(ctx, req.response_format)
    engine_request, headers, model = await admit_openai_request(
        ctx, caller, image=image, user_text=text, model=req.model,
        max_tokens=req.max_completion_tokens or req.max_tokens, fields=req, logprobs=req.logprobs,
        guided_json=guided, id_prefix="chatcmpl-", instruction_param="messages")
    base = {"id": engine_request.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model}
    if req.stream:
        chunk = {**base, "object": "chat.completion.chunk"}
        first = [True]

        def frame(text: str, tokens: list[TokenLogprob] | None) -> dict[str, Any]:
            delta = {"content": text}
            if first[0]:
                delta, first[0] = {"role": "assistant", "content": text}, False
            return {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                          "logprobs": chat_logprobs(tokens) if req.logprobs else None}]}

        def final_frame(result: EngineResult) -> dict[str, Any]:
            return {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason(result),
                                          "logprobs": None}]}

        return await _streaming_response(ctx, engine_request, frame, final_frame, req.stream_options, headers)
    result = await _generate(ctx, engine_request)
    body = {**base, "choices": [{
        "index": 0, "message": {"role": "assistant", "content": result.text},
        "logprobs": chat_logprobs(result.tokens) if req.logprobs else None,
        "finish_reason": finish_reason(result),
    }], "usage": usage(result)}
    return JSONResponse(body, headers=headers)


@router.post("/v1/completions", summary="OpenAI completions: instruction as `prompt`, base64 `image` field",
             responses=openapi_error_responses())
async def completions(request: Request, ctx: AppContext = Depends(app_context),
                      caller: Principal = Depends(principal)):
    req = await read_json_model(await request.body(), CompletionRequest, ctx.settings.limits.max_json_items)
    check_extensions(req, caller)
    if req.echo:
        raise OCRError("invalid_request", "echo is not supported", param="echo")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise OCRError("invalid_request", "exactly one prompt per request", param="prompt")
        prompt = prompt[0]
    check_prompt_length(prompt, ctx.settings.limits.max_text_field_chars, "prompt")
    want_logprobs = req.logprobs is not None
    engine_request, headers, model = await admit_openai_request(
        ctx, caller, image=req.image, user_text=prompt, model=req.model, max_tokens=req.max_tokens,
        fields=req, logprobs=want_logprobs, guided_json=None, id_prefix="cmpl-", instruction_param="prompt")
    base = {"id": engine_request.request_id, "object": "text_completion", "created": int(time.time()),
            "model": model}
    if req.stream:
        sent = [0]

        def frame(text: str, tokens: list[TokenLogprob] | None) -> dict[str, Any]:
            logprobs = completion_logprobs(tokens, sent[0]) if want_logprobs else None
            sent[0] += len(text)
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}]}

        def final_frame(result: EngineResult) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                                         "finish_reason": finish_reason(result)}]}

        return await _streaming_response(ctx, engine_request, frame, final_frame, req.stream_options, headers)
    result = await _generate(ctx, engine_request)
    body = {**base, "choices": [{
        "index": 0, "text": result.text,
        "logprobs": completion_logprobs(result.tokens) if want_logprobs else None,
        "finish_reason": finish_reason(result),
    }], "usage": usage(result)}
    return JSONResponse(body, headers=headers)
