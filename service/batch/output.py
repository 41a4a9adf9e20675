"""What a batch writes, and how a run that was stopped anywhere resumes without writing a page twice.

    OUT/_run.json            the settings that decide the records' content (and their hash): a run with other
                             settings refuses this folder instead of mixing two kinds of records
    OUT/parts/part-*.jsonl   the records (or .parquet), one per page, in blocks; the final output is their union
    OUT/_manifest/part-*.jsonl  for each part, the keys of its pages (and what resuming needs: source, size,
                             modification time, page count, error code)
    OUT/markdown/NAME.md     `--markdown`: one file per document, once all its pages are written
    OUT/_summary.json        the last run's summary

Exactly once: only the driver writes. A page's key is (source, content sha256, page, task, settings hash); a part
is written under a temporary name and renamed into `parts/` (an object store makes an upload visible only once it is
complete), then its manifest is written the same way. A re-run reads the manifests — rebuilding the manifest of a
part committed just before a kill from the part itself, ignoring temporary files — and the driver drops any page
whose key is already written, so a key reaches the output once whatever was killed, retried or re-executed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

from service.batch.inputs import StoreOptions, scheme_of
from service.tasks import TASKS

PARTS, MANIFESTS, MARKDOWN, TMP = "parts", "_manifest", "markdown", "_tmp"
RUN_FILE, SUMMARY_FILE = "_run.json", "_summary.json"
FORMATS = ("jsonl", "parquet")
# engine arguments that change what the model writes (the rest only change how fast)
OUTPUT_ENGINE_KWARGS = ("dtype", "quantization", "seed", "load_format", "hf_overrides", "tokenizer_mode",
                        "kv_cache_dtype", "revision")
TIMING_NAMES = ("read", "render", "decode", "prepare", "queue", "engine", "preprocess", "first_token", "generate",
                "delivery", "parse", "total")


class OutputError(RuntimeError):
    """The output folder cannot take this run (other settings, another format)."""


# --- keys ------------------------------------------------------------------------------------------------------------

def output_settings(settings, request: dict[str, Any], model: str) -> dict[str, Any]:
    """The settings that decide a record's content: the request (task and its options), the engine and model, the
    limits, the image budget, parsing and the PDF rendering. Not what only changes speed (actors, batch sizes, GPU
    memory, timeouts)."""
    engine = settings.engine
    return {
        "request": request,
        "engine": engine.kind,
        "model": model,
        "model_path": str(engine.model) if engine.model else None,
        "engine_budget": {"max_model_len": engine.max_model_len, "max_output_tokens": engine.max_output_tokens,
                          "min_image_pixels": engine.min_image_pixels,
                          "max_engine_image_pixels": engine.max_engine_image_pixels, "presize": engine.presize,
                          "image_processor_backend": engine.vllm.image_processor_backend,
                          "embedded_det_limit_side_len": engine.embedded.det_limit_side_len,
                          "engine_kwargs": {k: engine.vllm.engine_kwargs[k] for k in OUTPUT_ENGINE_KWARGS
                                            if k in engine.vllm.engine_kwargs}},
        "limits": settings.limits.model_dump(mode="json"),
        "parsing": settings.parsing.model_dump(mode="json"),
        "pdf": {"max_pdf_dpi": settings.pdf.max_dpi, "max_pdf_pages": settings.jobs.max_pages,
                "max_pdf_bytes": settings.jobs.max_bytes},
        "fixed_output_tokens": settings.testing.fixed_output_tokens,
    }


def settings_hash(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


def page_key(source: str, sha256: str, page: int, task: str, settings_digest: str) -> str:
    """One page's identity in the output: the same file's same page under the same settings is written once."""
    raw = "\x00".join((source, sha256, str(page), task, settings_digest))
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


# --- records ---------------------------------------------------------------------------------------------------------

def page_markdown(task: str, text: str) -> str | None:
    """The page as Markdown where the task's output is a document (markdown, HTML tables, LaTeX, JSON); None for
    plain text and lines, whose `text` is the page."""
    kind = TASKS[task].output if task in TASKS else "text"
    if kind in ("markdown", "html"):
        return text
    if kind == "latex":
        return f"$$\n{text}\n$$"
    if kind == "json":
        return f"```json\n{text}\n```"
    return None


def page_record(doc: dict[str, Any], *, task: str, key: str, response=None, error=None,
                timings_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """One output record: the page's source fields (`doc`: source, name, page, pages, sha256) and either the
    service's OCRResponse for it or its error (an OCRError: the API's code and message)."""
    record: dict[str, Any] = {
        "source": doc["source"], "name": doc["name"], "page": doc["page"], "pages": doc["pages"],
        "sha256": doc["sha256"] or None, "key": key, "task": task, "model": None, "text": None, "markdown": None,
        "lines": [], "fields": None, "errors": None, "confidence": None, "image": None, "usage": None,
        "timings_ms": {k: round(v, 2) for k, v in (timings_ms or {}).items() if k in TIMING_NAMES},
        "finish_reason": None, "warnings": [], "error": None,
    }
    if response is not None:
        body = response.model_dump(mode="json")
        record.update(model=body["model"], text=body["text"], markdown=page_markdown(task, body["text"]),
                      lines=body["lines"], fields=body["fields"], errors=body["errors"],
                      confidence=body["confidence"], image=body["image"], usage=body["usage"],
                      finish_reason=body["finish_reason"], warnings=body["warnings"])
    if error is not None:
        record["error"] = {"code": error.code, "message": error.message}
    return record


def document_markdown(records: list[dict[str, Any]]) -> str:
    """A document's pages in order, each after a `<!-- page N -->` marker; a failed page says why."""
    out = []
    for record in sorted(records, key=lambda r: r["page"]):
        out.append(f"<!-- page {record['page']} -->")
        if record["error"]:
            out.append(f"<!-- error {record['error']['code']}: {record['error']['message']} -->")
        elif record["markdown"] is not None:
            out.append(record["markdown"])
        else:
            out.append((record["text"] or "").replace("\n", "  \n"))
    return "\n\n".join(out) + "\n"


def parquet_schema():
    import pyarrow as pa

    box = pa.list_(pa.int32())
    line = pa.struct([("text", pa.string()), ("box", box), ("polygon", pa.list_(box)),
                      ("confidence", pa.float64()), ("category", pa.string())])
    return pa.schema([
        ("source", pa.string()), ("name", pa.string()), ("page", pa.int32()), ("pages", pa.int32()),
        ("sha256", pa.string()), ("key", pa.string()), ("task", pa.string()), ("model", pa.string()),
        ("text", pa.string()), ("markdown", pa.string()), ("lines", pa.list_(line)),
        ("fields", pa.string()),  # JSON: values of any type
        ("errors", pa.list_(pa.string())), ("confidence", pa.float64()),
        ("image", pa.struct([(n, pa.int32()) for n in ("width", "height", "engine_width", "engine_height")]
                            + [("scale", pa.float64())])),
        ("usage", pa.struct([(n, pa.int64()) for n in ("prompt_tokens", "image_tokens", "output_tokens", "pages")])),
        ("timings_ms", pa.struct([(n, pa.float64()) for n in TIMING_NAMES])),
        ("finish_reason", pa.string()), ("warnings", pa.list_(pa.string())),
        ("error", pa.struct([("code", pa.string()), ("message", pa.string())])),
    ])


def encode_records(records: list[dict[str, Any]], fmt: str) -> bytes:
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**r, "fields": None if r["fields"] is None else json.dumps(r["fields"], ensure_ascii=False)}
            for r in records]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=parquet_schema()), sink, compression="zstd")
    return sink.getvalue()


def decode_records(data: bytes, fmt: str) -> list[dict[str, Any]]:
    if fmt == "jsonl":
        return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    import pyarrow.parquet as pq

    rows = pq.read_table(io.BytesIO(data)).to_pylist()
    for row in rows:
        row["fields"] = None if row["fields"] is None else json.loads(row["fields"])
        row["timings_ms"] = {k: v for k, v in (row["timings_ms"] or {}).items() if v is not None}
    return rows


# --- the manifest ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Done:
    """A written page, as its part's manifest lists it."""

    key: str
    source: str
    sha256: str
    page: int
    pages: int
    size: int
    mtime: str
    error: str  # the error code, "" for a page with a result
    part: str = ""

    @classmethod
    def of(cls, record: dict[str, Any], size: int, mtime: str, part: str = "") -> "Done":
        return cls(key=record["key"], source=record["source"], sha256=record["sha256"] or "", page=record["page"],
                   pages=record["pages"], size=size, mtime=mtime,
                   error=(record["error"] or {}).get("code", ""), part=part)


class DoneIndex:
    """Every page the output holds, by key, and per source what a resume needs to skip a document unread."""

    def __init__(self) -> None:
        self.by_key: dict[str, Done] = {}
        self.by_source: dict[str, list[Done]] = {}

    def add(self, done: Done) -> bool:
        """False when the key is already written (the entry is dropped)."""
        if done.key in self.by_key:
            return False
        self.by_key[done.key] = done
        self.by_source.setdefault(done.source, []).append(done)
        return True

    def __contains__(self, key: str) -> bool:
        return key in self.by_key

    def __len__(self) -> int:
        return len(self.by_key)

    def complete(self, source: str, size: int, mtime: str) -> bool:
        """Whether every page of the document, as it was when written, is in the output and the store still reports
        that size and modification time: the document need not even be read."""
        entries = self.by_source.get(source, [])
        if not entries or not mtime:
            return False
        latest = [e for e in entries if e.sha256 == entries[-1].sha256]
        if any(e.size != size or e.mtime != mtime for e in latest):
            return False
        pages = latest[0].pages
        return {e.page for e in latest} >= (set(range(1, pages + 1)) if pages else {0})

    def written_pages(self, source: str) -> tuple[str, list[int]]:
        """(the content sha256 the latest pages were written for, their page numbers): the pages a read of the same
        content skips."""
        entries = self.by_source.get(source, [])
        if not entries:
            return "", []
        sha = entries[-1].sha256
        return sha, sorted({e.page for e in entries if e.sha256 == sha})

    def errors_by_code(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for done in self.by_key.values():
            if done.error:
                counts[done.error] = counts.get(done.error, 0) + 1
        return dict(sorted(counts.items()))


# --- the store -------------------------------------------------------------------------------------------------------

class OutputStore:
    """The output folder (local or object store): committed parts and their manifests, markdown, the run's files.
    Only the driver uses it."""

    def __init__(self, uri: str, options: StoreOptions, fmt: str):
        if fmt not in FORMATS:
            raise OutputError(f"unknown format {fmt!r} ({', '.join(FORMATS)})")
        self.uri, self.format = uri.rstrip("/"), fmt
        self.fs, self.root = options.filesystem(self.uri)
        self.root = self.root.rstrip("/")
        self.local = scheme_of(uri) == "file"

    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    # writing: whole files, visible only once complete
    def write(self, relative: str, data: bytes) -> None:
        target = self.path(relative)
        if self.local:
            tmp_dir = self.path(TMP)
            os.makedirs(tmp_dir, exist_ok=True)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = os.path.join(tmp_dir, f"{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
            _fsync_dir(os.path.dirname(target))
            return
        with self.fs.open_output_stream(target) as out:  # an object appears only when its upload completes
            out.write(data)

    def read(self, relative: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self.path(relative)) as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def list(self, folder: str) -> list[str]:
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.path(folder), recursive=False, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    # the run's settings
    def open_run(self, fingerprint: dict[str, Any]) -> str:
        """Bind the folder to these settings (first run) or check it is bound to them; returns their hash."""
        digest = settings_hash(fingerprint)
        existing = self.read(RUN_FILE)
        if existing is None:
            self.write(RUN_FILE, json.dumps({"settings_hash": digest, "format": self.format,
                                             "settings": fingerprint}, indent=2, default=str).encode())
            return digest
        run = json.loads(existing)
        if run.get("format") != self.format:
            raise OutputError(f"{self.uri} holds {run.get('format')} records; run with --format {run.get('format')} "
                              "or another --out")
        if run.get("settings_hash") != digest:
            changed = sorted(k for k in set(fingerprint) | set(run.get("settings", {}))
                             if json.dumps(fingerprint.get(k), sort_keys=True, default=str)
                             != json.dumps(run.get("settings", {}).get(k), sort_keys=True, default=str))
            raise OutputError(f"{self.uri} holds records made with other settings (differing: "
                              f"{', '.join(changed) or 'unknown'}); use another --out, or the same settings to resume")
        return digest

    def clean_temporary(self) -> None:
        """Files of a write that a kill interrupted (local folders: object stores never show them)."""
        if self.local:
            for name in self.list(TMP):
                self.fs.delete_file(self.path(TMP, name))

    def load_done(self) -> tuple[DoneIndex, list[str]]:
        """The pages written so far, and notes of what was repaired: a part committed without its manifest (a kill
        between the two writes) gets it rebuilt; a manifest whose part is gone is ignored."""
        index, notes = DoneIndex(), []
        parts = set(self.list(PARTS))
        for name in self.list(MANIFESTS):
            part = name.removesuffix(".manifest.jsonl")
            if part not in parts:
                notes.append(f"manifest {name} names a missing part: its pages will be done again")
                continue
            parts.discard(part)
            for line in (self.read(f"{MANIFESTS}/{name}") or b"").decode().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if not index.add(Done(**{**row, "part": part})):
                        notes.append(f"part {part} repeats page key {row['key']}: the first is kept")
        for part in sorted(parts):
            records = decode_records(self.read(f"{PARTS}/{part}") or b"", self.format)
            # size and mtime are unknown for these pages: their documents are read again, their pages skipped
            entries = [Done.of(r, size=-1, mtime="", part=part) for r in records]
            self._write_manifest(part, entries)
            notes.append(f"part {part} had no manifest: rebuilt from its {len(entries)} records")
            for done in entries:
                index.add(done)
        return index, notes

    def commit(self, records: list[dict[str, Any]], entries: list[Done]) -> str:
        """One block of records: the part, then its manifest. Returns the part's name."""
        part = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.{self.format}"
        self.write(f"{PARTS}/{part}", encode_records(records, self.format))
        self._write_manifest(part, entries)
        return part

    def _write_manifest(self, part: str, entries: Iterable[Done]) -> None:
        lines = [json.dumps({k: v for k, v in asdict(e).items() if k != "part"}) for e in entries]
        self.write(f"{MANIFESTS}/{part}.manifest.jsonl", ("\n".join(lines) + "\n").encode())

    def records(self, parts: Iterable[str]) -> Iterator[dict[str, Any]]:
        for part in parts:
            yield from decode_records(self.read(f"{PARTS}/{part}") or b"", self.format)

    def write_markdown(self, name: str, text: str) -> str:
        relative = f"{MARKDOWN}/{markdown_name(name)}"
        self.write(relative, text.encode())
        return relative

    def has_markdown(self, name: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path(MARKDOWN, markdown_name(name))).type == pafs.FileType.File

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.write(SUMMARY_FILE, json.dumps(summary, indent=2).encode())


def markdown_name(name: str) -> str:
    """`scans/a.pdf` → `scans/a.pdf.md` (a.pdf and a.png of one folder keep apart); no way out of the folder."""
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    return "/".join(parts or ["document"]) + ".md"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
