"""JSON request bodies → their pydantic request models, with the parser's work bounded before it starts.

A body may be `max_body_bytes` (20 MiB: the image rides in it as base64), but the work of parsing and validating it
grows with its number of JSON items, not its bytes: 20 MiB of `0,0,0,…` are ten million values (seconds of CPU, all
of it holding the GIL, so a worker thread would freeze the event loop just the same). So, in order:

1. the items are counted first — `{`, `[` and `,` bytes, strings included, an upper bound on objects, arrays and
   values — in slices of a MiB; more than `max_json_items` is a 413 `payload_too_large`, nothing parsed;
2. the JSON is parsed by pydantic-core (Rust, ~5× faster than `json.loads` on long strings; nesting deeper than 200
   levels is refused, never a RecursionError) — 400 `invalid_request` for invalid JSON or a body that is not an
   object;
3. `shape` (optional) checks counts on the parsed value that validation would otherwise pay for item by item
   (pydantic checks a list's `max_length` only after validating all of it);
4. the model validates in strict mode: a JSON string is not a number or a boolean (`"max_tokens": "10"` → 422
   `validation_error`), unlike multipart form fields, which are always text.

Bodies above INLINE_PARSE_BYTES are handled in a worker thread, in calls that each hold the GIL briefly except the
parse itself, which holds it for about a millisecond per MiB (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

import pydantic_core
from pydantic import BaseModel, ValidationError

from service.errors import OCRError
from service.schema import OCRRequest

Model = TypeVar("Model", bound=BaseModel)

INLINE_PARSE_BYTES = 64 * 1024  # below this, parsing costs less than a hop to a worker thread
_COUNT_SLICE_BYTES = 1024 * 1024
_ITEM_BYTES = (b"{", b"[", b",")


def count_json_items(body: bytes, limit: int) -> int:
    """An upper bound on the JSON items in `body` (its `{`, `[` and `,` bytes); stops counting past `limit`."""
    total = 0
    for start in range(0, len(body), _COUNT_SLICE_BYTES):
        end = start + _COUNT_SLICE_BYTES
        total += sum(body.count(byte, start, end) for byte in _ITEM_BYTES)
        if total > limit:
            break
    return total


def check_json_items(data: bytes, max_items: int, what: str = "the JSON body") -> None:
    """413 `payload_too_large` for JSON text with more than `max_items` items."""
    if count_json_items(data, max_items) > max_items:
        raise OCRError("payload_too_large", f"{what} has more than {max_items} JSON items (objects, arrays, values; "
                       "counted as its `{`, `[` and `,`)")


def parse_json_model(body: bytes, model: type[Model], max_items: int,
                     shape: Callable[[dict[str, Any]], None] | None = None) -> Model:
    """The body as `model` (strict types), or the 4xx OCRError that says why not."""
    check_json_items(body, max_items)
    try:
        payload = pydantic_core.from_json(body)
    except ValueError as exc:  # invalid JSON, invalid UTF-8, nested deeper than the parser's limit
        raise OCRError("invalid_request", f"the body is not valid JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise OCRError("invalid_request", "the body must be a JSON object")
    if shape is not None:
        shape(payload)
    try:
        return model.model_validate(payload, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def read_json_model(body: bytes, model: type[Model], max_items: int,
                          shape: Callable[[dict[str, Any]], None] | None = None) -> Model:
    """`parse_json_model`, in a worker thread for a body large enough to be worth it."""
    if len(body) <= INLINE_PARSE_BYTES:
        return parse_json_model(body, model, max_items, shape)
    return await asyncio.to_thread(parse_json_model, body, model, max_items, shape)


def validation_error(exc: ValidationError) -> OCRError:
    """422 `validation_error` naming the first invalid field (never its value: it may be document content)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or "body"
    return OCRError("validation_error", f"{where}: {first.get('msg', 'invalid value')}",
                    param=where if first.get("loc") else None)


def request_from_form_fields(fields: dict[str, Any], max_json_items: int) -> OCRRequest:
    """Multipart text fields → OCRRequest (`fields` as a JSON list or comma-separated, `schema` as JSON; either
    bounded like a JSON body)."""
    fields = dict(fields)
    if "fields" in fields:
        raw = fields["fields"].strip()
        check_json_items(raw.encode(), max_json_items, "the `fields` form field")
        listed = _json_or(raw, None)  # a JSON list, else names separated by commas (`2024` names a field too)
        fields["fields"] = listed if isinstance(listed, list) else [f.strip() for f in raw.split(",") if f.strip()]
    if "schema" in fields:
        check_json_items(fields["schema"].encode(), max_json_items, "the `schema` form field")
        fields["schema"] = _json_or(fields["schema"], None, "schema must be a JSON object")
    try:
        return OCRRequest.model_validate(fields)  # lax: form fields are text (`max_tokens=10`, `stream=true`)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _json_or(raw: str, default: Any, error: str | None = None) -> Any:
    try:
        return pydantic_core.from_json(raw)  # nesting beyond its limit is a ValueError, never a RecursionError
    except ValueError:
        if error:
            raise OCRError("invalid_request", error) from None
        return default
