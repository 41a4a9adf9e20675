"""The work of a batch on Ray Data, in the order a page flows:

    read (CPU task, one per document): the file's bytes from its store (size checked first), its sha256, then
      an image: its header probed and decoded with the API's limits (service.pipeline.page.probe_upload,
        service.imaging.decode_image)
      a PDF: opened in the sandbox (service.admission.pdf.PdfSession), each page not yet written rendered there at
        the engine's pixel budget
      → one row per page: its RGB pixels, or its error record
    engine (an actor pool, EngineStage: one engine per actor): the page planned for this engine and prompted
      (prepare_decoded_page: aspect ratio, context budget, resize), run and parsed as the API runs it (recognise:
      the engine call bounded by request_timeout_s, the repetition guard, task parsing, the extraction retry) and
      made into its record; many pages in flight per actor, so a vLLM engine's batch stays full
    → the driver (service/batch/run.py) writes the records.

Every failure of a page becomes that page's error record with the API's code; a document that cannot be read or
opened becomes one error record (page 0). Rows carry only plain columns (Arrow), the same in every row.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from service.batch.inputs import StoreOptions
from service.batch.output import page_key, page_record
from service.errors import OCRError

log = logging.getLogger(__name__)

# the columns of every row between the stages (Arrow needs one schema per block)
PAGE_COLUMNS = ("kind", "source", "name", "size", "mtime", "sha256", "page", "pages", "key", "format", "pixels",
                "width", "height", "started", "read_ms", "render_ms", "decode_ms", "record")
# kind: `page` (pixels for the engine), `record` (the page's record, JSON), `skipped` (every page of the document
# was written before: the driver counts the document and its pages)


@dataclass
class WorkerPlan:
    """What every read task and engine actor is given: the settings and the request as plain data (workers never
    read OCR_* variables of their own), how to reach the stores (credentials: each process's environment) and the
    settings hash of the page keys."""

    settings: dict[str, Any]
    request: dict[str, Any]
    store: StoreOptions
    settings_digest: str
    _parsed: dict[str, Any] = field(default_factory=dict, repr=False)

    def parsed_settings(self):
        if "settings" not in self._parsed:
            from service.config import Settings

            self._parsed["settings"] = Settings.model_validate(self.settings)
        return self._parsed["settings"]

    def ocr_request(self):
        if "request" not in self._parsed:
            from service.schema import OCRRequest

            self._parsed["request"] = OCRRequest.model_validate(self.request)
        return self._parsed["request"]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_parsed": {}}


def document_item(source, index: int, written_sha256: str = "", written_pages: list[int] | None = None
                  ) -> dict[str, Any]:
    """A document as the read stage takes it (one row of the input dataset)."""
    return {"index": index, "source": source.uri, "name": source.name, "size": source.size, "mtime": source.mtime,
            "written_sha256": written_sha256, "written_pages": json.dumps(written_pages or [])}


def _row(doc: dict[str, Any], kind: str, **values: Any) -> dict[str, Any]:
    row = {"kind": kind, "source": doc["source"], "name": doc["name"], "size": doc["size"], "mtime": doc["mtime"],
           "sha256": doc.get("sha256", ""), "page": 0, "pages": 0, "key": "", "format": "", "pixels": b"",
           "width": 0, "height": 0, "started": time.time(), "read_ms": 0.0, "render_ms": 0.0, "decode_ms": 0.0,
           "record": ""}
    row.update(values)
    return row


def error_row(doc: dict[str, Any], plan: WorkerPlan, error: OCRError, *, page: int = 0, pages: int = 0,
              started: float | None = None, read_ms: float = 0.0) -> dict[str, Any]:
    task = plan.request["task"]
    key = page_key(doc["source"], doc.get("sha256", ""), page, task, plan.settings_digest)
    timings = {"read": read_ms, "total": (time.time() - started) * 1000 if started else read_ms}
    record = page_record({**doc, "page": page, "pages": pages}, task=task, key=key, error=error, timings_ms=timings)
    return _row(doc, "record", page=page, pages=pages, key=key, read_ms=read_ms,
                record=json.dumps(record, ensure_ascii=False))


def read_document(item: dict[str, Any], *, plan: WorkerPlan) -> Iterator[dict[str, Any]]:
    """Ray Data flat_map: one document → its page rows (see the module docstring)."""
    doc = {k: item[k] for k in ("source", "name", "size", "mtime")}
    started = time.time()
    try:
        data = read_source(doc["source"], doc["size"], plan)
    except OCRError as exc:
        yield error_row(doc, plan, exc, started=started)
        return
    doc["sha256"] = hashlib.sha256(data).hexdigest()
    read_ms = (time.time() - started) * 1000
    written = set(json.loads(item["written_pages"])) if item["written_sha256"] == doc["sha256"] else set()
    try:
        from service.imaging import sniff_format

        if sniff_format(data) == "PDF":
            yield from _pdf_pages(doc, data, written, plan, read_ms)
        elif 1 in written:
            yield _row(doc, "skipped", page=1, pages=1)
        else:
            yield _image_page(doc, data, plan, read_ms)
    except OCRError as exc:
        yield error_row(doc, plan, exc, started=started, read_ms=read_ms)
    except Exception as exc:  # a bug must not stop the run: this document's error record, the traceback in the log
        log.exception("reading %s failed", doc["source"])
        yield error_row(doc, plan, OCRError("internal_error", f"reading the document failed: "
                                            f"{type(exc).__name__}"), started=started, read_ms=read_ms)


def read_source(uri: str, listed_size: int, plan: WorkerPlan) -> bytes:
    """The document's bytes, refused unread when the store says it is larger than any document may be (the larger
    of the API's body limit and its PDF limit; the exact limit for its type is applied once its type is known)."""
    settings = plan.parsed_settings()
    limit = max(settings.limits.max_body_bytes, settings.jobs.max_bytes)
    if listed_size > limit:
        raise OCRError("payload_too_large", f"the file is {listed_size} bytes; at most {limit} accepted")
    filesystem, path = plan.store.filesystem(uri)
    try:
        with filesystem.open_input_stream(path) as stream:
            data = stream.read(limit + 1)
    except FileNotFoundError:
        raise OCRError("not_found", "the file is gone (deleted after it was listed)") from None
    except PermissionError:
        raise OCRError("forbidden", "the file cannot be read (permission denied)") from None
    except OSError as exc:
        raise OCRError("internal_error", f"the file cannot be read: {exc}"[:500]) from None
    if len(data) > limit:
        raise OCRError("payload_too_large", f"the file is larger than {limit} bytes")
    return data


def _image_page(doc: dict[str, Any], data: bytes, plan: WorkerPlan, read_ms: float) -> dict[str, Any]:
    from service.imaging import decode_image
    from service.pipeline.page import probe_upload

    s = plan.parsed_settings()
    started = time.time()
    if len(data) > s.limits.max_body_bytes:
        raise OCRError("payload_too_large", f"the image is {len(data)} bytes; at most {s.limits.max_body_bytes} "
                       "accepted (max_body_bytes)")
    probe_upload(data, s, allow_pdf=False)  # header: format, pixels and sides within limits, before decoding
    decoded = decode_image(data, allowed_formats=s.limits.allowed_formats, max_pixels=s.limits.max_image_pixels,
                           max_side=s.limits.max_image_side, max_frames=s.limits.max_frames)
    image = decoded.pixels()
    key = page_key(doc["source"], doc["sha256"], 1, plan.request["task"], plan.settings_digest)
    return _row(doc, "page", page=1, pages=1, key=key, format=decoded.format, pixels=image.tobytes(),
                width=image.width, height=image.height, started=started, read_ms=read_ms,
                decode_ms=(time.time() - started) * 1000)


def _pdf_pages(doc: dict[str, Any], data: bytes, written: set[int], plan: WorkerPlan,
               read_ms: float) -> Iterator[dict[str, Any]]:
    from service.admission.pdf import PdfSession, check_page_box, page_pixel_budget

    s = plan.parsed_settings()
    request = plan.ocr_request()
    budget = page_pixel_budget(s, s.engine.kind, request.max_tokens)
    with PdfSession(data, s) as session:
        info = session.open()
        pages = len(info.pages)
        if all(page.number in written for page in info.pages):
            yield _row(doc, "skipped", page=pages, pages=pages)
            return
        for page in info.pages:
            if page.number in written:
                continue
            started = time.time()
            try:
                check_page_box(page.number, page.width_pt, page.height_pt)
                rendered = session.render(page.number, budget)
                if rendered.error is not None:
                    raise rendered.error
            except OCRError as exc:
                yield error_row(doc, plan, exc, page=page.number, pages=pages, started=started, read_ms=read_ms)
                continue
            image = rendered.image
            key = page_key(doc["source"], doc["sha256"], page.number, plan.request["task"], plan.settings_digest)
            yield _row(doc, "page", page=page.number, pages=pages, key=key, format="PDF", pixels=image.tobytes(),
                       width=image.width, height=image.height, started=started, read_ms=read_ms,
                       render_ms=rendered.render_ms)


class EngineStage:
    """Ray Data actor: one engine (service.engine.make_engine) behind the service's pipeline context, its own event
    loop in a thread; each call runs its rows' pages concurrently there. The actor takes several calls at once
    (Ray Data's max_concurrent_calls_per_actor), so pages in flight = calls × rows per call."""

    def __init__(self, plan: WorkerPlan):
        from service.engine import make_engine
        from service.pipeline.context import AppContext

        self.plan = plan
        settings = plan.parsed_settings()
        self.request = plan.ocr_request()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="batch-engine-loop", daemon=True).start()
        self.engine = make_engine(settings)
        self._wait(self.engine.start())
        # the pipeline's context around the engine itself (no Serve hop): admission and parsing as the API runs them
        self.ctx = AppContext(settings, self.engine)
        self.info = self._wait(self.ctx.get_engine_info())

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else _rows_of(batch)
        futures = [asyncio.run_coroutine_threadsafe(self._page(row), self.loop) if row["kind"] == "page" else None
                   for row in rows]
        out = []
        for row, future in zip(rows, futures):
            if future is not None:
                row = {**row, "kind": "record", "record": future.result()}
            out.append({**row, "pixels": b""})  # the driver gets records, never pixels
        return pa.Table.from_pylist(out, schema=row_schema())

    async def _page(self, row: dict[str, Any]) -> str:
        """The page's record (JSON): its OCR result, or the API's error for it."""
        from service.pipeline.run import recognise

        doc = {"source": row["source"], "name": row["name"], "page": row["page"], "pages": row["pages"],
               "sha256": row["sha256"]}
        task, settings = self.request.task, self.ctx.settings
        timings = {"read": row["read_ms"], **({"render": row["render_ms"]} if row["format"] == "PDF" else
                                               {"decode": row["decode_ms"]})}
        error, response = None, None
        try:
            page = await asyncio.to_thread(self._prepare, row)
            for attempt in range(1 + settings.jobs.page_retries):
                try:
                    response = await recognise(self.ctx, self.request, page, model=self.info.model,
                                               started=time.perf_counter())
                    break
                except OCRError as exc:
                    error = exc
                    if exc.status < 500:
                        break  # the page itself is the problem: retrying cannot help
                except Exception as exc:  # the engine failed under this page: once more, then its error record
                    log.warning("engine call for %s page %s failed (attempt %d): %s", row["source"], row["page"],
                                attempt + 1, exc)
                    error = OCRError("engine_unavailable", f"the engine failed on this page: {type(exc).__name__}")
        except OCRError as exc:
            error = exc
        except Exception as exc:
            log.exception("page %s of %s failed", row["page"], row["source"])
            error = OCRError("internal_error", f"the page could not be processed: {type(exc).__name__}")
        if response is not None:
            error = None
            engine_timings = dict(response.timings_ms)
            engine_timings["prepare"] = engine_timings.pop("decode", 0.0)
            engine_timings.pop("total", None)
            timings.update(engine_timings)
        timings["total"] = (time.time() - row["started"]) * 1000
        record = page_record(doc, task=task, key=row["key"], response=response, error=error, timings_ms=timings)
        return json.dumps(record, ensure_ascii=False)

    def _prepare(self, row: dict[str, Any]):
        """Blocking: the decoded page planned, resized and prompted for this engine (the API's admission)."""
        from PIL import Image

        from service.imaging import DecodedImage
        from service.pipeline.page import prepare_decoded_page

        image = Image.frombytes("RGB", (row["width"], row["height"]), row["pixels"])
        decoded = DecodedImage(image=image, format=row["format"], width=image.width, height=image.height)
        return prepare_decoded_page(self.ctx, self.request, decoded, self.info, f"batch-{row['key'][:16]}",
                                    source="pdf" if row["format"] == "PDF" else "image")


def _rows_of(batch: dict[str, Any]) -> list[dict[str, Any]]:
    names = list(batch)
    return [dict(zip(names, values)) for values in zip(*(batch[n] for n in names))]


def row_schema():
    import pyarrow as pa

    types = {"size": pa.int64(), "page": pa.int32(), "pages": pa.int32(), "width": pa.int32(), "height": pa.int32(),
             "pixels": pa.large_binary(), "started": pa.float64(), "read_ms": pa.float64(), "render_ms": pa.float64(),
             "decode_ms": pa.float64()}
    return pa.schema([(name, types.get(name, pa.string())) for name in PAGE_COLUMNS])
