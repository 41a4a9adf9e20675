"""Field extraction: valid, invalid, fenced, truncated and Python-style JSON; schemas with required fields and types;
per-field confidence from the tokens that wrote each value."""

from __future__ import annotations

import json
import math

import pytest

from service.admission.schemas import check_schema
from service.engine.protocol import TokenLogprob
from service.errors import OCRError
from service.parsing.extraction import check_named_properties, coerce, extract_fields, parse_json_lenient
from service.config import Settings

INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string"},
        "total": {"type": "number"},
        "items": {"type": "integer"},
        "paid": {"type": "boolean"},
        "due": {"type": ["string", "null"]},
    },
    "required": ["invoice_number", "total"],
}


def fields_of(result):
    return {name: (fv.value, fv.valid) for name, fv in result.fields.items()}


def test_valid_json_with_field_list():
    raw = '{"单价": "3.00", "发票号码": "42609332", "总金额": "￥77.10元"}'
    result = extract_fields(raw, fields=["单价", "发票号码", "总金额"], schema=None)
    assert fields_of(result) == {"单价": ("3.00", True), "发票号码": ("42609332", True), "总金额": ("￥77.10元", True)}
    assert result.errors == []
    assert json.loads(result.text) == json.loads(raw)


def test_fenced_json_as_in_the_readme():
    raw = 'Here you go:\n```json\n{\n    "name": "Bob",\n    "id_number": "X123"\n}\n```\nanything after'
    result = extract_fields(raw, fields=["name", "id_number"], schema=None)
    assert fields_of(result) == {"name": ("Bob", True), "id_number": ("X123", True)}
    assert result.errors == []


@pytest.mark.parametrize("raw, expected, note", [
    ('{"name": "Bob", "id": "7",}', {"name": "Bob", "id": "7"}, "trailing commas"),
    ('{"name": "Bob", "id": "7', {"name": "Bob", "id": "7"}, "truncated"),
    ('{"name": "Bob", "id": ', {"name": "Bob", "id": None}, "truncated"),
    ('{"name": "Bob", "i', {"name": "Bob"}, "truncated"),
    ('{"name": "Bob", "tags": ["a", "b', {"name": "Bob", "tags": ["a", "b"]}, "truncated"),
    ("{'name': 'Bob', 'id': None}", {"name": "Bob", "id": None}, "Python-style"),
    ('```json\n{"name": "Bob"', {"name": "Bob"}, "truncated"),
])
def test_broken_json_is_repaired(raw, expected, note):
    value, _, notes = parse_json_lenient(raw)
    assert value == expected
    assert any(note.split()[0].lower() in n.lower() for n in notes)


def test_truncated_output_reports_missing_fields():
    result = extract_fields('{"name": "Bob", "i', fields=["name", "id"], schema=None)
    assert fields_of(result) == {"name": ("Bob", True), "id": (None, False)}
    assert result.errors == ["id: missing"]
    assert any("truncated" in w for w in result.warnings)


@pytest.mark.parametrize("raw", ["", "no json at all", "[1, 2, 3]", "{{{{", "\"just a string\""])
def test_invalid_output_gives_invalid_fields_and_an_error(raw):
    result = extract_fields(raw, fields=["name"], schema=None)
    assert fields_of(result) == {"name": (None, False)}
    assert len(result.errors) == 1


def test_schema_types_are_coerced_then_validated():
    raw = ('{"invoice_number": 20261130, "total": "1,234.50", "items": "3", "paid": "yes", "due": "", '
           '"extra": 1}')
    result = extract_fields(raw, fields=None, schema=INVOICE_SCHEMA)
    assert fields_of(result) == {"invoice_number": ("20261130", True), "total": (1234.5, True), "items": (3, True),
                                 "paid": (True, True), "due": ("", True)}
    assert result.errors == []
    assert any("not asked for" in w for w in result.warnings)


def test_schema_violations_mark_fields_invalid():
    raw = '{"total": "about ten", "items": 2.5, "paid": "maybe"}'
    result = extract_fields(raw, fields=None, schema=INVOICE_SCHEMA)
    got = fields_of(result)
    assert got["invoice_number"] == (None, False)  # required, missing
    assert got["total"] == ("about ten", False)
    assert got["items"] == (2.5, False)
    assert got["paid"] == ("maybe", False)
    assert got["due"] == (None, True)  # optional and absent
    assert "invoice_number: missing" in result.errors
    assert any(e.startswith("total:") for e in result.errors)
    assert any(e.startswith("items:") for e in result.errors)


def test_nested_schema():
    schema = {"type": "object", "properties": {
        "buyer": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name"]},
        "lines": {"type": "array", "items": {"type": "number"}}}}
    result = extract_fields('{"buyer": {"age": "41"}, "lines": ["1.5", "2"]}', fields=None, schema=schema)
    assert result.fields["buyer"].value == {"age": 41}
    assert result.fields["buyer"].valid is False  # buyer.name is required
    assert result.fields["lines"].value == [1.5, 2] and result.fields["lines"].valid


@pytest.mark.parametrize("value, schema, expected", [
    ("42", {"type": "integer"}, 42), ("-7", {"type": "integer"}, -7), ("4.0", {"type": "integer"}, "4.0"),
    (4.0, {"type": "integer"}, 4), ("3.25", {"type": "number"}, 3.25), ("1,000", {"type": "number"}, 1000),
    ("nan", {"type": "number"}, "nan"), ("no", {"type": "boolean"}, False), ("是", {"type": "boolean"}, True),
    (12, {"type": "string"}, "12"), (True, {"type": "string"}, "true"), ("null", {"type": ["null", "integer"]}, None), ("", {"type": ["integer", "null"]}, None),
    ("x", {}, "x"), ("12", {"type": ["integer", "string"]}, "12"),
])
def test_coercion(value, schema, expected):
    assert coerce(value, schema) == expected


@pytest.mark.parametrize("schema, message", [
    ([], "JSON object"),
    ({"type": "object", "properties": {"a": {"type": "no-such-type"}}}, "not a valid JSON Schema"),
    ({"type": "object"}, "properties"),
    ({"type": "object", "properties": {f"f{i}": {"type": "string", "description": "x" * 100} for i in range(400)}},
     "at most 32768"),
])
def test_bad_schemas_are_rejected(schema, message):
    with pytest.raises(OCRError) as err:
        check_schema(schema, Settings(max_schema_bytes=32_768, max_fields=1000))
        check_named_properties(schema)
    assert err.value.code == "invalid_schema" and message in err.value.message


def test_field_confidence_is_the_geometric_mean_of_its_value_tokens():
    pieces = ['{"', 'name', '":', ' "', 'Bo', 'b', '",', ' "', 'id', '":', ' "', '7', '"}']
    logprobs = [-0.01, -0.02, -0.01, -0.05, -0.7, -0.2, -0.1, -0.01, -0.02, -0.01, -0.3, -1.2, -0.05]
    tokens = [TokenLogprob(token=p, logprob=lp) for p, lp in zip(pieces, logprobs)]
    raw = "".join(pieces)
    result = extract_fields(raw, fields=["name", "id"], schema=None, tokens=tokens)
    # value of name = '"Bob"' → tokens ' "' (overlaps the quote), 'Bo', 'b', '",'
    assert result.fields["name"].confidence == pytest.approx(math.exp((-0.05 - 0.7 - 0.2 - 0.1) / 4), rel=1e-5)
    # value of id = '"7"' → tokens ' "', '7', '"}'
    assert result.fields["id"].confidence == pytest.approx(math.exp((-0.3 - 1.2 - 0.05) / 3), rel=1e-5)
    assert result.fields["name"].confidence != result.fields["id"].confidence
