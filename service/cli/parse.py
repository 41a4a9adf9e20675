"""`ocr-serve parse`: replay raw model output through the service's own parsing and print the API result JSON.

    ocr-serve parse --task spotting --width 1240 --height 1754 [--scale 0.5] < raw.txt
    ocr-serve parse --task extract --fields name,id_number --width 800 --height 500 < raw.txt
    ocr-serve parse --task extract --schema schema.json --width 800 --height 500 < raw.txt
    ocr-serve parse --task spotting --width 1240 --height 1754 --raw-json < response.json   # `raw` of include_raw

The code path is the service's: repetition trim → task parser → response builder (service.http.routes.ocr does the same
after the engine call). `--width/--height` are the UPLOADED image's size; `--scale` is engine pixels per uploaded
pixel (the response's `image.scale`; it only fills `image.engine_*`, since HunyuanOCR boxes are relative to the image).
With `--raw-json`, stdin is the `raw` object of a response made with `include_raw: true` (or the whole response),
so confidences are recomputed from its token logprobs too. Exit status: 0, or 2 for bad arguments/input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from service.engine.protocol import EngineResult, TokenLogprob
from service.errors import OCRError
from service.admission.schemas import check_schema
from service.parsing.extraction import check_named_properties
from service.engine.repetition import guard_result
from service.parsing.page import PageGeometry
from service.parsing.response import build_response, parse_engine_output
from service.tasks import TASKS


def _fail(message: str) -> int:
    print(json.dumps({"error": {"code": "invalid_request", "message": message}}), file=sys.stderr)
    return 2


def _read_result(stdin_text: str, raw_json: bool, finish_reason: str) -> EngineResult:
    if not raw_json:
        return EngineResult(text=stdin_text, finish_reason=finish_reason)
    payload = json.loads(stdin_text)
    if isinstance(payload, dict) and isinstance(payload.get("raw"), dict):
        payload = payload["raw"]
    if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
        raise ValueError("--raw-json expects a JSON object with `text` (and optionally `tokens`)")
    tokens = payload.get("tokens")
    return EngineResult(
        text=payload["text"],
        tokens=[TokenLogprob(token=t["token"], logprob=t["logprob"]) for t in tokens] if tokens else None,
        finish_reason=finish_reason, output_tokens=len(tokens or []),
        rendered_prompt=payload.get("rendered_prompt"),
    )


def cmd_parse(args: argparse.Namespace) -> int:
    from service.config import load_settings

    if args.task not in TASKS:
        return _fail(f"unknown task {args.task!r}; tasks: {', '.join(TASKS)}")
    if args.width < 1 or args.height < 1 or not 0 < args.scale <= 64:
        return _fail("--width and --height must be ≥ 1 and --scale in (0, 64]")
    fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
    schema = None
    settings = load_settings()
    if args.schema:
        try:
            with open(args.schema, encoding="utf-8") as fh:
                schema = json.load(fh)
            check_schema(schema, settings)  # the service's admission: nothing a schema refers to is fetched
            check_named_properties(schema)
        except (OSError, ValueError) as exc:
            return _fail(f"cannot read schema {args.schema}: {exc}")
        except OCRError as exc:
            return _fail(exc.message)
    if args.task == "extract" and not (fields or schema):
        return _fail("task extract needs --fields or --schema")
    try:
        result = _read_result(sys.stdin.read(), args.raw_json, args.finish_reason)
    except (ValueError, KeyError, TypeError) as exc:
        return _fail(f"bad input: {exc}")
    started = time.perf_counter()
    geom = PageGeometry(args.width, args.height, max(1, round(args.width * args.scale)),
                        max(1, round(args.height * args.scale)))
    result = guard_result(result, settings)
    parsed = parse_engine_output(args.task, result, geom, fields=fields, schema=schema,
                                 max_validation_steps=settings.limits.max_schema_validation_steps)
    response = build_response(request_id="replay", model="replay", task=args.task, result=result, geom=geom,
                              parsed=parsed, timings_ms={"parse": (time.perf_counter() - started) * 1000},
                              include_raw=args.include_raw)
    print(json.dumps(response.model_dump(mode="json"), ensure_ascii=False, indent=None if args.compact else 2))
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("parse", help="parse raw model output from stdin into the API result JSON (replay)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS)}")
    p.add_argument("--width", type=int, required=True, help="uploaded image width in pixels")
    p.add_argument("--height", type=int, required=True, help="uploaded image height in pixels")
    p.add_argument("--scale", type=float, default=1.0, help="engine pixels per uploaded pixel (image.scale)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--fields", help="comma-separated field names (task extract)")
    group.add_argument("--schema", help="JSON Schema file (task extract)")
    p.add_argument("--raw-json", action="store_true", help="stdin is a response's `raw` object (text + tokens)")
    p.add_argument("--finish-reason", default="stop", help="finish reason of the replayed output (default stop)")
    p.add_argument("--include-raw", action="store_true", help="echo the raw output in the result")
    p.add_argument("--compact", action="store_true", help="one-line JSON")
    p.set_defaults(func=cmd_parse)
