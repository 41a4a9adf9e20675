"""`ocr-serve eval MANIFEST`: validate the manifest, run it through the service, score, write the outputs.

Scoring starts only after the last response arrived: the client's event loop does nothing but send and receive
while documents are in flight, so the latencies it measures are the service's.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from service.eval import EvalError, metrics
from service.eval.client import EvalClient, RequestOptions
from service.eval.manifest import Manifest, load_manifest
from service.eval.report import summarise, write_outputs
from service.eval.score import SCORED_TRUTHS, ScoreSettings, score_document


@dataclass
class RunConfig:
    manifest: Path
    url: str
    out: Path
    task: str = "spotting"
    adapter: str | None = None
    target_language: str | None = None
    api_key: str | None = None
    concurrency: int = 4
    iou_threshold: float = metrics.DEFAULT_IOU_THRESHOLD
    ignore_case: bool = False
    ece_bins: int = metrics.DEFAULT_ECE_BINS
    timeout_s: float = 300.0
    retries: int = 8
    max_wait_s: float = 60.0


def run_eval(config: RunConfig, *, progress: TextIO | None = None, notes: TextIO | None = None) -> dict[str, Any]:
    """Run and write the outputs; returns the summary. Raises EvalError for anything the user must fix. Progress
    goes to `progress` (none without one); notes to `notes`, the process's stderr at call time by default."""
    metrics.require_metric_packages()
    manifest = load_manifest(config.manifest)
    options = request_options(manifest, config)
    for note in unscored_truths(manifest, config.task):
        print(f"ocr-serve eval: note: {note}", file=notes or sys.stderr)
    outcomes, wall_s, ready = asyncio.run(_run(manifest, config, options, progress))
    settings = ScoreSettings(config.task, config.iou_threshold, config.ignore_case)
    scores = [score_document(doc, outcome, settings) for doc, outcome in zip(manifest.documents, outcomes)]
    summary = summarise(scores, wall_s=wall_s, ece_bins=config.ece_bins, settings={
        "url": config.url, "task": config.task, "adapter": config.adapter, "target_language": config.target_language,
        "concurrency": config.concurrency, "iou_threshold": config.iou_threshold, "ignore_case": config.ignore_case,
        "ece_bins": config.ece_bins, "timeout_s": config.timeout_s, "retries": config.retries,
        "engine": ready.get("engine"), "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }, manifest={"path": str(manifest.path), "sha256": manifest.sha256, "documents": len(manifest.documents)})
    responses = [{"id": o.id, "error": o.error, "pages": [{"page": p.page, "result": p.result} for p in o.pages]}
                 for o in outcomes]
    write_outputs(config.out, summary, scores, responses)
    return summary


async def _run(manifest: Manifest, config: RunConfig, options: RequestOptions, progress: TextIO | None):
    client = EvalClient(config.url, api_key=config.api_key, timeout_s=config.timeout_s, retries=config.retries,
                        max_wait_s=config.max_wait_s, concurrency=config.concurrency)
    try:
        ready = await client.readiness()
        outcomes, wall_s = await client.run(manifest.documents, options, progress)
    finally:
        await client.close()
    return outcomes, wall_s, ready


def request_options(manifest: Manifest, config: RunConfig) -> RequestOptions:
    options = RequestOptions(config.task, config.adapter, config.target_language)
    if config.task == "extract":  # the fields asked for are the labelled ones (a PDF: every page's, once)
        for doc in manifest.documents:
            names = list(dict.fromkeys(name for page in doc.pages for name in (page.fields or {})))
            if not names:
                raise EvalError(f"{manifest.path}:{doc.line_no}: document {doc.id!r} has no \"fields\" truth, "
                                "which task extract needs (it asks the service for the labelled fields)")
            options.fields_for[doc.id] = names
    if config.task == "translate" and not config.target_language:
        raise EvalError("task translate needs --target-language")
    return options


def unscored_truths(manifest: Manifest, task: str) -> list[str]:
    scored = SCORED_TRUTHS.get(task, ())
    return [f"{count} document(s) have \"{key}\" truth, which task {task} does not score"
            for key, count in manifest.counts.items() if count and key not in scored]
