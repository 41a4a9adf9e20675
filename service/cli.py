"""`ocr-serve`: run the service, call it, inspect settings. Subcommands register themselves in `COMMANDS`."""

from __future__ import annotations

import argparse
import base64
import json
import logging
import mimetypes
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

log = logging.getLogger("service.cli")


def _settings_or_exit(**overrides):
    from service.settings import load_settings

    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        print("invalid settings:", file=sys.stderr)
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "settings"
            print(f"  OCR_{where.upper()}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2)


def cmd_serve(args: argparse.Namespace) -> int:
    from service.serve import local

    settings = _settings_or_exit(engine=args.engine, port=args.port, host=args.host, model=args.model)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    local.start_ray(num_gpus=None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = local.run_app(settings)
    print(f"ocr-serve: {settings.engine} engine ready at {url} in {time.monotonic() - started:.1f}s "
          f"(POST {url}/v1/ocr, docs {url}/docs)", flush=True)
    stop.wait()
    print("ocr-serve: shutting down (in-flight requests finish first)", flush=True)
    local.shutdown()
    return 0


def cmd_ocr(args: argparse.Namespace) -> int:
    import httpx

    path = Path(args.file)
    data = path.read_bytes()
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    body: dict = {"image": f"data:{mime};base64," + base64.b64encode(data).decode(), "task": args.task}
    if args.fields:
        body["fields"] = [f.strip() for f in args.fields.split(",") if f.strip()]
    if args.target_language:
        body["target_language"] = args.target_language
    if args.adapter:
        body["adapter"] = args.adapter
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = httpx.post(args.url.rstrip("/") + "/v1/ocr", json=body, headers=headers, timeout=args.timeout)
    try:
        payload = resp.json()
    except ValueError:
        payload = {"error": {"code": "invalid_response", "message": resp.text[:200]}}
    print(json.dumps(payload, ensure_ascii=False, indent=2))
    return 0 if resp.status_code < 400 else 1


def cmd_config(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    print(json.dumps(settings.masked(), indent=2, default=str))
    return 0


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start Ray (loopback) and the OCR application")
    p.add_argument("--engine", choices=["embedded", "vllm", "mock"], help="engine (default: OCR_ENGINE or embedded)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--model", help="model directory (vllm engine)")
    p.set_defaults(func=cmd_serve)


def _add_ocr(sub) -> None:
    p = sub.add_parser("ocr", help="send a file to a running service and print the JSON result")
    p.add_argument("file")
    p.add_argument("--task", default="spotting")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--fields", help="comma-separated field names (task extract)")
    p.add_argument("--target-language")
    p.add_argument("--adapter")
    p.add_argument("--api-key")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=cmd_ocr)


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="print the effective settings (secrets masked)")
    p.set_defaults(func=cmd_config)


# Each entry adds one subcommand; feature modules append theirs here.
COMMANDS: list[Callable] = [_add_serve, _add_ocr, _add_config]


def _optional_commands() -> list[Callable]:
    """Subcommands living next to the features they drive (imported lazily so a missing extra never breaks the CLI)."""
    found = []
    for module, attr in [("service.modelkit", "add_cli"), ("service.parsing.cli", "add_cli"),
                         ("service.admission.keys", "add_cli"), ("service.ui", "add_cli")]:
        try:
            mod = __import__(module, fromlist=[attr])
        except ImportError:
            continue
        found.append(getattr(mod, attr))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ocr-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS + _optional_commands():
        add(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    raise SystemExit(main())
