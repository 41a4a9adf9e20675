"""`ocr-serve batch`'s driver: list the inputs, skip what the output already holds, run the stages
(service/batch/stages.py) on Ray Data, write each page's record exactly once (service/batch/output.py), show
progress, and end with a summary.

The driver is the only writer: records reach it as Ray Data yields them (small: text, lines, timings; the pages'
pixels stay between the stages), so a page whose key is already written — a retried task, a re-executed block —
is dropped, and the final output holds every page once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections import Counter
from typing import Any, Callable, TextIO

from service.batch.inputs import InputError, Source, StoreOptions, list_inputs
from service.batch.output import (Done, DoneIndex, OutputError, OutputStore, document_markdown, output_settings)
from service.batch.stages import WorkerPlan, document_item

log = logging.getLogger(__name__)

EXIT_OK, EXIT_PAGES_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclasses.dataclass
class BatchOptions:
    inputs: list[str]
    out: str
    request: dict[str, Any]  # the OCRRequest of every page (task and its options)
    format: str = "jsonl"
    markdown: bool = False
    address: str | None = None  # None: a local Ray for the run
    engine_actors: int | None = None  # default: one per GPU (vLLM), one per CPU core (embedded)
    engine_gpus: float | None = None  # GPUs per engine actor (default 1 for vLLM, 0 otherwise)
    in_flight: int | None = None  # pages in flight per engine actor (default: vLLM 2 × max_num_seqs; embedded 2)
    rows_per_call: int = 1  # pages per call of an engine actor
    commit_every: int = 256  # pages per written part (a part is also written every commit_interval_s)
    commit_interval_s: float = 30.0
    progress: bool = True
    store: StoreOptions = dataclasses.field(default_factory=StoreOptions)


@dataclasses.dataclass
class ResourcePlan:
    """How the engine stage is laid out on the cluster."""

    actors: int
    cpus_per_actor: float
    gpus_per_actor: float
    in_flight: int  # per actor
    rows_per_call: int
    read_cpus: float  # logical CPUs of one read task

    @property
    def calls_per_actor(self) -> int:
        return max(1, math.ceil(self.in_flight / self.rows_per_call))


def plan_resources(settings, options: BatchOptions, cluster_cpus: float, cluster_gpus: float,
                   local_cores: int | None) -> ResourcePlan:
    """vLLM: one actor per GPU (or `engine_gpus` each), twice `max_num_seqs` pages in flight on each, so the engine
    always has a full batch and the next pages waiting. Embedded: one actor per core (`local_cores` on this machine,
    else the cluster's CPUs less one for the read tasks), each running ONNX Runtime on `embedded_threads` threads (1
    by default: several one-thread sessions beat one session spread over the cores), two pages in flight (the next
    one is ready when a page ends)."""
    rows = max(1, options.rows_per_call)
    if settings.engine.kind == "vllm":
        gpus = 1.0 if options.engine_gpus is None else options.engine_gpus
        if options.engine_actors:
            actors = options.engine_actors
        elif gpus > 0:
            actors = int(cluster_gpus // gpus)
            if actors < 1:
                raise InputError(f"the cluster has {cluster_gpus:g} GPUs; the vLLM engine needs {gpus:g} per actor "
                                 "(--engine-gpus 0 runs vLLM's CPU build)")
        else:
            actors = 1
        max_num_seqs = settings.engine.vllm.kwargs(on_cpu=gpus == 0).get("max_num_seqs", 64)
        in_flight = options.in_flight or 2 * int(max_num_seqs)
        return ResourcePlan(actors, 1.0, gpus, in_flight, rows, read_cpus=1.0 if options.address else 0.5)
    threads = settings.engine.embedded.threads or 1
    cores = local_cores if local_cores else max(1, int(cluster_cpus) - 1)
    actors = options.engine_actors or max(1, cores // threads)
    gpus = options.engine_gpus or 0.0
    return ResourcePlan(actors, float(threads), gpus, options.in_flight or 2, rows,
                        read_cpus=1.0 if options.address else 0.5)


def unique_names(sources: list[Source]) -> list[Source]:
    """Two documents of one name (same relative path under two inputs) get their markdown files apart: the later
    ones carry a short hash of their URI."""
    import hashlib

    seen: set[str] = set()
    out = []
    for source in sources:
        name = source.name
        if name in seen:
            stem, dot, ext = name.rpartition(".")
            tag = hashlib.sha256(source.uri.encode()).hexdigest()[:8]
            name = f"{stem}~{tag}.{ext}" if dot else f"{name}~{tag}"
        seen.add(name)
        out.append(dataclasses.replace(source, name=name))
    return out


# --- progress and summary --------------------------------------------------------------------------------------------

class Progress:
    """Counts of the run, and the live line on stderr: pages done of the total (estimated until every document's
    page count is known), pages/s, errors."""

    def __init__(self, documents: int, stream: TextIO, enabled: bool, clock: Callable[[], float] = time.monotonic):
        self.documents, self.stream, self.clock = documents, stream, clock
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.started = clock()
        self.doc_pages: dict[str, int] = {}  # page count of every document heard of
        self.pages_before = 0  # pages written by earlier runs (their documents counted as they are heard of)
        self.done = 0  # pages written by this run
        self.errors: Counter[str] = Counter()
        self.documents_written: set[str] = set()  # documents with a page written by this run
        self.latencies_ms: list[float] = []
        self.arrivals: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def document(self, source: str, pages: int) -> None:
        with self._lock:
            self.doc_pages.setdefault(source, pages)

    def page(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.done += 1
            self.documents_written.add(record["source"])
            self.arrivals.append(self.clock())
            if record["error"]:
                self.errors[record["error"]["code"]] += 1
            total = (record.get("timings_ms") or {}).get("total")
            if total is not None:
                self.latencies_ms.append(total)

    def total_pages(self) -> tuple[int, bool]:
        """(pages of every document, exact?): an estimate from the documents heard of until all are."""
        known = sum(max(1, p) for p in self.doc_pages.values())
        unknown = self.documents - len(self.doc_pages)
        if unknown <= 0 or not self.doc_pages:
            return known + max(0, unknown), unknown <= 0
        return round(known + unknown * known / len(self.doc_pages)), False

    def line(self) -> str:
        with self._lock:
            elapsed = max(1e-9, self.clock() - self.started)
            total, exact = self.total_pages()
            done = self.done + self.pages_before
            errors = sum(self.errors.values())
            rate = self.done / elapsed
            width = 24
            filled = min(width, int(width * done / total)) if total else 0
            eta = f", eta {_duration((total - done) / rate)}" if rate > 0 and exact and total > done else ""
            return (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{'' if exact else '~'}{total} pages, "
                    f"{rate:.2f} pages/s, {errors} error{'s' if errors != 1 else ''}, "
                    f"{len(self.doc_pages)}/{self.documents} documents{eta}")

    def start(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="batch-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        interval = 0.5 if self.tty else 15.0
        while not self._stop.wait(interval):
            self._print()

    def _print(self) -> None:
        text = self.line()
        self.stream.write(f"\r{text}\033[K" if self.tty else text + "\n")
        self.stream.flush()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._print()
            if self.tty:
                self.stream.write("\n")

    def steady_pages_per_s(self) -> float | None:
        """Pages/s between the first and the last page written by this run (start-up left out)."""
        # too few pages, or all of them in one delivery: no rate to speak of
        if len(self.arrivals) < 10 or self.arrivals[-1] - self.arrivals[0] < 1.0:
            return None
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))], 1)


def summary_text(summary: dict[str, Any]) -> str:
    pages = summary["pages"]
    errors = ", ".join(f"{code} {n}" for code, n in summary["errors_by_code"].items()) or "none"
    lines = [f"ocr-serve batch: {pages['written_this_run']} pages of {summary['documents']['this_run']} documents "
             f"in {summary['wall_s']:.1f}s ({summary['pages_per_s'] or 0:.2f} pages/s"
             + (f", {summary['steady_pages_per_s']:.2f} once running" if summary["steady_pages_per_s"] else "")
             + f"), p50 page latency {summary['latency_ms_p50'] if summary['latency_ms_p50'] is not None else '-'} ms",
             f"  errors this run: {errors}",
             f"  output {summary['out']}: {pages['in_output']} pages of {summary['documents']['listed']} documents "
             f"({pages['skipped']} written before this run), {pages['failed_in_output']} with an error"]
    if pages["missing"]:
        lines.append(f"  {pages['missing']} pages not written yet (interrupted, or an engine actor failed on them): "
                     "run again to do them")
    if summary.get("interrupted"):
        lines.append("  interrupted: run the same command again to go on")
    return "\n".join(lines)


# --- the run ---------------------------------------------------------------------------------------------------------

class Writer:
    """Buffers records and commits them as parts; counts what reaches the output."""

    def __init__(self, store: OutputStore, index: DoneIndex, sources: dict[str, Source], progress: Progress,
                 options: BatchOptions):
        self.store, self.index, self.sources, self.progress = store, index, sources, progress
        self.options = options
        self.buffer: list[tuple[dict[str, Any], Done]] = []
        self.last_commit = time.monotonic()
        self.duplicates = 0
        self.pages_by_doc: dict[str, dict[int, dict[str, Any]]] = {}  # --markdown: this run's pages of open documents
        self.markdown_pending: set[str] = set()  # documents complete but with pages of earlier runs

    def add(self, row: dict[str, Any]) -> None:
        source = self.sources[row["source"]]
        self.progress.document(row["source"], row["pages"])
        if row["kind"] == "skipped":
            self.progress.pages_before += row["pages"] or 1
            self._document_progress(row["source"])
            return
        record = json.loads(row["record"])
        done = Done.of(record, source.size, source.mtime)
        if done.key in self.index or any(done.key == d.key for _, d in self.buffer):
            self.duplicates += 1  # a retried or re-executed task: the key is written already
            return
        self.buffer.append((record, done))
        self.progress.page(record)
        if self.options.markdown:
            self.pages_by_doc.setdefault(record["source"], {})[record["page"]] = record
        if len(self.buffer) >= self.options.commit_every or \
                time.monotonic() - self.last_commit >= self.options.commit_interval_s:
            self.commit()

    def tick(self) -> None:
        if self.buffer and time.monotonic() - self.last_commit >= self.options.commit_interval_s:
            self.commit()

    def commit(self) -> None:
        self.last_commit = time.monotonic()
        if not self.buffer:
            return
        records, entries = [r for r, _ in self.buffer], [d for _, d in self.buffer]
        part = self.store.commit(records, entries)
        for done in entries:
            self.index.add(dataclasses.replace(done, part=part))
        self.buffer.clear()
        for source in {d.source for d in entries}:
            self._document_progress(source)

    def _document_progress(self, source: str) -> None:
        """`--markdown`: a document whose pages are all written gets its file (from this run's pages, or later from
        the parts where earlier runs' pages are)."""
        if not self.options.markdown:
            return
        entries = self.index.by_source.get(source, [])
        if not entries or not _complete(entries):
            return
        pages = self.pages_by_doc.pop(source, {})
        latest = _latest(entries)
        if all(e.page in pages for e in latest):
            self.store.write_markdown(self.sources[source].name, document_markdown([pages[e.page] for e in latest]))
        else:
            self.markdown_pending.add(source)

    def finish_markdown(self) -> int:
        """Markdown files of complete documents that need pages of earlier runs, or whose file is missing (a kill
        between a part and its markdown). Reads only the parts that hold their pages."""
        if not self.options.markdown:
            return 0
        wanted: dict[str, list[Done]] = {}
        for uri, source in self.sources.items():
            entries = self.index.by_source.get(uri, [])
            if entries and _complete(entries) and (uri in self.markdown_pending or
                                                   not self.store.has_markdown(source.name)):
                wanted[uri] = _latest(entries)
        keys = {e.key for entries in wanted.values() for e in entries}
        records = {r["key"]: r for r in self.store.records(sorted({e.part for e in self.index.by_key.values()
                                                                  if e.key in keys}))
                   if r["key"] in keys}
        for uri, entries in wanted.items():
            self.store.write_markdown(self.sources[uri].name, document_markdown([records[e.key] for e in entries
                                                                                 if e.key in records]))
        return len(wanted)


def _latest(entries: list[Done]) -> list[Done]:
    sha = entries[-1].sha256
    return sorted((e for e in entries if e.sha256 == sha), key=lambda e: e.page)


def _complete(entries: list[Done]) -> bool:
    latest = _latest(entries)
    pages = latest[0].pages
    return {e.page for e in latest} >= (set(range(1, pages + 1)) if pages else {0})


def run_batch(options: BatchOptions, settings, *, stream: TextIO = sys.stderr) -> int:
    """The whole command; returns its exit status: 0 every page has a result, 1 some page failed or was not
    written, 2 the run could not start, 130 interrupted."""
    started = time.monotonic()
    try:
        request, model = validate_request(settings, options.request)
        sources = unique_names(list_inputs(options.inputs, options.store))
        store = OutputStore(options.out, options.store, options.format)
        fingerprint = output_settings(settings, request.model_dump(mode="json", by_alias=True,
                                                                   exclude_none=True), model)
        digest = store.open_run(fingerprint)
    except (InputError, OutputError) as exc:
        print(f"ocr-serve batch: {exc}", file=stream)
        return EXIT_USAGE
    store.clean_temporary()
    index, notes = store.load_done()
    for note in notes:
        print(f"ocr-serve batch: {note}", file=stream)
    by_uri = {s.uri: s for s in sources}
    todo = [s for s in sources if not index.complete(s.uri, s.size, s.mtime)]
    progress = Progress(len(sources), stream, options.progress)
    for source in sources:
        if source not in todo:
            pages = _latest(index.by_source[source.uri])
            progress.document(source.uri, pages[0].pages)
            progress.pages_before += len(pages)
    writer = Writer(store, index, by_uri, progress, options)
    interrupted = False
    plan = None
    if todo:
        plan = WorkerPlan(settings=settings.model_dump(mode="json"), request=request.model_dump(mode="json",
                                                                                              by_alias=True),
                          store=options.store, settings_digest=digest)
        progress.start()
        try:
            with _interrupt_on_sigterm():
                for row in _pipeline_rows(options, settings, plan, todo, index):
                    writer.add(row)
                    writer.tick()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            writer.commit()
            progress.stop()
    writer.finish_markdown()
    summary = summarise(options, settings, sources, index, progress, started, digest, model, interrupted,
                        writer.duplicates)
    store.write_summary(summary)
    print(summary_text(summary), file=stream, flush=True)
    if interrupted:
        return EXIT_INTERRUPTED
    failed = summary["pages"]["failed_in_output"] or summary["pages"]["missing"]
    return EXIT_PAGES_FAILED if failed else EXIT_OK


def validate_request(settings, request_fields: dict[str, Any]):
    """The request every page is run with, checked once as the API checks a request (its options, the engine can do
    the task): (OCRRequest, the model name records carry). Raises InputError with the API's message."""
    import asyncio

    from pydantic import ValidationError

    from service.engine import make_engine
    from service.errors import OCRError
    from service.pipeline.admit import validate_task
    from service.pipeline.context import AppContext
    from service.schema import OCRRequest

    try:
        request = OCRRequest.model_validate(request_fields)
    except ValidationError as exc:
        raise InputError(f"invalid request options: {exc.errors()[0]['msg']}") from None
    # the engine's facts before it starts (supported tasks, model name): nothing is loaded
    ctx = AppContext(settings, make_engine(settings))
    try:
        asyncio.run(validate_task(ctx, request))
    except OCRError as exc:
        raise InputError(f"{exc.code}: {exc.message}") from None
    return request, ctx.engine_info.model


def _pipeline_rows(options: BatchOptions, settings, plan: WorkerPlan, todo: list[Source], index: DoneIndex):
    """The dataset of the documents to do, through the stages; yields the rows that reach the driver."""
    import ray
    import ray.data

    from service.batch.stages import EngineStage, read_document
    from service.serve import local

    # a caller already connected to Ray (a notebook, a test session) runs the batch there and keeps its connection
    own_ray = not ray.is_initialized()
    if own_ray and options.address:
        local.connect_ray(options.address)
    elif own_ray:
        local.start_ray(num_gpus=None, log_to_driver=False)
    try:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # ours is on stderr
        context.print_on_execution_start = False
        context.enable_operator_progress_bars = False
        # a page of pixels is a block of its own: pages reach the engine actors one by one, not ten at a time
        context.target_max_block_size = 1024 * 1024
        # a block lost with an engine actor that failed on it repeatedly: its pages stay unwritten (the summary
        # counts them, the next run retries them) and the run goes on
        context.max_errored_blocks = -1
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="ray.data")  # advice about the layout this run chose on purpose
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*")
        resources = ray.cluster_resources()
        # a cluster of this machine alone: its logical CPUs may be more than its cores (Serve's local cluster)
        alive = [node for node in ray.nodes() if node.get("Alive")]
        this_node_only = len(alive) == 1 and alive[0]["NodeID"] == ray.get_runtime_context().get_node_id()
        layout = plan_resources(settings, options, resources.get("CPU", 1.0), resources.get("GPU", 0.0),
                                os.cpu_count() if this_node_only else None)
        if settings.engine.kind == "embedded" and not settings.engine.embedded.threads:
            # each actor's ONNX Runtime on the CPUs Ray reserved for it, not on every core of its node (auto)
            plan.settings["engine"]["embedded"]["threads"] = max(1, int(layout.cpus_per_actor))
        items = []
        for i, source in enumerate(todo):
            sha, pages = index.written_pages(source.uri)
            items.append(document_item(source, i, sha, pages))
        documents = ray.data.from_items(items, override_num_blocks=min(len(items), 10_000))
        pages = documents.flat_map(read_document, fn_kwargs={"plan": plan}, num_cpus=layout.read_cpus)
        records = pages.map_batches(
            EngineStage, fn_constructor_kwargs={"plan": plan}, batch_size=layout.rows_per_call,
            batch_format="pyarrow", zero_copy_batch=True, num_cpus=layout.cpus_per_actor,
            num_gpus=layout.gpus_per_actor or None, max_task_retries=settings.jobs.page_retries,
            compute=ray.data.ActorPoolStrategy(size=layout.actors,
                                               max_tasks_in_flight_per_actor=layout.calls_per_actor,
                                               max_concurrent_calls_per_actor=layout.calls_per_actor))
        for batch in records.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=4):
            yield from batch.drop_columns(["pixels"]).to_pylist()
    finally:
        if own_ray and not options.address:
            ray.shutdown()


class _interrupt_on_sigterm:
    """SIGTERM ends the run like Ctrl-C: what is written stays, the buffer is committed, the summary printed."""

    def __enter__(self):
        self._previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
        return False


def summarise(options: BatchOptions, settings, sources: list[Source], index: DoneIndex, progress: Progress,
              started: float, digest: str, model: str, interrupted: bool, duplicates: int) -> dict[str, Any]:
    wall = time.monotonic() - started
    expected = 0
    for source in sources:
        entries = index.by_source.get(source.uri)
        if entries:
            latest = _latest(entries)
            expected += max(0, (latest[0].pages or 1) - len(latest))
    written = progress.done
    return {
        "out": options.out, "task": options.request.get("task"), "engine": settings.engine.kind, "model": model,
        "format": options.format, "settings_hash": digest,
        "documents": {"listed": len(sources), "this_run": len(progress.documents_written)},
        "pages": {"written_this_run": written, "skipped": progress.pages_before, "in_output": len(index),
                  "failed_this_run": sum(progress.errors.values()),
                  "failed_in_output": sum(index.errors_by_code().values()),
                  "missing": expected + sum(1 for s in sources if s.uri not in index.by_source)},
        "wall_s": round(wall, 2),
        "pages_per_s": round(written / wall, 3) if wall > 0 else None,
        "steady_pages_per_s": None if progress.steady_pages_per_s() is None else round(progress.steady_pages_per_s(),
                                                                                        3),
        "latency_ms_p50": percentile(progress.latencies_ms, 0.5),
        "latency_ms_p95": percentile(progress.latencies_ms, 0.95),
        "errors_by_code": dict(sorted(progress.errors.items())),
        "errors_by_code_in_output": index.errors_by_code(),
        "duplicates_dropped": duplicates,
        "interrupted": interrupted,
    }
