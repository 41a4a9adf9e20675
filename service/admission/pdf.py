"""PDF admission: bytes → validated page list → rasterised pages, every PDFium call inside a bounded sandbox.

PDFium parses hostile input, so it never runs in the ingress process: a worker subprocess
(`python -m service.admission.pdf`) opens the document under an address-space limit (RLIMIT_AS) and a CPU-time limit,
and the parent kills it when an answer does not arrive within `pdf_render_timeout_s`. A PDF bomb (nested Flate
streams in a content stream, a huge embedded image) therefore ends as a dead worker and a 400 `invalid_pdf`, never as
an ingress out of memory.

Work is bounded per document too (DocumentBudget): `pdf_document_cpu_s` CPU seconds over every worker the document
needs (RLIMIT_CPU of each is what is left) and `pdf_document_timeout_s` seconds of waiting for them. A worker does
nothing it was not asked for: it opens the document and reports its page boxes, which is cheap whatever the content
streams hold, then loads or renders one page per command, so a caller pays (rate limit) before each page's work.

Checks, in order: magic bytes, size and chained filters (here, before any subprocess) → open (corrupt →
`invalid_pdf`), encryption (any security handler → `invalid_pdf`), page count (`single_page`: exactly one) and
`pages` range (`too_many_pages`), page boxes → per page, on request: load (parses its content streams: the Flate bomb
fires here; page box over the PDF spec's 14 400 pt per side → `invalid_pdf`) → render. The DPI is chosen per page
from a pixel budget (the engine's image-token budget) and capped by `max_pdf_dpi`, so a page never renders larger
than what the engine would keep.
"""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from service.admission.budget import EMBEDDED_MAX_SIDE, FACTOR, PROMPT_OVERHEAD_TOKENS
from service.errors import OCRError

# PDF 1.7 (ISO 32000-1) Annex C: the largest page is 14 400 × 14 400 user units (200 in); bigger boxes are bombs.
PDF_MAX_PAGE_SIDE_PT = 14_400.0
POINTS_PER_INCH = 72.0
_HEADER = struct.Struct(">I")  # length prefix of each worker message header (JSON)
_MAX_HEADER_BYTES = 1 << 20
_WORKER_ENV = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "HOME", "TMPDIR")
# Filter arrays in the raw bytes; two decompressing filters in one chain multiply their ratios (~1000× each for
# Flate): a few KiB can expand to many GiB. Legitimate writers never chain them. (Streams inside compressed object
# streams are invisible here; the sandbox's memory and time bounds catch those.)
_FILTER_ARRAY = re.compile(rb"/Filter\s*\[([^\]]{0,512})\]")
_EXPANDING_FILTER = re.compile(rb"/(?:FlateDecode|Fl|LZWDecode|LZW|RunLengthDecode|RL)(?![A-Za-z])")


@dataclass(frozen=True)
class PdfPage:
    """A selected page: its 1-based number in the document and its box in points (rotation applied)."""

    number: int
    width_pt: float
    height_pt: float


@dataclass(frozen=True)
class PdfInfo:
    page_count: int  # pages in the document
    pages: list[PdfPage]  # the selected pages, in order


@dataclass
class RenderedPage:
    """One rasterised page (RGB) or the reason it could not be rasterised (`error` is an OCRError body)."""

    number: int
    image: Any = None  # PIL.Image.Image (RGB)
    dpi: float = 0.0
    render_ms: float = 0.0
    error: OCRError | None = None


# --- pure helpers (shared by the parent and the worker) ------------------------------------------------------------

def check_pdf_bytes(data: bytes, max_bytes: int) -> None:
    if not data:
        raise OCRError("empty_image", "the PDF is empty")
    if not data.startswith(b"%PDF-"):
        raise OCRError("unsupported_media_type", "the file is not a PDF (no %PDF- header)")
    if len(data) > max_bytes:
        raise OCRError("payload_too_large", f"the PDF is {len(data)} bytes; at most {max_bytes} accepted")
    for match in _FILTER_ARRAY.finditer(data):
        if len(_EXPANDING_FILTER.findall(match.group(1))) > 1:
            raise OCRError("invalid_pdf", "the PDF chains several decompression filters on one stream "
                           "(nested compressed streams: a PDF bomb)")


def parse_page_range(spec: str | None, page_count: int, max_pages: int) -> list[int]:
    """`"1-3,5,8-"` → [1, 2, 3, 5, 8, ..., page_count] (1-based, ascending, unique). None/empty = all pages."""
    if page_count < 1:
        raise OCRError("invalid_pdf", "the document has no pages")
    if spec is None or not spec.strip():
        numbers = list(range(1, page_count + 1))
    else:
        chosen: set[int] = set()
        for part in spec.replace(" ", "").split(","):
            try:
                if "-" in part:
                    lo_s, hi_s = part.split("-", 1)
                    lo = int(lo_s) if lo_s else 1
                    hi = int(hi_s) if hi_s else page_count
                else:
                    lo = hi = int(part)
            except ValueError:
                raise OCRError("validation_error", f"pages: {part!r} is not a page number or range like 2-5") from None
            if lo < 1 or hi < lo:
                raise OCRError("validation_error", f"pages: {part!r} is not a valid range")
            if lo > page_count:
                raise OCRError("validation_error", f"pages: {part!r} is beyond the last page ({page_count})")
            if len(chosen) + (min(hi, page_count) - lo + 1) > max_pages:
                raise OCRError("too_many_pages", f"more than {max_pages} pages selected")
            chosen.update(range(lo, min(hi, page_count) + 1))
        numbers = sorted(chosen)
    if len(numbers) > max_pages:
        raise OCRError("too_many_pages", f"the document has {len(numbers)} pages (selected); at most {max_pages} "
                       "accepted — send fewer pages or a `pages` range")
    return numbers


def check_page_box(number: int, width_pt: float, height_pt: float) -> None:
    if not (width_pt > 0 and height_pt > 0) or not math.isfinite(width_pt * height_pt):
        raise OCRError("invalid_pdf", f"page {number} has an empty or invalid page box")
    if max(width_pt, height_pt) > PDF_MAX_PAGE_SIDE_PT:
        raise OCRError("invalid_pdf", f"page {number} box is {width_pt:.0f}x{height_pt:.0f} pt; the PDF limit is "
                       f"{PDF_MAX_PAGE_SIDE_PT:.0f} pt per side")


def choose_dpi(width_pt: float, height_pt: float, *, max_pixels: int, max_side: int, max_dpi: float) -> float:
    """Highest DPI ≤ max_dpi at which the page stays within `max_pixels` and `max_side` pixels."""
    w_in, h_in = width_pt / POINTS_PER_INCH, height_pt / POINTS_PER_INCH
    by_area = math.sqrt(max_pixels / (w_in * h_in))
    by_side = max_side / max(w_in, h_in)
    return max(1.0, min(float(max_dpi), by_area, by_side))


def page_pixel_budget(settings, engine_name: str, max_tokens: int | None = None) -> int:
    """Pixels a rendered page may have: what the engine keeps of it (so rendering larger would be wasted work).

    VLM engines: the image-token budget of the context (one token per 32×32 block after the output budget) capped by
    the processor's max_pixels; the embedded engine: its longest-side cap. Never above `max_image_pixels`.
    """
    if engine_name == "embedded":
        budget = EMBEDDED_MAX_SIDE * EMBEDDED_MAX_SIDE
    else:
        tokens = min(max_tokens or settings.engine.max_output_tokens, settings.engine.max_output_tokens)
        room = max(1, settings.engine.max_model_len - PROMPT_OVERHEAD_TOKENS - tokens)
        budget = min(settings.engine.max_engine_image_pixels, room * FACTOR * FACTOR)
    return max(1024, min(budget, settings.limits.max_image_pixels))


# --- parent side ----------------------------------------------------------------------------------------------------

@dataclass
class DocumentBudget:
    """What one document may still spend in the sandbox, over every worker process it needs: CPU seconds (each
    worker runs under RLIMIT_CPU set to what is left) and seconds the ingress waits for a worker's answer (time a job
    spends waiting for the engine or its tenant's tokens is not counted: workers only work when asked)."""

    cpu_s: float
    wait_s: float

    @classmethod
    def for_settings(cls, settings) -> "DocumentBudget":
        return cls(cpu_s=settings.pdf.document_cpu_s, wait_s=settings.pdf.document_timeout_s)

    def exhausted(self) -> OCRError | None:
        if self.cpu_s <= 0:
            return OCRError("invalid_pdf", "the PDF used up its CPU budget (pdf_document_cpu_s) before this page: "
                            "overly complex or hostile content")
        if self.wait_s <= 0:
            return OCRError("invalid_pdf", "the PDF used up its time budget (pdf_document_timeout_s) before this "
                            "page: overly complex or hostile content")
        return None


class _Worker:
    """One sandboxed PDFium subprocess. It opens the document, answers with its page boxes, then does one command
    at a time (load or render a page) until its stdin closes. Messages are length-prefixed JSON headers with an
    optional binary payload."""

    def __init__(self, request: dict[str, Any], data: bytes, timeout_s: float, budget: DocumentBudget):
        self.timeout_s = timeout_s
        self.budget = budget
        self.closed = False
        self._status = 0
        self._closing = threading.Lock()  # a request's cancel (event loop) may close it while its thread reads
        # a minimal environment: the sandbox needs no secrets (Redis URL, keys) to rasterise a page
        env = {k: v for k, v in os.environ.items() if k in _WORKER_ENV}
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        request = {**request, "cpu_s": max(1, math.ceil(budget.cpu_s))}
        self.proc = subprocess.Popen([sys.executable, "-m", "service.admission.pdf"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        header = json.dumps(request).encode()
        self._write(_HEADER.pack(len(header)) + header + _HEADER.pack(len(data)) + data)
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._selector.register(self._fd, selectors.EVENT_READ)

    def _write(self, raw: bytes) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(raw)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # the worker died; reading reports it

    def command(self, command: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        raw = json.dumps(command).encode()
        self._write(_HEADER.pack(len(raw)) + raw)
        return self.read()

    def _read_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                raise TimeoutError
            chunk = os.read(self._fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def read(self) -> tuple[dict[str, Any], bytes]:
        """Next message (an `error` message is returned, not raised); a dead, stuck or misbehaving worker, or one
        past the document's budget, raises OCRError `invalid_pdf` (and is closed)."""
        started = time.monotonic()
        page_deadline = started + self.timeout_s
        deadline = min(page_deadline, started + self.budget.wait_s)
        try:
            (size,) = _HEADER.unpack(self._read_exact(_HEADER.size, deadline))
            if size > _MAX_HEADER_BYTES:
                raise EOFError
            header = json.loads(self._read_exact(size, deadline))
            payload = self._read_exact(header.get("nbytes", 0), deadline) if header.get("nbytes") else b""
        except TimeoutError:
            self.close()
            if deadline < page_deadline:
                raise OCRError("invalid_pdf", "the PDF used up its time budget (pdf_document_timeout_s): overly "
                               "complex or hostile content") from None
            raise OCRError("invalid_pdf", f"rasterising the PDF took longer than {self.timeout_s:g}s per page "
                           "(PDF bomb or overly complex page)") from None
        except (EOFError, ValueError, OSError):
            status = self.close()
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
                self.budget.cpu_s = min(0.0, self.budget.cpu_s)  # its RLIMIT_CPU was what was left
                raise OCRError("invalid_pdf", "the PDF used up its CPU budget (pdf_document_cpu_s): overly complex "
                               "or hostile content") from None
            raise OCRError("invalid_pdf", "the PDF could not be processed within the memory and time limits "
                           "(PDF bomb, e.g. nested compressed streams, or a corrupt file)") from None
        finally:
            self.budget.wait_s -= time.monotonic() - started
        return header, payload

    def close(self) -> int:
        """Stop the worker (killed: between commands it holds nothing worth a goodbye) and charge its CPU time to the
        document; returns its wait status. Any thread; fast enough for the event loop. The worker is reaped here,
        with os.wait4 for its CPU time, never through Popen.poll/wait."""
        with self._closing:
            if self.closed:
                return self._status
            self.closed = True
            reaped = self._reap(os.WNOHANG)
            if reaped is None:
                os.kill(self.proc.pid, signal.SIGKILL)
                reaped = self._reap(0)
            self._status, usage = reaped
            self.proc.returncode = os.waitstatus_to_exitcode(self._status)
            self.budget.cpu_s -= usage.ru_utime + usage.ru_stime
            self._selector.close()
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except (OSError, AttributeError):
                    pass
            return self._status

    def __del__(self):  # a session whose request went away before anyone closed it: no worker left behind
        if not getattr(self, "closed", True):
            self.close()

    def _reap(self, options: int):
        pid, status, usage = os.wait4(self.proc.pid, options)
        return (status, usage) if pid else None

    def kill(self) -> None:
        """From any thread: a call blocked in `read` returns with an error."""
        if not self.closed:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class PdfSession:
    """One document in the sandbox, page by page, all under one DocumentBudget. Blocking: run the calls on the
    admission pool (service/admission/workpool.py), one at a time.

    `open()` starts a worker, which opens the document (corrupt or encrypted → `invalid_pdf`), counts its pages
    (`single_page` and more than one → `too_many_pages`, without loading any page), selects the pages (`pages`
    range) and reads their boxes (no content stream is parsed for that). `load(n)` parses a page's content streams,
    `render(n, max_pixels)` rasterises it. A worker that dies or hangs on a page makes that page fail alone; the next
    call starts a fresh one while the document's budget lasts. `stop()` (any thread) kills the worker and ends the
    session; `close()` ends it normally.
    """

    def __init__(self, data: bytes, settings, *, pages: str | None = None, single_page: bool = False,
                 budget: DocumentBudget | None = None):
        check_pdf_bytes(data, settings.jobs.max_bytes)
        self._data = data
        self._settings = settings
        self._pages_spec = pages
        self._single_page = single_page
        self.budget = budget or DocumentBudget.for_settings(settings)
        self.info: PdfInfo | None = None
        self._worker: _Worker | None = None
        self._stopped = False

    def _start(self) -> _Worker:
        s = self._settings
        if self._stopped:
            raise OCRError("invalid_pdf", "the document's processing was stopped")
        spent = self.budget.exhausted()
        if spent is not None:
            raise spent
        numbers = [p.number for p in self.info.pages] if self.info else None
        request = {"pages": self._pages_spec, "numbers": numbers, "single_page": self._single_page,
                   "memory_mb": s.pdf.render_memory_mb, "max_pages": s.jobs.max_pages}
        worker = self._worker = _Worker(request, self._data, s.pdf.render_timeout_s, self.budget)
        if self._stopped:  # stop() ran while the worker started
            worker.close()
            raise OCRError("invalid_pdf", "the document's processing was stopped")
        header, _ = worker.read()
        if header.get("type") == "error":
            worker.close()
            self._stopped = True  # the document itself failed: no page of it will do better
            raise OCRError(header["code"], header["message"])
        if self.info is None:
            self.info = PdfInfo(page_count=header["page_count"],
                                pages=[PdfPage(p["number"], p["width_pt"], p["height_pt"]) for p in header["pages"]])
        return worker

    def open(self) -> PdfInfo:
        if self.info is None:
            self._start()
        assert self.info is not None
        return self.info

    def _command(self, command: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        worker = self._worker if self._worker is not None and not self._worker.closed else self._start()
        try:
            return worker.command(command)
        finally:
            if worker.closed:  # it died or hung on this page: the next call starts another
                self._worker = None

    def load(self, number: int) -> None:
        """Parse the page's content streams (where a content-stream bomb goes off); OCRError when it cannot be."""
        header, _ = self._command({"op": "load", "number": number})
        if header.get("type") == "error":
            raise OCRError(header["code"], header["message"])

    def render(self, number: int, max_pixels: int) -> RenderedPage:
        """The page as RGB pixels at the highest DPI within `max_pixels`, or with `error` (never raises for the
        page's own failure)."""
        from PIL import Image

        s = self._settings
        try:
            header, payload = self._command({"op": "render", "number": number, "max_pixels": max_pixels,
                                             "max_side": s.limits.max_image_side, "max_dpi": s.pdf.max_dpi})
        except OCRError as exc:
            return RenderedPage(number=number, error=exc)
        if header.get("number") != number:  # protocol violation: treat like a crash
            self.close()
            return RenderedPage(number=number, error=OCRError("invalid_pdf", "the PDF renderer failed"))
        if header.get("type") == "error":
            return RenderedPage(number=number, error=OCRError(header["code"], header["message"]))
        image = Image.frombytes("RGB", (header["width"], header["height"]), payload)
        return RenderedPage(number=number, image=image, dpi=header["dpi"], render_ms=header["render_ms"])

    def stop(self) -> None:
        """From any thread: kill the worker; every later call fails."""
        self._stopped = True
        worker = self._worker
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def __enter__(self) -> "PdfSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rendered_size(page: PdfPage, settings, max_pixels: int) -> tuple[int, int]:
    """Pixels the page would be rendered at (the DPI rule of the worker)."""
    dpi = choose_dpi(page.width_pt, page.height_pt, max_dpi=settings.pdf.max_dpi, max_pixels=max_pixels,
                     max_side=settings.limits.max_image_side)
    return max(1, round(page.width_pt * dpi / POINTS_PER_INCH)), max(1, round(page.height_pt * dpi / POINTS_PER_INCH))


def single_page_pixel_budget(settings) -> int:
    """What a single-page PDF on `POST /v1/ocr` is rendered to."""
    return min(settings.engine.max_engine_image_pixels, settings.limits.max_image_pixels)


# --- worker side (runs in the sandboxed subprocess) -------------------------------------------------------------------

def _send(out, header: dict[str, Any], payload: bytes = b"") -> None:
    if payload:
        header = {**header, "nbytes": len(payload)}
    raw = json.dumps(header).encode()
    out.write(_HEADER.pack(len(raw)) + raw)
    if payload:
        out.write(payload)
    out.flush()


def _worker_open(pdfium, data: bytes):
    try:
        doc = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        if getattr(exc, "err_code", None) == 4:  # FPDF_ERR_PASSWORD
            raise OCRError("invalid_pdf", "the PDF is encrypted (password protected); send an unencrypted PDF")
        raise OCRError("invalid_pdf", "the PDF is corrupt or not a PDF") from None
    if pdfium.raw.FPDF_GetSecurityHandlerRevision(doc.raw) != -1:
        raise OCRError("invalid_pdf", "the PDF is encrypted; send an unencrypted PDF")
    return doc


def _page_box(doc, index: int) -> tuple[float, float]:
    width, height = doc.get_page_size(index)
    return float(width), float(height)


def _worker(request: dict[str, Any], data: bytes, commands, out) -> None:
    import pypdfium2 as pdfium

    doc = _worker_open(pdfium, data)
    page_count = len(doc)
    if request.get("single_page") and page_count != 1:
        raise OCRError("too_many_pages", f"the PDF has {page_count} pages; POST /v1/ocr takes single-page PDFs — use "
                       "POST /v1/jobs for multi-page documents")
    numbers = request.get("numbers") or parse_page_range(request.get("pages"), page_count, request["max_pages"])
    pages = []
    for number in numbers:  # boxes only (rotation applied): no page is loaded, no content stream parsed
        width, height = _page_box(doc, number - 1)
        pages.append({"number": number, "width_pt": width, "height_pt": height})
    _send(out, {"type": "info", "page_count": page_count, "pages": pages})
    while True:
        command = _read_command(commands)
        if command is None:
            return
        number = command["number"]
        started = time.perf_counter()
        try:
            if not 1 <= number <= page_count:
                raise OCRError("validation_error", f"page {number} does not exist")
            width, height = _page_box(doc, number - 1)
            check_page_box(number, width, height)
            page = doc[number - 1]  # FPDF_LoadPage parses the content streams (decompression happens here)
            if command["op"] == "load":
                page.close()
                _send(out, {"type": "loaded", "number": number})
                continue
            dpi = choose_dpi(width, height, max_pixels=command["max_pixels"], max_side=command["max_side"],
                             max_dpi=command["max_dpi"])
            image = page.render(scale=dpi / POINTS_PER_INCH, may_draw_forms=True).to_pil().convert("RGB")
            page.close()
        except OCRError as exc:  # this page only; the next pages still render
            _send(out, {"type": "error", "number": number, "code": exc.code, "message": exc.message})
            continue
        _send(out, {"type": "page", "number": number, "width": image.width, "height": image.height,
                    "dpi": round(dpi, 2), "render_ms": round((time.perf_counter() - started) * 1000, 2)},
              image.tobytes())
        del image


def _read_command(stdin) -> dict[str, Any] | None:
    raw = stdin.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        return None  # the parent closed our stdin: done
    (size,) = _HEADER.unpack(raw)
    return json.loads(stdin.read(size))


def _worker_main() -> int:
    import resource

    stdin, out = sys.stdin.buffer, sys.stdout.buffer
    (size,) = _HEADER.unpack(stdin.read(_HEADER.size))
    request = json.loads(stdin.read(size))
    (length,) = _HEADER.unpack(stdin.read(_HEADER.size))
    data = stdin.read(length)
    memory = request["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # what is left of the document's CPU budget (the parent charges every worker's CPU time to it): SIGXCPU past it
    cpu = request["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    try:
        _worker(request, data, stdin, out)
    except OCRError as exc:
        _send(out, {"type": "error", "code": exc.code, "message": exc.message})
    except MemoryError:
        return 3  # the parent reports the memory bound
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main())
