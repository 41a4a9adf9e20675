"""`ocr-serve ocr FILE`: send an image to a running service and print the JSON result. A PDF (or `--pages`) runs as a
job: submitted, a progress bar drawn from its events stream (stderr), the final result printed. The bar advances on
each `page` event (pages arrive in page order) and ends on the `done` event; the final JSON (`GET /v1/jobs/{id}`:
status and every page's result) goes to stdout. Ctrl-C cancels the job on the server.

The service's URL and key come from --url/--api-key or OCR_URL/OCR_API_KEY (config.CLIENT_VARIABLES). What goes wrong
on the way (refused connection, timeout, unreadable file, bad URL) is one line on stderr and an exit status by cause
(EXIT_*), never a traceback."""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import os
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
            progress_out: TextIO = sys.stderr) -> tuple[int, dict[str, Any], int]:
    """Submit, follow the events with a progress bar, return (exit code, final job JSON or error body, HTTP status
    of the answer that ended it)."""
    import httpx

    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(timeout, read=timeout)) as client:
        parts = [("file", (path.name, path.read_bytes(), "application/octet-stream")) for path in files]
        resp = client.post("/v1/jobs", files=parts, data=form)
        if resp.status_code != 202:
            return 1, _json_or_error(resp), resp.status_code
        job = resp.json()
        bar = ProgressBar(job["pages_total"], progress_out)
        bar.update(0, "queued")
        try:
            failed = follow_job_events(client, job["id"], bar)
        except KeyboardInterrupt:
            client.delete(f"/v1/jobs/{job['id']}")
            bar.close()
            progress_out.write("cancelled\n")
            return 130, client.get(f"/v1/jobs/{job['id']}").json(), 200
        if failed is not None:
            bar.close()
            return 1, failed, 0  # the events stream's error (no HTTP status of its own)
        bar.close()
        final = client.get(f"/v1/jobs/{job['id']}")
    payload = _json_or_error(final)
    return (0 if final.status_code == 200 and payload.get("status") == "succeeded" else 1), payload, final.status_code


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


# exit codes: 0 done; 1 the service answered with an error (or a job failed); 2 bad usage or an unreadable file
# (argparse's 2 too); 3 the service could not be reached or did not answer in time; 130 interrupted
EXIT_SERVICE_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 2, 3, 130


class ClientFailure(Exception):
    """One line for stderr, and the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def service_url(given: str | None) -> str:
    from service.config import DEFAULT_SERVICE_URL

    return (given or os.environ.get("OCR_URL") or DEFAULT_SERVICE_URL).rstrip("/")


def api_key(given: str | None) -> str | None:
    return given or os.environ.get("OCR_API_KEY") or None


def transport_failure(exc: Exception, url: str, timeout: float) -> ClientFailure:
    """What went wrong on the way to the service, said in one line with what to do about it."""
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        phase = {"ConnectTimeout": "connecting", "WriteTimeout": "sending the file", "PoolTimeout": "waiting for a "
                 "connection"}.get(type(exc).__name__, "waiting for the answer")
        return ClientFailure(f"no answer from {url} within {timeout:g} s ({phase}): the service may be overloaded or "
                             f"the page large; try again or raise --timeout", EXIT_UNREACHABLE)
    if isinstance(exc, httpx.ConnectError):
        reason = str(exc).split("] ", 1)[-1] or type(exc).__name__
        return ClientFailure(f"cannot connect to {url} ({reason}): is the service running? Start it with "
                             f"`ocr-serve serve`, or point --url / OCR_URL at it", EXIT_UNREACHABLE)
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return ClientFailure(f"invalid service URL {url!r} ({exc}): give --url or OCR_URL as http(s)://host:port",
                             EXIT_USAGE)
    return ClientFailure(f"the connection to {url} failed ({type(exc).__name__}: {exc}); try again",
                         EXIT_UNREACHABLE)


def answer_failure(payload: dict[str, Any], status: int, url: str) -> str:
    """The service's error answer in one line (for --text, whose stdout holds only recognised text)."""
    error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    what = f"{url} answered {status} " if status >= 400 else f"the job at {url} failed: "
    line = f"{what}{error.get('code', 'error')}: {error.get('message', '')}".rstrip(": ")
    if status == 401:
        line += " (pass --api-key or set OCR_API_KEY)"
    return line


def job_text(job: dict[str, Any]) -> str:
    """A job's pages' text in page order, separated by form feeds (as pdftotext does); failed pages are empty."""
    return "\f".join(((page.get("result") or {}).get("text") or "") for page in job.get("pages") or [])


def cmd_ocr(args: argparse.Namespace) -> int:
    url = service_url(args.url)
    try:
        return _ocr(args, url)
    except ClientFailure as failure:
        print(f"ocr-serve ocr: {failure}", file=sys.stderr)
        return failure.code
    except KeyboardInterrupt:
        print("ocr-serve ocr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _ocr(args: argparse.Namespace, url: str) -> int:
    import httpx

    path = Path(args.file)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ClientFailure(f"cannot read {args.file}: {exc.strerror or exc}", EXIT_USAGE) from None
    key = api_key(args.api_key)
    try:
        if data.startswith(b"%PDF-") or args.pages:  # documents go through /v1/jobs, with a progress bar
            code, payload, status = run_job(url=url, files=[path], form=_job_form(args), api_key=key,
                                            timeout=args.timeout)
        else:
            resp = httpx.post(url + "/v1/ocr", json=_ocr_body(args, path, data), timeout=args.timeout,
                              headers={"Authorization": f"Bearer {key}"} if key else {})
            payload, status = _json_or_error(resp), resp.status_code
            code = 0 if status < 400 else EXIT_SERVICE_ERROR
    except httpx.HTTPError as exc:
        raise transport_failure(exc, url, args.timeout) from None
    if args.text:
        if code != 0 and (status >= 400 or "error" in payload and "pages" not in payload):
            raise ClientFailure(answer_failure(payload, status, url), code)
        print(job_text(payload) if "pages" in payload else payload.get("text", ""))
    else:
        print(json.dumps(payload, ensure_ascii=False, indent=None if args.compact else 2,
                         separators=(",", ":") if args.compact else None))
    return code


def _ocr_body(args: argparse.Namespace, path: Path, data: bytes) -> dict[str, Any]:
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    body: dict[str, Any] = {"image": f"data:{mime};base64," + base64.b64encode(data).decode(), "task": args.task}
    if args.fields:
        body["fields"] = [f.strip() for f in args.fields.split(",") if f.strip()]
    if args.target_language:
        body["target_language"] = args.target_language
    if args.adapter:
        body["adapter"] = args.adapter
    return body


def _job_form(args: argparse.Namespace) -> dict[str, str]:
    form = {"task": args.task}
    for name in ("fields", "target_language", "adapter", "pages"):
        if getattr(args, name, None):
            form[name] = getattr(args, name)
    return form


def add_cli(sub) -> None:
    from service.config import DEFAULT_SERVICE_URL
    from service.tasks import TASKS

    p = sub.add_parser(
        "ocr", help="send a file to a running service and print the JSON result",
        description="Send an image (POST /v1/ocr) or a PDF (a job, progress on stderr) to a running service and "
        "print the result: JSON (default), --compact JSON or --text. Exit status: 0 done, 1 the service answered an "
        "error or a page failed, 2 bad usage or unreadable file, 3 service unreachable or no answer in time.")
    p.add_argument("file", help="image (PNG, JPEG, WebP, BMP, TIFF, GIF) or PDF to recognise")
    p.add_argument("--task", default="spotting", choices=list(TASKS),
                   help="what to recognise (default: %(default)s; the embedded engine does spotting and text)")
    p.add_argument("--url", help=f"base URL of the service (default: $OCR_URL, else {DEFAULT_SERVICE_URL})")
    p.add_argument("--api-key", help="API key (default: $OCR_API_KEY, else none: an open-mode service); prefer the "
                   "variable, which stays out of shell history")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the connection and for each answer (default: %(default)g)")
    p.add_argument("--fields", help="comma-separated field names for --task extract (default: none)")
    p.add_argument("--target-language", help="language to translate to, for --task translate (default: none)")
    p.add_argument("--adapter", help="LoRA adapter to run (default: none, the base model)")
    p.add_argument("--pages", help="PDF pages, e.g. 1-3,5 (default: all); PDFs run as a job with a progress bar on "
                   "stderr")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--text", action="store_true",
                        help="print only the recognised text; a PDF's pages are separated by form feeds "
                        "(default: the JSON result, indented)")
    output.add_argument("--compact", action="store_true", help="print the JSON result on one line (default: indented)")
    p.set_defaults(func=cmd_ocr)
