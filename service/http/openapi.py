"""The OpenAPI document (`GET /openapi.json`, `/docs`): FastAPI's, completed where the routes parse their own bodies.

Routes read their bodies themselves (service/http/bodies.py bounds the parser's work before it starts), so FastAPI
sees no body parameter and documents none. Here every body gets its schema, from the same pydantic models the
routes validate with, and the constraints the routes check after validation are written into the schemas where they
are static (the settings this app runs with: field counts and lengths, message and part counts, one prompt, no
`echo`). What no schema can say (a decodable image, a JSON Schema RE2 can match, the prompt's share of the context)
is in the descriptions and answers with the error table's codes.

Also: the error envelope (`ErrorResponse`) for every error status, also the 422s FastAPI would document with its own
body; the OpenAI response objects and every Server-Sent Events stream (the schema of one event: `event`, `id`,
`data` parsed as JSON); `links` from a job to its status, events and cancel, and from the adapter list to load and
unload; the security schemes (`Authorization: Bearer` and `X-API-Key`), optional in open mode.

Image fields carry the formats `image-base64` (base64 or a base64 `data:` URL of an image or PDF) and
`image-data-url` (a base64 `data:` URL of an image), so that tools can generate real images for them (the
schemathesis hooks in tests/unit/openapi_hooks.py do).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.config import Settings
from service.errors import ERROR_SCHEMA_NAME, error_response_schema
from service.http.deps import principal
from service.http.openai.protocol import (MAX_MESSAGES, ChatCompletion, ChatCompletionChunk,
                                          ChatCompletionRequest, Completion, CompletionRequest)
from service.http.routes.adapters import LoadAdapterBody
from service.jobs.model import JobView, PageResult
from service.schema import OCRRequest, OCRResponse
from service.tasks import TASKS

REF = "#/components/schemas/{model}"
IMAGE_BASE64 = "image-base64"
IMAGE_DATA_URL = "image-data-url"
IMAGE_MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "BMP": "image/bmp",
                     "TIFF": "image/tiff", "GIF": "image/gif"}
# `pages` of a job: numbers and ranges, open at either end ("1-3,5,8-")
PAGES_PATTERN = r"^ *([0-9]+|[0-9]*-[0-9]*) *(, *([0-9]+|[0-9]*-[0-9]*) *)*$"
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer <key>`."},
    "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key", "description": "`X-API-Key: <key>` (one "
               "key per request: both headers with different keys answer 400 `ambiguous_credentials`)."},
}
# request and response models the routes use without FastAPI seeing them
EXTRA_MODELS: tuple[type[BaseModel], ...] = (OCRRequest, ChatCompletionRequest, CompletionRequest, LoadAdapterBody,
                                             ChatCompletion, ChatCompletionChunk, Completion, OCRResponse, JobView,
                                             PageResult)


def openapi_document(app: FastAPI, settings: Settings, *, auth_required: bool) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(model, "validation") for model in EXTRA_MODELS], ref_template=REF)
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    schemas[ERROR_SCHEMA_NAME] = error_response_schema()
    for name in ("HTTPValidationError", "ValidationError"):  # our 422 is the error envelope
        schemas.pop(name, None)
    _tighten_request_schemas(schemas, settings)
    paths = doc["paths"]
    _request_bodies(paths, settings)
    _responses(paths)
    _links(paths)
    doc["components"]["securitySchemes"] = SECURITY_SCHEMES
    secured = {(route.path, method.lower()) for route in app.routes
               if isinstance(route, APIRoute) and _depends_on(route, principal) for method in route.methods}
    for path, item in paths.items():
        for method, operation in item.items():
            if (path, method) in secured:
                operation["security"] = [{"bearer": []}, {"apiKey": []}] + ([] if auth_required else [{}])
            _fix_validation_responses(operation)
    return doc


def _depends_on(route: APIRoute, dependency) -> bool:
    stack = list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        if dep.call is dependency:
            return True
        stack.extend(dep.dependencies)
    return False


# --- request schemas: the route-level checks, written into the models' schemas --------------------------------------

def _tighten_request_schemas(schemas: dict[str, Any], settings: Settings) -> None:
    limits = settings.limits
    ocr = schemas["OCRRequest"]["properties"]
    ocr["task"] = {**ocr["task"], "enum": list(TASKS)}
    ocr["image"] = {"type": "string", "format": IMAGE_BASE64, "minLength": 1,
                    "description": "The image (or single-page PDF) as base64 or a base64 `data:` URL."}
    schemas["OCRRequest"]["required"] = ["image"]
    ocr["fields"]["anyOf"][0].update(maxItems=limits.max_fields, items={"type": "string",
                                                                       "maxLength": limits.max_text_field_chars})
    ocr["schema"]["anyOf"][0] = EXTRACTION_SCHEMA
    schemas["OCRRequest"]["allOf"] = task_options_rules(nullable=True)
    # the OpenAI bodies: one image, user text within max_text_field_chars, one user turn
    message = schemas["ChatMessage"]
    message["properties"]["role"] = {"type": "string", "enum": ["system", "developer", "user"],
                                     "description": "One user turn: assistant messages are refused (400)."}
    for branch in message["properties"]["content"]["anyOf"]:
        if branch.get("type") == "string":
            branch["maxLength"] = limits.max_text_field_chars
    part = schemas["ContentPart"]
    part["properties"]["text"]["anyOf"][0]["maxLength"] = limits.max_text_field_chars
    image_part = {"properties": {"type": {"const": "image_url"}}, "required": ["type"]}
    part["allOf"] = [{"if": image_part, "then": {"required": ["image_url"],
                                                 "properties": {"image_url": {"type": "object"}}}}]
    with_image = {"type": "object", "required": ["content"],
                  "properties": {"content": {"type": "array", "contains": image_part}}}
    image_url = schemas["ImageURL"]["properties"]["url"]
    image_url.update(format=IMAGE_DATA_URL, pattern="^ *[Dd][Aa][Tt][Aa]:")
    chat = schemas["ChatCompletionRequest"]
    # exactly one image: one message has an image part, and no message has two
    chat["properties"]["messages"].update(minItems=1, maxItems=MAX_MESSAGES, contains=with_image, minContains=1,
                                          maxContains=1)
    for branch in message["properties"]["content"]["anyOf"]:
        if branch.get("type") == "array":
            branch.update(contains=image_part, minContains=0, maxContains=1)
    schemas["ResponseFormat"]["allOf"] = [{
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}}]
    chat["description"] = ("Exactly one `image_url` part (a `data:` URL) in the messages; the user messages' text "
                           f"together at most {limits.max_text_field_chars} characters.")
    completion = schemas["CompletionRequest"]["properties"]
    prompt = {"type": "string", "maxLength": limits.max_text_field_chars}
    completion["prompt"] = {"anyOf": [prompt, {"type": "array", "items": prompt, "minItems": 1, "maxItems": 1}],
                            "default": "", "description": completion["prompt"]["description"]
                            + " One prompt per request (a list holds exactly one)."}
    completion["image"].update(format=IMAGE_BASE64, minLength=1)
    completion["echo"] = {"type": "boolean", "const": False, "default": False,
                          "description": "Not supported: only `false`."}


# an extraction schema names its fields in `properties` (400 `invalid_schema` otherwise); what else it may hold is
# checked when it is admitted (size, depth, local `$ref`s, RE2 `pattern`s)
EXTRACTION_SCHEMA = {"type": "object", "required": ["properties"],
                     "properties": {"properties": {"type": "object", "minProperties": 1,
                                                   "additionalProperties": {"type": ["object", "boolean"]}}},
                     "description": "A JSON Schema whose `properties` name the fields (local `$ref`s only, RE2 "
                                    "`pattern`s)."}


def task_options_rules(*, nullable: bool) -> list[dict[str, Any]]:
    """The options that belong to one task (admission's checks, 400 `invalid_request`): `fields`/`schema` only with
    `extract`, which needs one of them; `target_language` only with, and required by, `translate`."""
    def given(name: str) -> dict[str, Any]:
        present: dict[str, Any] = {"required": [name]}
        if nullable:  # a JSON null is the option left out
            present["properties"] = {name: {"not": {"type": "null"}}}
        return present

    def task_is(name: str) -> dict[str, Any]:
        return {"properties": {"task": {"const": name}}, "required": ["task"]}

    # extract needs a field name or a schema with something in it (an empty list or `{}` count as none)
    fields = {"type": "array", "minItems": 1} if nullable else {"type": "string", "pattern": r"[^\s,\[\]\"]"}
    needs = {"anyOf": [{"required": ["fields"], "properties": {"fields": fields}},
                       {"required": ["schema"], "properties": {"schema": {"type": "object"}}}]}
    return [
        {"if": {"anyOf": [given("fields"), given("schema")]}, "then": task_is("extract")},
        {"if": task_is("extract"), "then": needs},
        {"if": given("target_language"), "then": task_is("translate")},
        {"if": task_is("translate"), "then": given("target_language")},
    ]


def _multipart_ocr_schema(settings: Settings, *, job: bool) -> dict[str, Any]:
    limits = settings.limits
    props: dict[str, Any] = {
        "task": {"type": "string", "enum": list(TASKS), "default": "spotting"},
        "language": {"type": "string", "maxLength": 64, "description": "Optional language hint, e.g. `en`."},
        "target_language": {"type": "string", "minLength": 1, "maxLength": 64, "description": "Target language for `translate`."},
        "adapter": {"type": "string", "maxLength": 128, "description": "LoRA adapter name (vLLM engine)."},
        "fields": {"type": "string", "description": f"Field names for `extract` (at most {limits.max_fields}): "
                   "comma-separated or a JSON list."},
        "schema": {**EXTRACTION_SCHEMA, "description": "JSON Schema for `extract`, as a JSON part."},
        "max_tokens": {"type": "integer", "minimum": 1, "description": "Output token limit."},
        "confidence": {"type": "boolean", "default": True},
        "include_raw": {"type": "boolean", "default": False},
    }
    if job:
        props.update({
            # one file part is the same request as an array of one
            "file": {"anyOf": [{"type": "string", "format": "binary"},
                               {"type": "array", "minItems": 1, "maxItems": settings.jobs.max_pages,
                                "items": {"type": "string", "format": "binary"}}],
                     "description": "One PDF, or several images (one page each, in order)."},
            "pages": {"type": "string", "pattern": PAGES_PATTERN, "description": "1-based pages to process, e.g. "
                      "`1-3,5,9-` (default: all); pages past the document's last are refused."},
            "return_page_images": {"type": "boolean", "default": False,
                                   "description": "Include a JPEG preview of each page (UI)."},
            "webhook": {"type": "string", "format": "uri", "description": "http(s) URL that receives the final "
                        "job status (POST, signed when the service has a webhook secret); non-public hosts answer "
                        "`invalid_webhook`."},
        })
    else:
        props.update({
            "file": {"type": "string", "format": "binary", "description": "The image or single-page PDF."},
            "stream": {"type": "boolean", "default": False},
        })
    return {"type": "object", "properties": props, "required": ["file"], "additionalProperties": False,
            "allOf": task_options_rules(nullable=False)}


def _file_encoding(settings: Settings) -> dict[str, Any]:
    types = [IMAGE_MEDIA_TYPES[f] for f in settings.limits.allowed_formats if f in IMAGE_MEDIA_TYPES]
    return {"file": {"contentType": ", ".join([*types, "application/pdf"])},
            "schema": {"contentType": "application/json"}}


def _request_bodies(paths: dict[str, Any], settings: Settings) -> None:
    def ref(name: str) -> dict[str, str]:
        return {"$ref": REF.format(model=name)}

    multipart = "multipart/form-data"
    paths["/v1/ocr"]["post"]["requestBody"] = {"required": True, "content": {
        "application/json": {"schema": ref("OCRRequest")},
        multipart: {"schema": _multipart_ocr_schema(settings, job=False), "encoding": _file_encoding(settings)}}}
    paths["/v1/jobs"]["post"]["requestBody"] = {"required": True, "content": {
        multipart: {"schema": _multipart_ocr_schema(settings, job=True), "encoding": _file_encoding(settings)}}}
    paths["/v1/chat/completions"]["post"]["requestBody"] = {
        "required": True, "content": {"application/json": {"schema": ref("ChatCompletionRequest")}}}
    paths["/v1/completions"]["post"]["requestBody"] = {
        "required": True, "content": {"application/json": {"schema": ref("CompletionRequest")}}}
    paths["/v1/adapters/{name}/load"]["post"]["requestBody"] = {
        "required": False, "content": {"application/json": {"schema": ref("LoadAdapterBody")}}}


# --- responses ------------------------------------------------------------------------------------------------------

def _event_stream(events: list[str] | None, data: dict[str, Any], *, ids: bool = False,
                  done: bool = False) -> dict[str, Any]:
    """A Server-Sent Events stream: `schema` describes each event (OpenAPI 3.2's `itemSchema`; before 3.2 the
    convention tools follow), `data` a JSON text of `data`'s schema."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    event: dict[str, Any] = {"type": "object", "required": ["data"], "properties": {"data": json_data}}
    if events:
        event["required"].append("event")
        event["properties"]["event"] = {"type": "string", "enum": events}
    if done:  # OpenAI's last event
        event["properties"]["data"] = {"anyOf": [json_data, {"type": "string", "const": "[DONE]"}]}
    if ids:
        event["properties"]["id"] = {"type": "string", "pattern": "^[0-9]+$",
                                     "description": "The page index (`page` events): resume with `Last-Event-ID`."}
    return {"schema": event}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _responses(paths: dict[str, Any]) -> None:
    error = _ref(ERROR_SCHEMA_NAME)
    ocr_events = {"anyOf": [{"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
                            {"type": "object", "required": ["index", "line"],
                             "properties": {"index": {"type": "integer"}, "line": _ref("Line")}},
                            _ref("OCRResponse"), error]}
    ok = paths["/v1/ocr"]["post"]["responses"]["200"]
    ok["content"]["text/event-stream"] = _event_stream(["delta", "line", "result", "error"], ocr_events)
    ok["description"] = ("The OCR result (JSON), or with `stream: true` Server-Sent Events: `delta` ({text}) and "
                         "`line` ({index, line}) events, then `result` (the OCR result) or `error`.")
    for path, model, chunk in (("/v1/chat/completions", "ChatCompletion", "ChatCompletionChunk"),
                               ("/v1/completions", "Completion", "Completion")):
        paths[path]["post"]["responses"]["200"] = {
            "description": f"A `{model}` object, or with `stream: true` Server-Sent Events of `{chunk}` objects "
                           "(an error object if the engine fails midway), then `[DONE]`.",
            "content": {"application/json": {"schema": _ref(model)},
                        "text/event-stream": _event_stream(None, {"anyOf": [_ref(chunk), error]}, done=True)}}
    job_events = {"anyOf": [_ref("PageResult"), _ref("JobView"), error]}
    paths["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"] = {
        "description": "One `page` event per page in page order (`id:` the page index), then `done` with the job's "
                       "summary; `error` if the job expires, the key is revoked or the store fails.",
        "content": {"text/event-stream": _event_stream(["page", "done", "error"], job_events, ids=True)}}
    paths["/healthz"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] = {
        "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
    readyz = paths["/readyz"]["get"]["responses"]
    readyz["200"]["content"]["application/json"]["schema"] = {
        "type": "object", "required": ["status", "engine", "model", "check_ms", "in_flight"],
        "properties": {"status": {"const": "ready"}, "engine": {"type": "string"}, "model": {"type": "string"},
                       "check_ms": {"type": "number"}, "in_flight": {"type": "integer"}}}
    readyz["503"]["content"] = {"application/json": {"schema": {
        "type": "object", "required": ["status"],
        "properties": {"status": {"enum": ["draining", "unavailable"]}, "in_flight": {"type": "integer"},
                       "reason": {"type": "string"}}}}}
    model = {"type": "object", "required": ["id", "object", "owned_by", "root", "parent"],
             "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "owned_by": {"type": "string"},
                            "root": {"type": "string"}, "parent": {"type": ["string", "null"]}}}
    paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] = {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model}}}


def _fix_validation_responses(operation: dict[str, Any]) -> None:
    """FastAPI documents its own 422 body for routes with parameters; ours is the error envelope."""
    response = operation.get("responses", {}).get("422")
    if response is not None and response.get("description") == "Validation Error":
        response.update(description="`validation_error`: a parameter has an invalid value.",
                        content={"application/json": {"schema": _ref(ERROR_SCHEMA_NAME)}})


def _links(paths: dict[str, Any]) -> None:
    """How a client (or a stateful fuzzer) gets from a job's creation to its resources, and from the adapter list to
    an adapter."""
    job_id = {"job_id": "$response.body#/id"}
    paths["/v1/jobs"]["post"]["responses"]["202"]["links"] = {
        "GetJob": {"operationId": "get_job", "parameters": job_id},
        "JobEvents": {"operationId": "job_events", "parameters": job_id},
        "CancelJob": {"operationId": "cancel_job", "parameters": job_id},
    }
    first_adapter = {"name": "$response.body#/data/0/name"}
    for path, method in (("/v1/adapters", "get"), ("/v1/adapters/{name}/load", "post"),
                         ("/v1/adapters/{name}/unload", "post")):
        paths[path][method]["responses"]["200"]["links"] = {
            "LoadAdapter": {"operationId": "load_adapter", "parameters": first_adapter},
            "UnloadAdapter": {"operationId": "unload_adapter", "parameters": first_adapter},
        }
