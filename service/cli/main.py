"""`ocr-serve`: run the service, call it, inspect settings. Subcommands register themselves in `COMMANDS`."""

from __future__ import annotations

import argparse
import asyncio
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

log = logging.getLogger("service.cli.main")
# printed once every deployment has all its starting replicas (serve.run waits for the app to be RUNNING); /readyz
# answers 200 earlier, with the first engine replica (loadtest.common.start_service waits for this line)
READY_MARKER = "engine ready at"


def _settings_or_exit(**overrides):
    from service.config import load_settings

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
    local.start_ray(num_gpus=None, metrics_export_port=settings.metrics_export_port)
    stop = threading.Event()
    hurry = threading.Event()  # a second signal: stop waiting for in-flight requests (they still get their 503)

    def on_signal(*_):
        if stop.is_set():
            hurry.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    url = local.run_app(settings, stop=stop)
    if settings.api_keys_file is None:
        from service.admission.auth import announce_open_service

        announce_open_service()
    # before the ready line, which is what scripts wait for
    print(f"ocr-serve: replica logs in {local.replica_logs_dir()}", flush=True)
    print(f"ocr-serve: Ray cluster at {local.ray_address()} (`ocr-serve drain --address` it)", flush=True)
    print(f"ocr-serve: {settings.engine} {READY_MARKER} {url} in {time.monotonic() - started:.1f}s "
          f"(POST {url}/v1/ocr, docs {url}/docs, metrics {local.metrics_url()})", flush=True)
    stop.wait()
    # graceful drain: readiness fails and new work gets 503 at once; in-flight requests get up to the timeout, then
    # whatever is left gets 503 `shutting_down` (streams a last error event)
    print(f"ocr-serve: draining (in-flight requests get up to {settings.graceful_shutdown_timeout_s:.0f}s)",
          flush=True)
    loop = asyncio.new_event_loop()  # drain and Serve's shutdown share it (local.drain)
    outcome = local.drain(settings.graceful_shutdown_timeout_s, loop, hurry)
    if outcome.in_flight_at_deadline:
        print(f"ocr-serve: {'second signal' if hurry.is_set() else 'drain timeout'}, "
              f"{outcome.in_flight_at_deadline} request(s) still in flight", flush=True)
    if outcome.cut:
        print(f"ocr-serve: {outcome.cut} open request(s) ended with 503 shutting_down", flush=True)
    if outcome.left:
        print(f"ocr-serve: {outcome.left} request(s) could not be ended", flush=True)
    print("ocr-serve: shutting down", flush=True)
    local.shutdown(loop)
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """What `serve` does on SIGTERM, for a Serve app that runs in a cluster of its own (the Helm chart's head pod
    runs it before `ray stop`): new work gets 503, in-flight requests get up to the timeout, then whatever is left
    gets 503 `shutting_down`. Ray and Serve keep running."""
    from service.serve import local
    from service.config import Settings

    timeout_s = args.timeout_s if args.timeout_s is not None else \
        Settings.model_fields["graceful_shutdown_timeout_s"].default
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    local.connect_ray(args.address)
    loop = asyncio.new_event_loop()
    try:
        outcome = local.drain(timeout_s, loop)
    finally:
        loop.close()
    print(f"ocr-serve drain: {outcome.in_flight_at_deadline} request(s) in flight at the deadline, {outcome.cut} "
          f"open request(s) ended with 503 shutting_down, {outcome.left} left", flush=True)
    return 0 if not outcome.left else 1


def cmd_ocr(args: argparse.Namespace) -> int:
    import httpx

    path = Path(args.file)
    data = path.read_bytes()
    if data.startswith(b"%PDF-") or args.pages:  # documents go through /v1/jobs, with a progress bar
        return _ocr_job(args, path)
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


def _ocr_job(args: argparse.Namespace, path: Path) -> int:
    from service.cli.client import run_job

    form = {"task": args.task}
    for name in ("fields", "target_language", "adapter", "pages"):
        if getattr(args, name, None):
            form[name] = getattr(args, name)
    code, payload = run_job(url=args.url, files=[path], form=form, api_key=args.api_key, timeout=args.timeout)
    print(json.dumps(payload, ensure_ascii=False, indent=2))
    return code


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


def _add_drain(sub) -> None:
    p = sub.add_parser("drain", help="drain a running service's HTTP replicas (503 to new work, in-flight requests "
                                     "finish or get 503 at the deadline); Ray keeps running")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the one on this machine)")
    p.add_argument("--timeout-s", type=float, help="seconds in-flight requests get (default: the "
                   "graceful_shutdown_timeout_s default)")
    p.set_defaults(func=cmd_drain)


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
    p.add_argument("--pages", help="PDF pages, e.g. 1-3,5 (PDFs run as a job with a progress bar)")
    p.set_defaults(func=cmd_ocr)


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="print the effective settings (secrets masked)")
    p.set_defaults(func=cmd_config)


# Each entry adds one subcommand; feature modules append theirs here.
COMMANDS: list[Callable] = [_add_serve, _add_drain, _add_ocr, _add_config]


def _optional_commands() -> list[Callable]:
    """Subcommands living next to the features they drive (imported lazily so a missing extra never breaks the CLI)."""
    found = []
    for module, attr in [("service.cli.modelkit", "add_cli"), ("service.cli.parse", "add_cli"),
                         ("service.cli.keys", "add_cli"), ("service.http.routes.ui", "add_cli"),
                         ("service.observability.metrics", "add_cli"), ("service.eval.cli", "add_cli")]:
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
