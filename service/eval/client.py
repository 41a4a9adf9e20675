"""Every document of a manifest through the running service's public API, a bounded number at a time.

Images go to `POST /v1/ocr` (multipart); PDFs to `POST /v1/jobs` with `pages` = the labelled pages, then
`GET /v1/jobs/{id}` until the job ends. 429, and 503 with `Retry-After`, are retried after the time the service asks
for (capped); a refused connection is retried with backoff. A mistake that would fail every document (bad key, a
task the engine cannot do, unknown adapter) stops the run with one line. Latency is what a client sees: the final
attempt of `POST /v1/ocr`, or a job's submission plus its creation-to-finish time as the service reports it.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import mimetypes
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from service.eval import EvalError
from service.eval.manifest import ManifestDocument
from service.cli.client import ProgressBar

# codes after which every other document would fail the same way: stop the run instead
FATAL_CODES = frozenset({"unauthorized", "forbidden", "unknown_task", "unsupported_task", "unknown_adapter",
                         "invalid_adapter"})
JOB_TERMINAL = frozenset({"succeeded", "partial", "failed", "cancelled"})
JOB_POLL_S = (0.1, 1.0)  # first and longest wait between job status reads


@dataclass
class PageOutcome:
    page: int
    result: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class DocumentOutcome:
    id: str
    pages: list[PageOutcome] = field(default_factory=list)
    error: str | None = None  # the document failed as a whole (HTTP error, timeout, a failed page)
    latency_ms: float | None = None
    retries: int = 0


@dataclass
class RequestOptions:
    task: str
    adapter: str | None = None
    target_language: str | None = None
    fields_for: dict[str, list[str]] = field(default_factory=dict)  # document id → extract fields


class DocumentFailed(Exception):
    pass


def retry_after_s(resp: httpx.Response) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or an HTTP date); None without a usable one."""
    value = resp.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_of(resp: httpx.Response) -> tuple[str, str]:
    """(code, message) of an API error body, or the HTTP status when the body is not one."""
    try:
        err = resp.json()["error"]
        return str(err["code"]), str(err.get("message", ""))
    except (ValueError, KeyError, TypeError):
        return f"http_{resp.status_code}", resp.text[:200]


class EvalClient:
    def __init__(self, url: str, *, api_key: str | None, timeout_s: float, retries: int, max_wait_s: float,
                 concurrency: int, transport: httpx.AsyncBaseTransport | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_wait_s = max_wait_s
        self.concurrency = concurrency
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s),
                                         limits=httpx.Limits(max_connections=concurrency + 2), transport=transport)

    async def close(self) -> None:
        await self._client.aclose()

    async def readiness(self) -> dict[str, Any]:
        """`GET /readyz`: the engine and model that will answer; one clear error if the service is down."""
        try:
            resp = await self._client.get("/readyz", timeout=min(self.timeout_s, 60.0))
        except httpx.ConnectError as exc:
            raise EvalError(f"cannot reach the OCR service at {self.url} ({_reason(exc)}); start it with "
                            "`ocr-serve serve` or pass --url") from None
        except httpx.TimeoutException:
            raise EvalError(f"the OCR service at {self.url} did not answer GET /readyz in time") from None
        except httpx.TransportError as exc:
            raise EvalError(f"cannot talk to the OCR service at {self.url} ({_reason(exc)})") from None
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status_code != 200:
            raise EvalError(f"the OCR service at {self.url} is not ready (GET /readyz answered {resp.status_code} "
                            f"{body.get('status', '')}); wait until it is, then run again")
        return body if isinstance(body, dict) else {}

    async def run(self, documents: list[ManifestDocument], options: RequestOptions,
                  progress: TextIO | None = sys.stderr) -> tuple[list[DocumentOutcome], float]:
        """Outcomes in manifest order and the run's wall time in seconds."""
        slots = asyncio.Semaphore(self.concurrency)
        bar = ProgressBar(sum(len(d.pages) for d in documents), progress) if progress else None
        done = 0
        outcomes: dict[str, DocumentOutcome] = {}

        async def one(doc: ManifestDocument) -> None:
            nonlocal done
            async with slots:
                outcome = await self.document(doc, options)
            outcomes[doc.id] = outcome
            done += len(doc.pages)
            if bar:
                bar.update(done, f"{doc.id}: {'ok' if outcome.error is None else 'error'}")

        started = time.monotonic()
        if bar:
            bar.update(0, "starting")
        try:
            async with asyncio.TaskGroup() as group:
                for doc in documents:
                    group.create_task(one(doc))
        except BaseExceptionGroup as group_error:
            fatal = _first(group_error, EvalError)
            if fatal is not None:
                raise fatal from None
            raise
        finally:
            if bar:
                bar.close()
        return [outcomes[d.id] for d in documents], time.monotonic() - started

    async def document(self, doc: ManifestDocument, options: RequestOptions) -> DocumentOutcome:
        outcome = DocumentOutcome(doc.id)
        try:
            if doc.kind == "pdf":
                await self._job(doc, options, outcome)
            else:
                await self._image(doc, options, outcome)
        except DocumentFailed as exc:
            outcome.error = str(exc)
        return outcome

    def _form(self, doc: ManifestDocument, options: RequestOptions) -> dict[str, str]:
        form = {"task": options.task}
        if options.adapter:
            form["adapter"] = options.adapter
        if options.target_language:
            form["target_language"] = options.target_language
        if doc.id in options.fields_for:
            form["fields"] = json.dumps(options.fields_for[doc.id], ensure_ascii=False)
        return form

    async def _image(self, doc: ManifestDocument, options: RequestOptions, outcome: DocumentOutcome) -> None:
        mime = mimetypes.guess_type(doc.path.name)[0] or "application/octet-stream"
        files = {"file": (doc.path.name, doc.path.read_bytes(), mime)}
        resp, elapsed = await self._send("POST", "/v1/ocr", outcome, files=files, data=self._form(doc, options))
        if resp.status_code != 200:
            raise DocumentFailed(self._failure(resp))
        outcome.latency_ms = elapsed * 1000
        outcome.pages = [PageOutcome(1, resp.json())]

    async def _job(self, doc: ManifestDocument, options: RequestOptions, outcome: DocumentOutcome) -> None:
        form = self._form(doc, options) | {"pages": ",".join(str(p.page) for p in doc.pages)}
        files = {"file": (doc.path.name, doc.path.read_bytes(), "application/pdf")}
        resp, elapsed = await self._send("POST", "/v1/jobs", outcome, files=files, data=form)
        if resp.status_code != 202:
            raise DocumentFailed(self._failure(resp))
        job_id = resp.json()["id"]
        wait = JOB_POLL_S[0]
        deadline = time.monotonic() + self.timeout_s * max(1, len(doc.pages))
        while True:
            await asyncio.sleep(wait)
            status, _ = await self._send("GET", f"/v1/jobs/{job_id}", outcome)
            if status.status_code != 200:
                raise DocumentFailed(self._failure(status))
            job = status.json()
            if job["status"] in JOB_TERMINAL:
                break
            if time.monotonic() > deadline:
                await self._client.delete(f"/v1/jobs/{job_id}")
                raise DocumentFailed(f"the job did not finish within {self.timeout_s:g}s per page (cancelled)")
            wait = min(wait * 1.5, JOB_POLL_S[1])
        outcome.latency_ms = elapsed * 1000 + float(job.get("timings_ms", {}).get("total", 0.0))
        by_page = {p["page"]: p for p in job.get("pages") or []}
        for truth in doc.pages:
            page = by_page.get(truth.page)
            if page is None or page["status"] != "ok":
                err = (page or {}).get("error") or {"code": job["status"], "message": "no result"}
                raise DocumentFailed(f"page {truth.page} failed: {err['code']}: {err.get('message', '')}")
            outcome.pages.append(PageOutcome(truth.page, page["result"]))

    async def _send(self, method: str, path: str, outcome: DocumentOutcome, **kwargs) -> tuple[httpx.Response, float]:
        """The response of the last attempt and its duration. Retries 429/503 that carry `Retry-After` (waiting
        that long, at most max_wait_s) and refused connections (backoff), `retries` times at most."""
        for attempt in range(self.retries + 1):
            started = time.monotonic()
            try:
                resp = await self._client.request(method, path, **kwargs)
            except httpx.TimeoutException:
                raise DocumentFailed(f"no answer within {self.timeout_s:g}s ({method} {path})") from None
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise DocumentFailed(f"{method} {path}: {_reason(exc)}") from None
                outcome.retries += 1
                await asyncio.sleep(min(2.0 ** attempt, self.max_wait_s))
                continue
            elapsed = time.monotonic() - started
            wait = retry_after_s(resp) if resp.status_code in (429, 503) else None
            if wait is None or attempt == self.retries:
                return resp, elapsed
            outcome.retries += 1
            await asyncio.sleep(min(wait, self.max_wait_s))
        raise AssertionError("unreachable")

    def _failure(self, resp: httpx.Response) -> str:
        code, message = error_of(resp)
        if code in FATAL_CODES:
            raise EvalError(f"the service refused the run: {resp.status_code} {code}: {message}")
        return f"{resp.status_code} {code}: {message}"


def _first(group: BaseExceptionGroup, kind: type) -> BaseException | None:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _first(exc, kind)
            if found is not None:
                return found
        elif isinstance(exc, kind):
            return exc
    return None


def _reason(exc: BaseException) -> str:
    """A short cause: "connection refused" when that is what lies under httpx's wrapping, else its message."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return "connection refused"
        seen = seen.__cause__ or seen.__context__
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
