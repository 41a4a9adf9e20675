"""Request-shape limits checked before any other work: field lists, extraction schemas, free-text lengths.

They run before the engine's capabilities are consulted, so an oversized request gets the same 4xx whatever engine
is deployed, and nothing proportional to the hostile input's size (prompt building, schema compilation, guided
decoding set-up) ever happens.
"""

from __future__ import annotations

import json

from service.api.protocol import OCRRequest
from service.errors import OCRError
from service.settings import Settings

MAX_SCHEMA_DEPTH = 32  # nesting of objects/arrays in an extraction schema (real schemas are 2-4 deep)


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a JSON value, iterative (a hostile schema never reaches Python's recursion limit)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_request_limits(req: OCRRequest, settings: Settings) -> None:
    """Raise a 4xx for field lists, field names or schemas beyond the configured limits."""
    if req.fields is not None:
        if len(req.fields) > settings.max_fields:
            raise OCRError("validation_error", f"fields: at most {settings.max_fields} fields")
        if any(len(name) > settings.max_text_field_chars for name in req.fields):
            raise OCRError("validation_error", f"fields: a field name is longer than {settings.max_text_field_chars}"
                           " characters")
    if req.json_schema is not None:
        check_schema(req.json_schema, settings)


def check_schema(schema: dict, settings: Settings) -> None:
    """Size, depth, property count and validity of an extraction JSON Schema (400 `invalid_schema`)."""
    try:
        size = len(json.dumps(schema, ensure_ascii=False).encode())
    except (TypeError, ValueError, RecursionError) as exc:
        raise OCRError("invalid_schema", "schema: not serialisable as JSON") from exc
    if size > settings.max_schema_bytes:
        raise OCRError("invalid_schema", f"schema: {size} bytes; at most {settings.max_schema_bytes}")
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise OCRError("invalid_schema", f"schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    properties = schema.get("properties")
    if isinstance(properties, dict) and len(properties) > settings.max_fields:
        raise OCRError("invalid_schema", f"schema: at most {settings.max_fields} properties")
    from jsonschema import exceptions as jsonschema_exceptions
    from jsonschema import validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except jsonschema_exceptions.SchemaError as exc:
        raise OCRError("invalid_schema", f"schema: not a valid JSON Schema ({exc.message[:200]})") from None
    except Exception as exc:  # noqa: BLE001 — e.g. an uncompilable `pattern`; the schema is the client's
        raise OCRError("invalid_schema", f"schema: not a valid JSON Schema ({type(exc).__name__})") from None
