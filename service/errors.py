"""Stable error codes of the API. Every error response, on every endpoint, is OpenAI's envelope with our code:
`{"error": {"code", "message", "type", "param"}}` — `type` is OpenAI's error class for the status (ERROR_TYPES),
`param` the request field at fault where one is (else null).

The table below is the contract (docs/API.md renders it): a code never changes meaning once published.
Client mistakes are 4xx; 5xx only for our own faults (engine down, internal bug).
"""

from __future__ import annotations

from dataclasses import dataclass

# code -> (HTTP status, when it happens)
ERROR_CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "The request is malformed (bad JSON, JSON nested deeper than 200 levels, a body that "
                        "is not an object, missing fields, a `Last-Event-ID` that is not a page index)."),
    "invalid_base64": (400, "The `image` field is not valid base64 (or a base64 data URL)."),
    "empty_image": (400, "No image bytes were sent."),
    "invalid_image": (400, "The bytes are not a decodable image of an allowed format, or the file is truncated."),
    "unsupported_media_type": (415, "The file's real type (sniffed from its bytes) is not accepted."),
    "image_too_large": (413, "The image has more pixels, a longer side or more frames than allowed."),
    "unsupported_aspect_ratio": (400, "The image is longer than `max_image_aspect_ratio` times its width (or wider "
                                 "than that times its height): no document is, and the model's processor refuses it."),
    "payload_too_large": (413, "The request body exceeds the size limit (`max_body_bytes`), or a JSON body or "
                          "JSON form field holds more than `max_json_items` items."),
    "prompt_too_long": (400, "The request's instruction (a chat request's user text, a completion's `prompt`) is "
                        "longer than `max_text_field_chars`, or the request's text leaves no room in the model's "
                        "context for the image at its smallest and one output token."),
    "unknown_task": (400, "The `task` is not one of the documented tasks."),
    "unsupported_task": (400, "The task is known but the current engine cannot perform it; on the OpenAI endpoints, "
                         "an instruction the engine cannot follow (the embedded engine only reads text)."),
    "invalid_schema": (400, "A JSON Schema (extraction `schema`, chat `response_format`) is invalid, too large or "
                            "too deep, refers outside itself, or has a regex RE2 cannot match."),
    "invalid_pdf": (400, "The PDF is corrupt, encrypted or cannot be rasterised within limits."),
    "too_many_pages": (413, "The document has more pages than allowed."),
    "too_many_pixels": (413, "The request's images (or PDF pages, at the resolution they would be rendered at) "
                        "together have more pixels than `max_request_pixels`; refused from their headers, before "
                        "any is decoded."),
    "invalid_webhook": (400, "The job's `webhook` URL is refused: not http(s), has credentials, or resolves to a "
                        "non-public address that is not in the allow-list."),
    "ambiguous_credentials": (400, "The request carries more than one API key: a repeated `Authorization` or "
                              "`X-API-Key` header, or both headers with different keys."),
    "request_timeout": (408, "The request's headers or body arrived too slowly (`header_timeout_s`; `body_timeout_s` "
                        "and `body_min_rate_bytes_s`); the connection is closed."),
    "headers_too_large": (431, "The request line and headers together exceed `max_header_bytes`; the connection is "
                          "closed."),
    "unauthorized": (401, "Missing or invalid API key."),
    "forbidden": (403, "The API key may not use this endpoint, adapter or option (`ignore_eos`/`min_tokens` need "
                  "the admin role)."),
    "unknown_adapter": (404, "The named LoRA adapter does not exist."),
    "model_not_found": (404, "The OpenAI endpoints' `model` is neither the served base model nor an adapter the key "
                        "may use; the message lists the models available (as `GET /v1/models` does)."),
    "invalid_adapter": (422, "The LoRA adapter exists but cannot be loaded (rank above max_lora_rank, wrong modules)."),
    "not_found": (404, "No such resource (job id, route)."),
    "method_not_allowed": (405, "The HTTP method is not allowed on this route."),
    "validation_error": (422, "A field has an invalid value or type (out of range, too long, a string where a "
                         "number or boolean belongs, unknown field)."),
    "rate_limited": (429, "The tenant's token bucket is empty; retry after `Retry-After` seconds."),
    "too_many_jobs": (429, "The tenant already has `max_running_jobs_per_tenant` jobs running; retry after "
                      "`Retry-After` seconds or once one of them has finished."),
    "too_many_concurrent_requests": (429, "The tenant already has `max_concurrent_requests_per_tenant` requests in "
                                     "flight on this ingress replica; retry after `Retry-After` seconds."),
    "overloaded": (503, "All engine replicas are saturated, or this tenant's image and PDF work already fills its "
                   "share of the ingress's admission queue; retry after `Retry-After` seconds."),
    "rate_limiter_unavailable": (503, "The rate-limit backend failed and fail mode is `closed`."),
    "engine_unavailable": (503, "No healthy engine replica could serve the request."),
    "job_store_unavailable": (503, "The job store (Redis) is unavailable; retry after `Retry-After` seconds."),
    "job_lost": (503, "A job's state was lost from the job store (Redis restarted or failed over without its data); "
                 "its page results are gone: resubmit the job."),
    "shutting_down": (503, "This instance is draining before it stops; retry after `Retry-After` seconds."),
    "timeout": (504, "The request did not finish within the service's time limit."),
    "internal_error": (500, "An unexpected server fault (reported, never a client mistake)."),
}


# OpenAI's error `type` for each status (its clients and tools branch on it; our `code` says more)
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
    413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
    431: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    429: "rate_limit_error",
}
SERVER_ERROR_TYPE = "server_error"  # every 5xx


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, SERVER_ERROR_TYPE if status >= 500 else "invalid_request_error")


@dataclass
class OCRError(Exception):
    """An error with a stable code; the API layer turns it into the JSON error response. `param` names the request
    field at fault (dotted path, e.g. `messages.0.content`), where there is one."""

    code: str
    message: str
    headers: dict[str, str] | None = None
    param: str | None = None

    def __post_init__(self) -> None:
        if self.code not in ERROR_CODES:
            raise ValueError(f"undocumented error code {self.code!r}")
        super().__init__(self.message)

    @property
    def status(self) -> int:
        return ERROR_CODES[self.code][0]

    def body(self) -> dict:
        return error_body(self.code, self.message, self.param)

    def __reduce__(self):
        # Exceptions pickle as cls(*args); ours needs its fields to cross Ray (engine replica → ingress)
        return (type(self), (self.code, self.message, self.headers, self.param))


def error_body(code: str, message: str, param: str | None = None) -> dict:
    """The error envelope of every endpoint (OpenAI's fields, our stable `code`)."""
    return {"error": {"code": code, "message": message, "type": error_type(ERROR_CODES[code][0]), "param": param}}


ERROR_SCHEMA_NAME = "ErrorResponse"  # components.schemas entry of the envelope (service/http/openapi.py adds it)


def error_response_schema() -> dict:
    """JSON Schema of the error envelope."""
    return {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["code", "message", "type", "param"],
            "properties": {
                "code": {"type": "string", "enum": sorted(ERROR_CODES), "description": "Stable error code."},
                "message": {"type": "string", "description": "What went wrong, for people."},
                "type": {"type": "string", "enum": sorted({*ERROR_TYPES.values(), SERVER_ERROR_TYPE}),
                         "description": "OpenAI's error class for the status."},
                "param": {"type": ["string", "null"], "description": "The request field at fault, if any."},
            },
        }},
    }


def openapi_error_responses(*statuses: int) -> dict[int, dict]:
    """OpenAPI `responses` entries (for route decorators) for the given statuses, or all documented ones: each lists
    the error codes that come with that status and refers to the shared envelope's schema."""
    by_status: dict[int, list[str]] = {}
    for code, (status, when) in ERROR_CODES.items():
        if not statuses or status in statuses:
            by_status.setdefault(status, []).append(f"`{code}`: {when}")
    body = {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}
    return {status: {"description": " ".join(lines), "content": {"application/json": {"schema": body}}}
            for status, lines in sorted(by_status.items())}
