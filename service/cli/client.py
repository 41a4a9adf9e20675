"""`ocr-serve ocr FILE`: send an image to a running service and print the JSON result. A PDF (or `--pages`) runs as a
job: submitted, a progress bar drawn from its events stream (stderr), the final result printed. The bar advances on
each `page` event (pages arrive in page order) and ends on the `done` event; the final JSON (`GET /v1/jobs/{id}`:
status and every page's result) goes to stdout. Ctrl-C cancels the job on the server."""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import sys
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, TextIO

from service.errors import ERROR_CODES
from service.jobs.backoff import retry_wait_s

BAR_WIDTH = 30
MAX_RECONNECTS = 5  # reopenings of a job's events stream in a row without an event in between
RECONNECT_BASE_S, RECONNECT_CAP_S = 0.5, 8.0  # jittered exponential waits between them (service/jobs/backoff.py)


@dataclass
class SSEEvent:
    event: str
    data: str
    id: str  # the last event ID after this event (the stream's, kept from earlier events when this one has none)


@dataclass
class SSEParser:
    """Server-Sent Events as the HTML standard parses them (§ 9.2.6): `field: value` with one leading space of the value
    removed, a line without a colon is a field with an empty value, `data` lines joined with newlines, `:` comments
    (keep-alives) ignored, an event dispatched at a blank line (none when it has no data), `id` kept across events
    (the `Last-Event-ID` to resume from), `retry` the reconnection delay in milliseconds; a partial event at the end
    of the stream is dropped."""

    last_event_id: str = ""
    retry_ms: int | None = None
    _event: str = ""
    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> SSEEvent | None:
        if line == "":
            data, event, self._data, self._event = self._data, self._event, [], ""
            return SSEEvent(event or "message", "\n".join(data), self.last_event_id) if data else None
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self.last_event_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None

    def events(self, lines: Iterable[str]) -> Iterator[SSEEvent]:
        for line in lines:
            event = self.feed(line)
            if event is not None:
                yield event


class ProgressBar:
    """`[#########.....]  3/5 pages  page 3 ok  12.4s` — redrawn in place on a terminal, one line per page else."""

    def __init__(self, total: int, out: TextIO):
        self.total = max(1, total)
        self.out = out
        self.started = time.monotonic()
        self.tty = out.isatty()

    def update(self, done: int, note: str = "") -> None:
        filled = round(BAR_WIDTH * done / self.total)
        line = (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{self.total} pages  {note}  "
                f"{time.monotonic() - self.started:.1f}s")
        if self.tty:
            self.out.write("\r" + line.ljust(79))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def run_job(*, url: str, files: list[Path], form: dict[str, str], api_key: str | None, timeout: float,
            progress_out: TextIO = sys.stderr) -> tuple[int, dict[str, Any]]:
    """Submit, follow the events with a progress bar, return (exit code, final job JSON or error body)."""
    import httpx

    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(timeout, read=timeout)) as client:
        parts = [("file", (path.name, path.read_bytes(), "application/octet-stream")) for path in files]
        resp = client.post("/v1/jobs", files=parts, data=form)
        if resp.status_code != 202:
            return 1, _json_or_error(resp)
        job = resp.json()
        bar = ProgressBar(job["pages_total"], progress_out)
        bar.update(0, "queued")
        try:
            failed = follow_job_events(client, job["id"], bar)
        except KeyboardInterrupt:
            client.delete(f"/v1/jobs/{job['id']}")
            bar.close()
            progress_out.write("cancelled\n")
            return 130, client.get(f"/v1/jobs/{job['id']}").json()
        if failed is not None:
            bar.close()
            return 1, failed
        bar.close()
        final = client.get(f"/v1/jobs/{job['id']}").json()
    return (0 if final.get("status") == "succeeded" else 1), final


def follow_job_events(client, job_id: str, bar: ProgressBar, *, sleep=time.sleep) -> dict[str, Any] | None:
    """Draws the job's `page` events on the bar until `done`; None, or the error body that ended the stream. A stream
    that breaks (connection lost, a replica draining, the job store briefly unavailable) is reopened with
    `Last-Event-ID`, so the pages already seen are not sent again; after MAX_RECONNECTS attempts in a row without
    an event the error is returned."""
    import httpx

    parser = SSEParser()
    done, failures, error = 0, 0, None
    while failures <= MAX_RECONNECTS:
        headers = {"Last-Event-ID": parser.last_event_id} if parser.last_event_id else {}
        try:
            with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as events:
                if events.status_code != 200:
                    events.read()
                    error = _json_or_error(events)
                    if events.status_code < 500:
                        return error
                else:
                    error = {"error": {"code": "stream_ended", "message": "the events stream ended before `done`"}}
                    for event in parser.events(events.iter_lines()):
                        failures = 0
                        data = json.loads(event.data)
                        if event.event == "page":
                            done += 1
                            outcome = "ok" if data["status"] == "ok" else f"failed ({data['error']['code']})"
                            bar.update(done, f"page {data['page']} {outcome}")
                        elif event.event == "done":
                            bar.update(data["pages_done"], data["status"])
                            return None
                        elif event.event == "error":
                            code = data.get("error", {}).get("code")
                            if ERROR_CODES.get(code, (500,))[0] < 500:
                                return data
                            error = data  # the service's fault (store unavailable): worth reconnecting
                            break
        except httpx.TransportError as exc:
            error = {"error": {"code": "connection_lost", "message": f"{type(exc).__name__}: {exc}"}}
        failures += 1
        if failures <= MAX_RECONNECTS:
            wait_ms = parser.retry_ms
            sleep(wait_ms / 1000 if wait_ms is not None else retry_wait_s(failures - 1, RECONNECT_BASE_S,
                                                                           RECONNECT_CAP_S))
    return error


def _json_or_error(resp) -> dict[str, Any]:
    try:
        return resp.json()
    except ValueError:
        return {"error": {"code": "invalid_response", "message": resp.text[:200]}}


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
    form = {"task": args.task}
    for name in ("fields", "target_language", "adapter", "pages"):
        if getattr(args, name, None):
            form[name] = getattr(args, name)
    code, payload = run_job(url=args.url, files=[path], form=form, api_key=args.api_key, timeout=args.timeout)
    print(json.dumps(payload, ensure_ascii=False, indent=2))
    return code


def add_cli(sub) -> None:
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
