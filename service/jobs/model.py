"""What a job is: its stored record, the per-page results, and the views the API returns.

A job is a list of pages (the selected pages of one PDF, or several images) run through one task. Every page ends
with exactly one `PageResult` — `ok` with the same response `POST /v1/ocr` gives, or `failed` with a stable error
code — so a job never loses a page silently. Status: queued → running → succeeded | partial | failed | cancelled.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

JobStatus = Literal["queued", "running", "succeeded", "partial", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "partial", "failed", "cancelled"})
# A running job whose runner has not written a heartbeat for this long lost its ingress replica.
HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0


class ErrorInfo(BaseModel):
    code: str = Field(description="Stable error code (see the error table).")
    message: str = Field(description="What went wrong (never document content).")


class PageResult(BaseModel):
    """The outcome of one page, stored once when the page finishes."""

    index: int = Field(description="0-based position of the page in the job (events arrive in this order).")
    page: int = Field(description="1-based page number in the PDF (or position of the image in the upload).")
    status: Literal["ok", "failed"] = Field(description="`ok` with `result`, or `failed` with `error`.")
    attempts: int = Field(description="Engine calls made for this page (1 + retries).")
    result: dict[str, Any] | None = Field(None, description="The page's OCR response, as `POST /v1/ocr` returns it.")
    error: ErrorInfo | None = Field(None, description="Why the page failed after its retries.")
    dpi: float | None = Field(None, description="Rasterisation DPI of a PDF page (chosen from the image budget).")
    image: str | None = Field(
        None, description="JPEG preview of the page as a data URL (only when `return_page_images` was set)."
    )


class JobRecord(BaseModel):
    """The stored state of a job (without page results, which are stored per page)."""

    id: str
    tenant: str = Field(description="Owner; other tenants get 404.")
    status: JobStatus = "queued"
    task: str
    options: dict[str, Any] = Field(description="Task options (the `POST /v1/ocr` fields), as submitted.")
    source: Literal["pdf", "images"]
    pages: list[int] = Field(description="Page numbers of the job, in order.")
    return_page_images: bool = False
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    heartbeat_at: float = Field(default_factory=time.time, description="Last sign of life of the runner.")
    finished_at: float | None = None
    error: ErrorInfo | None = Field(None, description="Job-level failure (e.g. the runner was lost).")

    @property
    def pages_total(self) -> int:
        return len(self.pages)


class JobView(BaseModel):
    """`GET /v1/jobs/{id}` and the final SSE event."""

    id: str
    status: JobStatus
    task: str
    pages_total: int
    pages_done: int = Field(description="Pages finished (ok or failed).")
    pages_failed: int
    created_at: float
    updated_at: float
    finished_at: float | None = None
    error: ErrorInfo | None = None
    timings_ms: dict[str, float] = Field(default_factory=dict, description="`total`: creation to finish (or now).")
    pages: list[PageResult] | None = Field(None, description="Results so far, in page order.")

    @classmethod
    def of(cls, record: JobRecord, done: int, failed: int, pages: list[PageResult] | None) -> "JobView":
        end = record.finished_at or time.time()
        return cls(id=record.id, status=record.status, task=record.task, pages_total=record.pages_total,
                   pages_done=done, pages_failed=failed, created_at=record.created_at, updated_at=record.updated_at,
                   finished_at=record.finished_at, error=record.error,
                   timings_ms={"total": round((end - record.created_at) * 1000, 2)}, pages=pages)


class JobAccepted(BaseModel):
    """`POST /v1/jobs` answer (202)."""

    id: str
    status: JobStatus
    pages_total: int
    pages: list[int] = Field(description="The page numbers the job will process, in order.")
    links: dict[str, str] = Field(description="`self` (status and results) and `events` (SSE stream).")
