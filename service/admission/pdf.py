"""PDF admission: bytes → validated page list → rasterised pages, every PDFium call inside a bounded sandbox.

PDFium parses hostile input, so it never runs in the ingress process: a short-lived worker subprocess
(`python -m service.admission.pdf`) opens the document under an address-space limit (RLIMIT_AS) and a CPU-time limit,
and the parent kills it when a message does not arrive within `pdf_render_timeout_s`. A PDF bomb (nested Flate
streams in a content stream, a huge embedded image) therefore ends as a dead worker and a 400 `invalid_pdf`, never as
an ingress out of memory.

Checks, in order: magic bytes and size (here, before any subprocess) → open (corrupt → `invalid_pdf`), encryption
(any security handler → `invalid_pdf`), page count and `pages` range (`too_many_pages`), page boxes (larger than the
PDF spec's 14 400 pt per side → `invalid_pdf`) → load each selected page (parses its content streams: the Flate bomb
fires here) → render. The DPI is chosen per page from a pixel budget (the engine's image-token budget) and capped by
`max_pdf_dpi`, so a page never renders larger than what the engine would keep.
"""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

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
    from service.admission.budget import FACTOR, PROMPT_OVERHEAD_TOKENS

    if engine_name == "embedded":
        from service.api.ocr import EMBEDDED_MAX_SIDE

        budget = EMBEDDED_MAX_SIDE * EMBEDDED_MAX_SIDE
    else:
        tokens = min(max_tokens or settings.max_output_tokens, settings.max_output_tokens)
        room = max(1, settings.max_model_len - PROMPT_OVERHEAD_TOKENS - tokens)
        budget = min(settings.max_engine_image_pixels, room * FACTOR * FACTOR)
    return max(1024, min(budget, settings.max_image_pixels))


# --- parent side ----------------------------------------------------------------------------------------------------

def _limits(settings) -> dict[str, Any]:
    return {"memory_mb": settings.pdf_render_memory_mb, "cpu_s": max(1, math.ceil(settings.pdf_render_timeout_s)),
            "max_pages": settings.max_pdf_pages}


class _Worker:
    """One sandboxed PDFium subprocess; messages are length-prefixed JSON headers with an optional binary payload."""

    def __init__(self, request: dict[str, Any], data: bytes, timeout_s: float):
        self.timeout_s = timeout_s
        # a minimal environment: the sandbox needs no secrets (Redis URL, keys) to rasterise a page
        env = {k: v for k, v in os.environ.items() if k in _WORKER_ENV}
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "service.admission.pdf"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        header = json.dumps(request).encode()
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(_HEADER.pack(len(header)) + header + _HEADER.pack(len(data)))
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the worker died early; reading reports it
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._selector.register(self._fd, selectors.EVENT_READ)

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
        """Next message (an `error` message is returned, not raised); a dead, stuck or misbehaving worker raises
        OCRError `invalid_pdf`."""
        deadline = time.monotonic() + self.timeout_s
        try:
            (size,) = _HEADER.unpack(self._read_exact(_HEADER.size, deadline))
            if size > _MAX_HEADER_BYTES:
                raise EOFError
            header = json.loads(self._read_exact(size, deadline))
            payload = self._read_exact(header.get("nbytes", 0), deadline) if header.get("nbytes") else b""
        except TimeoutError:
            self.close()
            raise OCRError("invalid_pdf", f"rasterising the PDF took longer than {self.timeout_s:g}s per page "
                           "(PDF bomb or overly complex page)") from None
        except (EOFError, ValueError, OSError):
            self.close()
            raise OCRError("invalid_pdf", "the PDF could not be processed within the memory and time limits "
                           "(PDF bomb, e.g. nested compressed streams, or a corrupt file)") from None
        return header, payload

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._selector.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def inspect_pdf(data: bytes, settings, pages: str | None = None) -> PdfInfo:
    """Validate the document and the selected pages (opened, boxes checked, content streams parsed) without
    rendering. Raises OCRError: `invalid_pdf`, `too_many_pages`, `unsupported_media_type`, `payload_too_large`."""
    check_pdf_bytes(data, settings.max_pdf_bytes)
    worker = _Worker({"op": "inspect", "pages": pages, **_limits(settings)}, data, settings.pdf_render_timeout_s)
    try:
        header, _ = worker.read()
        while header.get("type") == "progress":  # one per loaded page: the timeout is per page, not per document
            header, _ = worker.read()
    finally:
        worker.close()
    if header.get("type") == "error":
        raise OCRError(header["code"], header["message"])
    return PdfInfo(page_count=header["page_count"],
                   pages=[PdfPage(p["number"], p["width_pt"], p["height_pt"]) for p in header["pages"]])


class PageRenderer:
    """Rasterise pages one by one: iterate it (blocking; run it in a thread). The worker renders ahead only as far as
    the pipe buffer allows, so memory stays bounded by the consumer's pace.

    A page that cannot be rendered (the worker died, hung or refused it) is yielded with `error`; the worker is then
    restarted for the following pages, so one bad page never loses the others. `stop()` (any thread) kills the
    worker and ends the iteration.
    """

    def __init__(self, data: bytes, settings, numbers: list[int], max_pixels: int):
        self._data = data
        self._settings = settings
        self._numbers = list(numbers)
        self._max_pixels = max_pixels
        self._worker: _Worker | None = None
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True
        worker = self._worker
        if worker is not None and worker.proc.poll() is None:
            worker.proc.kill()

    def __iter__(self) -> Iterator[RenderedPage]:
        from PIL import Image

        s = self._settings
        remaining = list(self._numbers)
        while remaining and not self._stopped:
            request = {"op": "render", "numbers": remaining, "max_pixels": self._max_pixels,
                       "max_side": s.max_image_side, "max_dpi": s.max_pdf_dpi, **_limits(s)}
            worker = self._worker = _Worker(request, self._data, s.pdf_render_timeout_s)
            try:
                while remaining and not self._stopped:
                    number = remaining[0]
                    try:
                        header, payload = worker.read()
                    except OCRError as exc:  # the worker died or hung on this page: report it, restart for the rest
                        remaining.pop(0)
                        yield RenderedPage(number=number, error=exc)
                        break
                    if header.get("type") == "error" and header.get("number") is None:  # the document failed
                        error = OCRError(header["code"], header["message"])
                        for failed in remaining:
                            yield RenderedPage(number=failed, error=error)
                        return
                    if header.get("number") != number:  # protocol violation: treat like a crash
                        remaining.pop(0)
                        yield RenderedPage(number=number, error=OCRError("invalid_pdf", "the PDF renderer failed"))
                        break
                    remaining.pop(0)
                    if header.get("type") == "error":
                        yield RenderedPage(number=number, error=OCRError(header["code"], header["message"]))
                        continue
                    image = Image.frombytes("RGB", (header["width"], header["height"]), payload)
                    yield RenderedPage(number=number, image=image, dpi=header["dpi"], render_ms=header["render_ms"])
            finally:
                worker.close()
                self._worker = None


def render_pages(data: bytes, settings, numbers: list[int], max_pixels: int) -> Iterator[RenderedPage]:
    """Rasterise the given pages in order (see PageRenderer)."""
    return iter(PageRenderer(data, settings, numbers, max_pixels))


def render_single_page(data: bytes, settings, max_pixels: int | None = None):
    """`POST /v1/ocr` with a PDF: the document must have exactly one page; returns a DecodedImage."""
    from service.admission.images import DecodedImage

    check_pdf_bytes(data, min(settings.max_pdf_bytes, settings.max_body_bytes))
    info = inspect_pdf(data, settings)
    if info.page_count != 1:
        raise OCRError("too_many_pages", f"the PDF has {info.page_count} pages; POST /v1/ocr takes single-page PDFs "
                       "— use POST /v1/jobs for multi-page documents")
    budget = max_pixels or min(settings.max_engine_image_pixels, settings.max_image_pixels)
    (page,) = list(render_pages(data, settings, [1], budget))
    if page.error is not None:
        raise page.error
    return DecodedImage(image=page.image, format="PDF", width=page.image.width, height=page.image.height)


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


def _worker(request: dict[str, Any], data: bytes, out) -> None:
    import pypdfium2 as pdfium

    doc = _worker_open(pdfium, data)
    page_count = len(doc)
    if request["op"] == "inspect":
        numbers = parse_page_range(request.get("pages"), page_count, request["max_pages"])
        pages = []
        for number in numbers:
            width, height = _page_box(doc, number - 1)
            check_page_box(number, width, height)
            page = doc[number - 1]  # FPDF_LoadPage parses the content streams (decompression happens here)
            rotated = page.get_rotation() in (90, 270)
            page.close()
            pages.append({"number": number, "width_pt": height if rotated else width,
                          "height_pt": width if rotated else height})
            _send(out, {"type": "progress", "number": number})
        _send(out, {"type": "info", "page_count": page_count, "pages": pages})
        return
    for number in request["numbers"]:
        started = time.perf_counter()
        try:
            if not 1 <= number <= page_count:
                raise OCRError("validation_error", f"page {number} does not exist")
            width, height = _page_box(doc, number - 1)
            check_page_box(number, width, height)
            dpi = choose_dpi(width, height, max_pixels=request["max_pixels"], max_side=request["max_side"],
                             max_dpi=request["max_dpi"])
            page = doc[number - 1]
            image = page.render(scale=dpi / POINTS_PER_INCH, may_draw_forms=True).to_pil().convert("RGB")
            page.close()
        except OCRError as exc:  # this page only; the next pages still render
            _send(out, {"type": "error", "number": number, "code": exc.code, "message": exc.message})
            continue
        _send(out, {"type": "page", "number": number, "width": image.width, "height": image.height,
                    "dpi": round(dpi, 2), "render_ms": round((time.perf_counter() - started) * 1000, 2)},
              image.tobytes())


def _worker_main() -> int:
    import resource

    stdin, out = sys.stdin.buffer, sys.stdout.buffer
    (size,) = _HEADER.unpack(stdin.read(_HEADER.size))
    request = json.loads(stdin.read(size))
    (length,) = _HEADER.unpack(stdin.read(_HEADER.size))
    data = stdin.read(length)
    memory = request["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # CPU seconds for the whole document: the per-message wall-clock timeout in the parent is the main bound
    cpu = request["cpu_s"] * (1 + len(request.get("numbers") or [request["max_pages"]]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    try:
        _worker(request, data, out)
    except OCRError as exc:
        _send(out, {"type": "error", "code": exc.code, "message": exc.message})
    except MemoryError:
        return 3  # the parent reports the memory bound
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main())
