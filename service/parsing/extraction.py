"""Field extraction: the model's JSON → validated fields with per-field confidence.

Request side: `fields: ["name", …]` (every name expected, any JSON type) or `schema: <JSON Schema>` (an object
schema; its `properties` name the fields, `required` and `type`s are enforced). service.admission.schemas rejects a
bad, oversized or outward-referring schema at admission, `check_named_properties` one that names no fields (400
`invalid_schema`).

Output side, in order:
1. find the JSON: inside a ```json fence if there is one, from the first `{`;
2. parse it leniently: plain JSON; then trailing commas removed; then a truncated tail closed (open string, open
   brackets; an incomplete last member dropped); then Python-literal style (single quotes, True/None) as a last try;
3. coerce simple types towards the schema (`"42"` → 42 for integer, `"1,234.50"` → 1234.5 for number, `"yes"` →
   true for boolean, 42 → `"42"` for string, `""` → null where null is allowed) — recursively through objects/arrays;
4. validate (service.admission.schemas.output_errors: the schema's own draft, nothing fetched, RE2 regexes, a step
   budget) and report `fields: {name: {value, confidence, valid}}` and `errors: ["name: message", …]`.
A field's confidence is the geometric-mean probability of the tokens that wrote its value (service.parsing.confidence).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from service.admission.schemas import DEFAULT_VALIDATION_STEPS, SchemaValidationStopped, output_errors
from service.schema import FieldValue
from service.engine.protocol import TokenLogprob
from service.errors import OCRError
from service.parsing.confidence import span_confidence, token_spans

_FENCE = re.compile(r"```[\w-]*[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")


@dataclass
class ExtractionResult:
    fields: dict[str, FieldValue]
    errors: list[str]
    text: str  # the parsed object as JSON (or the raw output when it held no JSON)
    value: Any = None  # the parsed (coerced) object
    warnings: list[str] = field(default_factory=list)


# --- request side -------------------------------------------------------------------------------------------------

def check_named_properties(schema: dict) -> None:
    """400 `invalid_schema` unless the (admitted) schema's `properties` name the fields to extract."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        raise OCRError("invalid_schema", "schema needs `properties` naming the fields to extract")


def schema_for_fields(names: Sequence[str]) -> dict:
    """The implied schema of a `fields` list: every name required, any type."""
    return {"type": "object", "properties": {n: {} for n in names}, "required": list(names)}


# --- lenient JSON -------------------------------------------------------------------------------------------------

def _json_region(text: str) -> tuple[str, int]:
    """The part of the output that should hold the JSON, and its offset in `text`."""
    fence = _FENCE.search(text)
    region, offset = (fence.group(1), fence.start(1)) if fence else (text, 0)
    start = region.find("{")
    if start < 0:
        start = region.find("[")
    if start < 0:
        return "", offset + len(region)
    return region[start:], offset + start


def _scan(s: str) -> tuple[list[str], bool, bool, list[int]]:
    """Walk JSON text outside its strings: the closers still open, whether it ends inside a string (and right after
    a backslash), and the positions where a member can be cut off (after '{'/'[', before ',')."""
    stack: list[str] = []
    in_string = escape = False
    cut_points: list[int] = []
    for i, ch in enumerate(s):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            cut_points.append(i + 1)
        elif ch in "}]":
            if stack:
                stack.pop()
        elif ch == ",":
            cut_points.append(i)
    return stack, in_string, escape, cut_points


def _close_truncated(s: str) -> list[str]:
    """Candidates that close a truncated JSON text: the open string and brackets closed, with and without the
    incomplete last member."""
    _, in_string, escape, cut_points = _scan(s)
    head = s + ('"' if in_string else "")
    head = head[:-1] if escape and not in_string else head
    return [_closed(head)] + [_closed(s[:cut]) for cut in reversed(cut_points[-3:])]


def _closed(s: str) -> str:
    stack = _scan(s)[0]
    s = s.rstrip()
    if s.endswith(","):
        s = s[:-1]
    if s.endswith(":"):
        s += " null"
    return s + "".join(reversed(stack))


def parse_json_lenient(text: str) -> tuple[Any, int, list[str]]:
    """(value, offset of the JSON in `text`, notes); value is None when nothing could be read."""
    region, offset = _json_region(text)
    if not region:
        return None, offset, []
    decoder = json.JSONDecoder(strict=False)
    try:
        return decoder.raw_decode(region)[0], offset, []
    except ValueError:
        pass
    fixed = _TRAILING_COMMA.sub(r"\1", region)
    try:
        return decoder.raw_decode(fixed)[0], offset, ["trailing commas removed"]
    except ValueError:
        pass
    try:  # Python-literal style: {'a': 'b', 'c': None}
        end = fixed.rfind("}") + 1 or len(fixed)
        value = ast.literal_eval(fixed[:end])
        if isinstance(value, (dict, list)):
            return json.loads(json.dumps(value)), offset, ["Python-style literal read as JSON"]
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    emptied = None
    for candidate in _close_truncated(fixed):
        try:
            value = json.loads(candidate, strict=False)
        except ValueError:
            continue
        if value:
            return value, offset, ["the JSON was truncated; its open tail was closed"]
        emptied = value if emptied is None else emptied
    if emptied is not None:
        return emptied, offset, ["the JSON was truncated before its first complete member"]
    return None, offset, []


# --- coercion -----------------------------------------------------------------------------------------------------

_INT = re.compile(r"^[+-]?\d+$")
_GROUPED = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_TRUE = {"true", "yes", "y", "1", "是", "对"}
_FALSE = {"false", "no", "n", "0", "否", "不"}


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def coerce(value: Any, schema: Any) -> Any:
    """Move `value` towards the schema's simple types where that is unambiguous; anything else unchanged."""
    types = _types(schema)
    if isinstance(value, dict) and isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
        props = schema["properties"]
        return {k: coerce(v, props.get(k)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        return [coerce(v, schema["items"]) for v in value]
    if not types:
        return value
    current = _json_type(value)
    if current in types or (current == "integer" and "number" in types):
        return value
    if isinstance(value, str):
        s = value.strip()
        plain = s.replace(",", "") if _GROUPED.match(s) else s
        if "null" in types and s.lower() in ("", "null", "none"):
            return None
        if "integer" in types and _INT.match(plain):
            return int(plain)
        if "number" in types:
            try:
                number = float(plain)
                if number == number and abs(number) != float("inf"):
                    return int(number) if _INT.match(plain) else number
            except ValueError:
                pass
        if "boolean" in types and s.lower() in _TRUE | _FALSE:
            return s.lower() in _TRUE
    if "string" in types and current in ("integer", "number", "boolean"):
        return json.dumps(value)
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# --- the whole step -----------------------------------------------------------------------------------------------

def _value_span(text: str, offset: int, name: str) -> tuple[int, int] | None:
    """Characters of `name`'s value in the raw output (first occurrence of the key after the JSON start)."""
    for key in {json.dumps(name, ensure_ascii=False), json.dumps(name), "'" + name + "'"}:
        m = re.compile(re.escape(key) + r"\s*:\s*").search(text, offset)
        if m:
            try:
                _, end = json.JSONDecoder(strict=False).raw_decode(text, m.end())
            except ValueError:
                end = _value_end_fallback(text, m.end())
            return m.end(), end
    return None


def _value_end_fallback(text: str, start: int) -> int:
    """End of a value that is not valid JSON on its own (single quotes, truncated): the next `,` or `}` at depth 0."""
    depth, in_string, quote = 0, False, ""
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if ch == quote:
                in_string = False
        elif ch in "\"'":
            in_string, quote = True, ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:
                return i
            depth -= 1
        elif ch == "," and depth == 0:
            return i
    return len(text)


def extract_fields(raw: str, *, fields: Sequence[str] | None, schema: dict | None,
                   tokens: Sequence[TokenLogprob] | None = None,
                   max_validation_steps: int = DEFAULT_VALIDATION_STEPS) -> ExtractionResult:
    names = list(schema["properties"]) if schema and isinstance(schema.get("properties"), dict) else list(fields or [])
    effective_schema = schema if schema else schema_for_fields(names)
    value, offset, notes = parse_json_lenient(raw)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        value = value[0]
    if not isinstance(value, dict):
        reason = "the model output holds no JSON object" if value is None else "the model output is not a JSON object"
        return ExtractionResult(
            fields={n: FieldValue(value=None, confidence=None, valid=False) for n in names},
            errors=[reason], text=raw.strip(), value=value, warnings=notes,
        )
    value = coerce(value, effective_schema)
    errors: list[str] = []
    invalid: set[str] = set()
    try:
        found = output_errors(effective_schema, value, max_validation_steps)
    except SchemaValidationStopped as exc:
        found = []
        invalid.update(names)
        errors.append(f"(root): {exc}")
    for err in sorted(found, key=lambda e: list(map(str, e.absolute_path))):
        path = [str(p) for p in err.absolute_path]
        if err.validator == "required" and not path:
            missing = [n for n in (err.validator_value or []) if n not in value]
            invalid.update(missing)
            errors.extend(f"{n}: missing" for n in missing)
            continue
        if path:
            invalid.add(path[0])
        errors.append(f"{'/'.join(path) or '(root)'}: {err.message}")
    spans = token_spans(raw, tokens) if tokens else []
    out: dict[str, FieldValue] = {}
    for name in names:
        confidence = None
        span = _value_span(raw, offset, name) if tokens and name in value else None
        if span:
            confidence = span_confidence(spans, tokens, *span)
        out[name] = FieldValue(value=value.get(name), confidence=confidence, valid=name not in invalid)
    extra = sorted(set(value) - set(names))
    warnings = list(notes)
    if extra:
        warnings.append(f"the model returned {len(extra)} field(s) that were not asked for; they are in `text` only")
    return ExtractionResult(out, list(dict.fromkeys(errors)), json.dumps(value, ensure_ascii=False), value, warnings)
