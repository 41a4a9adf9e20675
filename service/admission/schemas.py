"""Tenant JSON Schemas (an extraction `schema`, a chat `response_format` schema), from admission to the validation of
model output. No schema ever causes network access, and no work on one is unbounded.

Admission, `check_schema` (400 `invalid_schema`; CPU work, so callers on an event loop run it in a thread):
1. a JSON object of at most `max_schema_bytes`, nested at most MAX_SCHEMA_DEPTH levels, ≤ `max_fields` properties;
2. anywhere in the document: `$schema` is one of the drafts jsonschema ships (3, 4, 6, 7, 2019-09, 2020-12), every
   `$ref` / `$dynamicRef` / `$recursiveRef` is a local reference (`#…`: a JSON pointer or an anchor), and
   `unevaluatedProperties` does not meet `patternProperties` (jsonschema would match those with Python's `re`);
3. valid against its draft's metaschema;
4. every reference resolves within the document (from the base URI where it stands, `$id`s included), and every
   `pattern` / `patternProperties` regex compiles in RE2.

Validation of model output, `output_errors`: jsonschema with a `referencing.Registry` that retrieves nothing (only
the metaschemas jsonschema ships resolve), tenant regexes matched by RE2 (linear time in the text, never Python's
backtracking `re`), and a budget of `max_schema_validation_steps` — one step per keyword evaluated, and one per
REGEX_COST_PER_STEP characters × RE2 program instructions a regex scans — so a schema whose references fan out
(`allOf` of two refs to a definition that does the same, 40 levels down) stops instead of running for ever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import re2
import referencing.jsonschema
from jsonschema import Draft202012Validator, FormatChecker, ValidationError
from jsonschema.exceptions import best_match
from jsonschema.validators import extend, validator_for
from jsonschema_specifications import REGISTRY as SPECIFICATIONS
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable

from service.errors import OCRError
from service.config import LimitsConfig, Settings

MAX_SCHEMA_DEPTH = 32  # nesting of objects/arrays in a schema (real schemas are 2-4 deep)
REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
# RE2 scans text at ≈ 3.5 ns per character × program instruction in its slowest (NFA) mode, a keyword evaluation
# takes ≈ 1.6 µs: 512 of those units cost about one step
REGEX_COST_PER_STEP = 512
DEFAULT_VALIDATION_STEPS: int = LimitsConfig.model_fields["max_schema_validation_steps"].default


def _retrieve_nothing(uri: str) -> Resource:
    raise NoSuchResource(ref=uri)


# jsonschema combines it with the metaschemas it ships; any other URI is unresolvable, never fetched
OFFLINE_REGISTRY: Registry = Registry(retrieve=_retrieve_nothing)


def compile_regex(pattern: str) -> Any:
    """A tenant's regex in RE2 (raises re2.error for backreferences, look-around, invalid syntax)."""
    options = re2.Options()
    options.log_errors = False  # a bad pattern is the client's 400, not a line in our log
    return re2.compile(pattern, options)


# --- admission ----------------------------------------------------------------------------------------------------

def _invalid(where: str, message: str) -> OCRError:
    return OCRError("invalid_schema", f"{where}: {message}")


def _shown(text: str, limit: int = 80) -> str:
    return json.dumps(text if len(text) <= limit else text[:limit] + "…", ensure_ascii=False)


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


def _check_keywords(schema: dict, where: str) -> None:
    """Rule 2, over the whole document (also inside `const`/`default` values: cheaper than knowing which parts
    jsonschema will read, and no real schema holds a remote `$ref` there)."""
    if "$schema" in schema and not isinstance(schema["$schema"], str):
        raise _invalid(where, "$schema must be a string")
    unevaluated = patterns = False
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}/{i}") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        unevaluated = unevaluated or "unevaluatedProperties" in node
        patterns = patterns or bool(isinstance(node.get("patternProperties"), dict) and node["patternProperties"])
        for key, value in node.items():
            here = f"{path}/{key.replace('~', '~0').replace('/', '~1')}"
            if isinstance(value, str) and key in REFERENCE_KEYWORDS and not value.startswith("#"):
                raise _invalid(where, f"{key} {_shown(value)} at {here or '/'} refers outside the schema; only "
                               "references within it (\"#…\") are allowed, nothing is fetched")
            if isinstance(value, str) and key == "$schema" and validator_for({"$schema": value}, default=None) is None:
                raise _invalid(where, f"$schema {_shown(value)} at {here} is not a JSON Schema draft this service "
                               "knows (draft-03, -04, -06, -07, 2019-09, 2020-12)")
            stack.append((value, here))
    if unevaluated and patterns:
        raise _invalid(where, "`unevaluatedProperties` together with `patternProperties` is not supported")


def _regex_format() -> FormatChecker:
    """The metaschema's `format: regex`, checked by the engine that will match the patterns; no other format is
    asserted on the schema (URI and other format checkers run third-party regexes on tenant strings)."""
    checker = FormatChecker(formats=())
    checker.checks("regex", raises=re2.error)(compile_regex)
    return checker


def _check_resolution(schema: dict, cls: type, where: str) -> None:
    """Rule 4: walk every place jsonschema would evaluate (subschemas by keyword, targets of references), with the
    resolver it would use there."""
    specification = referencing.jsonschema.specification_with(cls.ID_OF(cls.META_SCHEMA))
    root = specification.create_resource(schema)
    stack = [(root, SPECIFICATIONS.combine(OFFLINE_REGISTRY).resolver_with_root(root))]
    seen: set[int] = set()
    while stack:
        resource, resolver = stack.pop()
        contents = resource.contents
        if not isinstance(contents, dict) or id(contents) in seen:
            continue
        seen.add(id(contents))
        for keyword in REFERENCE_KEYWORDS:
            ref = contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolved = resolver.lookup(ref)
            except Unresolvable:
                raise _invalid(where, f"{keyword} {_shown(ref)} does not resolve within the schema") from None
            stack.append((specification.create_resource(resolved.contents), resolved.resolver))
        regexes = [contents["pattern"]] if isinstance(contents.get("pattern"), str) else []
        if isinstance(contents.get("patternProperties"), dict):
            regexes += list(contents["patternProperties"])
        for pattern in regexes:
            try:
                compile_regex(pattern)
            except re2.error as exc:
                raise _invalid(where, f"pattern {_shown(pattern)} is not supported ({exc}); patterns are matched "
                               "by RE2: no backreferences or look-around") from None
        for sub in resource.subresources():
            stack.append((sub, resolver.in_subresource(sub)))


def check_schema(schema: Any, settings: Settings, *, where: str = "schema") -> None:
    """400 `invalid_schema` unless `schema` passes every admission rule (module docstring)."""
    if not isinstance(schema, dict):
        raise _invalid(where, "must be a JSON object")
    try:
        size = len(json.dumps(schema, ensure_ascii=False).encode())
    except (TypeError, ValueError, RecursionError):
        raise _invalid(where, "not serialisable as JSON") from None
    if size > settings.limits.max_schema_bytes:
        raise _invalid(where, f"{size} bytes; at most {settings.limits.max_schema_bytes}")
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise _invalid(where, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    properties = schema.get("properties")
    if isinstance(properties, dict) and len(properties) > settings.limits.max_fields:
        raise _invalid(where, f"at most {settings.limits.max_fields} properties")
    _check_keywords(schema, where)
    cls = validator_for(schema, default=Draft202012Validator)
    meta_cls = validator_for(cls.META_SCHEMA, default=cls)
    try:
        meta = meta_cls(cls.META_SCHEMA, registry=OFFLINE_REGISTRY, format_checker=_regex_format())
        error = best_match(meta.iter_errors(schema))
    except Exception as exc:  # noqa: BLE001 — whatever a hostile schema makes the metaschema check raise is a 400
        raise _invalid(where, f"not a valid JSON Schema ({type(exc).__name__})") from None
    if error is not None:
        raise _invalid(where, f"not a valid JSON Schema ({error.message[:200]})")
    _check_resolution(schema, cls, where)


# --- validation of model output -----------------------------------------------------------------------------------

class SchemaValidationStopped(Exception):
    """Validation did not finish: its budget ran out, or the schema cannot be applied (the message says which)."""


class _BudgetExceeded(Exception):
    pass


@dataclass
class _Budget:
    steps_left: int
    regexes: dict[str, Any] = field(default_factory=dict)

    def charge(self, steps: int) -> None:
        self.steps_left -= steps
        if self.steps_left < 0:
            raise _BudgetExceeded

    def search(self, pattern: str, text: str) -> bool:
        regex = self.regexes.get(pattern)
        if regex is None:
            regex = self.regexes[pattern] = compile_regex(pattern)
        self.charge(1 + len(text) * regex.programsize // REGEX_COST_PER_STEP)  # before the scan, not after
        return regex.search(text) is not None


def _keywords(base: type, budget: _Budget) -> dict[str, Callable]:
    """`base`'s keyword functions, each charging one step, with the three that match tenant regexes in RE2."""
    def pattern(validator, regex, instance, schema):
        if validator.is_type(instance, "string") and not budget.search(regex, instance):
            yield ValidationError(f"{instance!r} does not match {regex!r}")

    def pattern_properties(validator, patterns, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        for regex, subschema in patterns.items():
            for key, value in instance.items():
                if budget.search(regex, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=regex)

    def additional_properties(validator, additional, instance, schema):
        # jsonschema's own, told which keys the patterns match (it would join and match them with `re`)
        if validator.is_type(instance, "object") and schema.get("patternProperties"):
            matched = {key: {} for key in instance if any(budget.search(regex, key)
                                                          for regex in schema["patternProperties"])}
            schema = {**{k: v for k, v in schema.items() if k != "patternProperties"},
                      "properties": {**schema.get("properties", {}), **matched}}
        return base.VALIDATORS["additionalProperties"](validator, additional, instance, schema)

    functions = dict(base.VALIDATORS)
    functions.update({"pattern": pattern, "patternProperties": pattern_properties,
                      "additionalProperties": additional_properties})

    def counted(function: Callable) -> Callable:
        def evaluate(validator, value, instance, schema):
            budget.charge(1)
            return function(validator, value, instance, schema)
        return evaluate

    return {name: counted(function) for name, function in functions.items() if name in base.VALIDATORS}


def output_errors(schema: dict, instance: Any, max_steps: int) -> list[ValidationError]:
    """Every way `instance` (parsed model output) fails `schema`; raises SchemaValidationStopped when that could not
    be decided within `max_steps`. CPU work: run it off the event loop."""
    try:
        _check_keywords(schema, "schema")  # admission did this; a caller that skipped it still fetches nothing
    except OCRError as exc:
        raise SchemaValidationStopped(exc.message) from None
    base = validator_for(schema, default=Draft202012Validator)
    budget = _Budget(max_steps)
    validator = extend(base, _keywords(base, budget))(schema, registry=OFFLINE_REGISTRY)
    try:
        return list(validator.iter_errors(instance))
    except _BudgetExceeded:
        raise SchemaValidationStopped(f"validation stopped after {max_steps} steps "
                                      "(max_schema_validation_steps); the fields are not validated") from None
    except RecursionError:
        raise SchemaValidationStopped("the schema's references recurse without end") from None
    except Unresolvable:
        raise SchemaValidationStopped("a reference does not resolve within the schema") from None
    except re2.error:
        raise SchemaValidationStopped("a pattern is not supported by RE2") from None
