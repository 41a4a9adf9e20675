"""What a job's pages are, known from headers only before its 202: the images' headers, or the PDF's page count
and boxes in the sandbox (its first page loaded: a content-stream bomb there is the request's 400); the decoded
pixels of all pages within `max_request_pixels`; each page priced at its size. Nothing is decoded or rendered here:
the job keeps the upload (`JobSource`) and decodes one page when it is dispatched (service/jobs/runner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.admission.pdf import PdfSession, check_page_box, page_pixel_budget, rendered_size
from service.admission.prompts import build_prompt
from service.config import Settings
from service.engine.protocol import EngineInfo
from service.errors import OCRError
from service.imaging import probe_image
from service.pipeline.context import AppContext
from service.pipeline.page import plan_page, rate_limit_cost
from service.schema import OCRRequest


@dataclass
class JobSource:
    """The pages of a job as uploaded: the images' bytes, or one PDF in its sandbox session (opened at `POST`).
    Nothing is decoded before its page is dispatched."""

    numbers: list[int]
    sizes: list[tuple[int, int]]  # each page's pixels (image header, or PDF page at its DPI)
    costs: list[float]  # each page's cost at its size, paid before it is decoded
    images: list[bytes] = field(default_factory=list)  # aligned with `numbers` when not a PDF
    pdf: PdfSession | None = None
    render_pixels: int = 0  # PDF: the pixel budget its pages are rendered to

    def close(self) -> None:
        if self.pdf is not None:
            self.pdf.stop()
            self.pdf.close()


def probe_source(ctx: AppContext, req: OCRRequest, engine: EngineInfo, files: list[bytes], numbers: list[int] | None,
                 pages_spec: str | None) -> JobSource:
    """Blocking (admission pool): what the job's pages are, from headers only. Images: each selected one's header
    (format, size limits). A PDF: opened in the sandbox, page count and boxes read, the first page loaded (its
    content streams parsed: a bomb there is this request's 400); the session stays open for the runner. Either way the
    pages' decoded pixels together must fit `max_request_pixels`, and each page is priced at its size."""
    s = ctx.settings
    if numbers is None:  # one PDF
        render_pixels = page_pixel_budget(s, engine.name, req.max_tokens)
        session = PdfSession(files[0], s, pages=pages_spec)
        try:
            info = session.open()
            for page in info.pages:
                check_page_box(page.number, page.width_pt, page.height_pt)
            sizes = [rendered_size(page, s, render_pixels) for page in info.pages]
            _check_pixels(sizes, s, "PDF pages at the resolution they are rendered at")
            session.load(info.pages[0].number)
            costs = _page_costs(ctx, req, engine, sizes)
        except BaseException:
            session.close()
            raise
        return JobSource(numbers=[p.number for p in info.pages], sizes=sizes, costs=costs, pdf=session,
                         render_pixels=render_pixels)
    images = [files[n - 1] for n in numbers]
    sizes = []
    for data in images:
        _, width, height = probe_image(data, allowed_formats=s.limits.allowed_formats, max_pixels=s.limits.max_image_pixels,
                                       max_side=s.limits.max_image_side)
        sizes.append((width, height))
    _check_pixels(sizes, s, "images")
    return JobSource(numbers=numbers, sizes=sizes, costs=_page_costs(ctx, req, engine, sizes), images=images)


def _page_costs(ctx: AppContext, req: OCRRequest, engine: EngineInfo, sizes: list[tuple[int, int]]) -> list[float]:
    """What each page costs at the bucket, from its size. A page its plan refuses (aspect ratio, a prompt too long
    for it) costs one token until it fails at its turn."""
    prompt = None if engine.name == "embedded" else build_prompt(req, ctx.settings)  # one prompt for every page
    costs = []
    for width, height in sizes:
        try:
            plan, _, _ = plan_page(ctx, req, width, height, engine, prompt)
            costs.append(rate_limit_cost(ctx, plan))
        except OCRError:
            costs.append(1.0)
    return costs


def _check_pixels(sizes: list[tuple[int, int]], settings: Settings, what: str) -> None:
    total = sum(width * height for width, height in sizes)
    if total > settings.limits.max_request_pixels:
        raise OCRError("too_many_pixels", f"the job's {what} have {total} pixels in all; at most "
                       f"{settings.limits.max_request_pixels} per request — send fewer or smaller pages")
