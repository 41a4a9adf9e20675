"""Request-shape limits checked before any other work: field lists and free-text lengths (a `schema` is checked by
service.admission.schemas, off the event loop).

They run before the engine's capabilities are consulted, so an oversized request gets the same 4xx whatever engine
is deployed, and nothing proportional to the hostile input's size (prompt building, schema compilation, guided
decoding set-up) ever happens.
"""

from __future__ import annotations

from service.schema import OCRRequest
from service.errors import OCRError
from service.config import Settings


def check_request_limits(req: OCRRequest, settings: Settings) -> None:
    """Raise a 4xx for field lists or field names beyond the configured limits."""
    if req.fields is not None:
        if len(req.fields) > settings.limits.max_fields:
            raise OCRError("validation_error", f"fields: at most {settings.limits.max_fields} fields")
        if any(len(name) > settings.limits.max_text_field_chars for name in req.fields):
            raise OCRError("validation_error", f"fields: a field name is longer than {settings.limits.max_text_field_chars}"
                           " characters")
