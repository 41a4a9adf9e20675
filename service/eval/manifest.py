"""The labelled set: a JSON Lines manifest, validated in full before anything is sent (docs/EVAL.md, "Manifest").

One document per line; paths are relative to the manifest's folder. Every mistake is reported as one line naming the
manifest line (`ManifestError`), never a traceback: missing file, bad JSON, unknown keys, wrong types, a box outside
its frame. A box frame is the image as stored with its EXIF orientation applied (what the API's boxes refer to), or
for a PDF page the page in PDF points (1/72 inch, origin top-left, page rotation applied).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.eval import EvalError

TRUTH_KEYS = ("lines", "text", "fields", "markdown", "tables")
DOCUMENT_KEYS = ("id", "image", "pages") + TRUTH_KEYS
PAGE_KEYS = ("page",) + TRUTH_KEYS
LINE_KEYS = ("text", "box", "ignore")
# EXIF orientations 5-8 are transposed: the upright image's width is the stored height
_TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}


class ManifestError(EvalError):
    """One line: `manifest.jsonl:7: document "r1": lines[2].box … lies outside the image (…)`."""


@dataclass
class TruthLine:
    text: str
    box: tuple[float, float, float, float] | None = None
    ignore: bool = False  # a don't-care region (ICDAR `###`): neither a miss nor a false detection


@dataclass
class PageTruth:
    page: int  # 1-based; 1 for an image
    frame: tuple[float, float]  # width, height of the boxes' coordinate frame
    lines: list[TruthLine] | None = None
    text: str | None = None
    fields: dict[str, Any] | None = None
    markdown: str | None = None
    tables: list[str] | None = None

    def has(self, key: str) -> bool:
        return getattr(self, key) is not None

    def reading_text(self) -> str | None:
        """The text truth in reading order: `text`, else the scored lines' texts joined by newlines."""
        if self.text is not None:
            return self.text
        if self.lines is not None:
            return "\n".join(line.text for line in self.lines if not line.ignore)
        return None


@dataclass
class ManifestDocument:
    id: str
    path: Path
    line_no: int
    kind: str  # "image" or "pdf"
    pages: list[PageTruth]
    sha256: str = ""


@dataclass
class Manifest:
    path: Path
    documents: list[ManifestDocument]
    sha256: str = ""  # of the manifest's bytes and every document file's bytes: runs of one set share it
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def pages(self) -> int:
        return sum(len(doc.pages) for doc in self.documents)


def load_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc.strerror or exc})") from None
    try:
        lines = raw.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: the manifest is not UTF-8 text (byte {exc.start})") from None
    digest = hashlib.sha256(raw)
    documents: list[ManifestDocument] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        doc = _document(entry, path.parent, where, number)
        if doc.id in seen:
            raise ManifestError(f"{where}: document id {doc.id!r} repeats line {seen[doc.id]}")
        seen[doc.id] = number
        digest.update(doc.id.encode() + b"\0" + doc.sha256.encode())
        documents.append(doc)
    if not documents:
        raise ManifestError(f"{path}: the manifest has no documents")
    counts = {key: sum(1 for d in documents if any(p.has(key) for p in d.pages)) for key in TRUTH_KEYS}
    return Manifest(path, documents, digest.hexdigest(), counts)


def _document(entry: Any, folder: Path, where: str, number: int) -> ManifestDocument:
    if not isinstance(entry, dict):
        raise ManifestError(f"{where}: a document must be a JSON object, not {_type(entry)}")
    doc_id = entry.get("id")
    if not isinstance(doc_id, str) or not doc_id.strip():
        raise ManifestError(f"{where}: \"id\" must be a non-empty string")
    where = f"{where}: document {doc_id!r}"
    _no_unknown_keys(entry, DOCUMENT_KEYS, where, "document")
    image = entry.get("image")
    if not isinstance(image, str) or not image:
        raise ManifestError(f"{where}: \"image\" must be a path (relative to the manifest's folder)")
    file = (folder / image)
    if not file.is_file():
        raise ManifestError(f"{where}: file {image} not found (looked for {file})")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{where}: cannot read {image} ({exc.strerror or exc})") from None
    sha = hashlib.sha256(data).hexdigest()
    if data.startswith(b"%PDF-"):
        if any(key in entry for key in TRUTH_KEYS):
            raise ManifestError(f"{where}: a PDF's truths go in \"pages\": [{{\"page\": 1, ...}}, ...]")
        sizes = _pdf_page_sizes(data, where)
        pages = _pdf_pages(entry.get("pages"), sizes, where)
        return ManifestDocument(doc_id, file, number, "pdf", pages, sha)
    if "pages" in entry:
        raise ManifestError(f"{where}: \"pages\" is for PDF documents; {image} is not a PDF")
    frame = _image_frame(data, image, where)
    page = _page_truth(entry, 1, frame, where, image_frame_name(frame))
    return ManifestDocument(doc_id, file, number, "image", [page], sha)


def _pdf_pages(pages: Any, sizes: list[tuple[float, float]], where: str) -> list[PageTruth]:
    if pages is None:  # no truth: every page is run (speed only)
        return [PageTruth(i + 1, size) for i, size in enumerate(sizes)]
    if not isinstance(pages, list) or not pages:
        raise ManifestError(f"{where}: \"pages\" must be a non-empty list of page objects")
    out: list[PageTruth] = []
    numbers: set[int] = set()
    for position, page in enumerate(pages):
        at = f"{where}: pages[{position}]"
        if not isinstance(page, dict):
            raise ManifestError(f"{at} must be an object, not {_type(page)}")
        _no_unknown_keys(page, PAGE_KEYS, at, "page")
        number = page.get("page", position + 1)
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= len(sizes):
            raise ManifestError(f"{at}: \"page\" must be a page number from 1 to {len(sizes)}, not {number!r}")
        if number in numbers:
            raise ManifestError(f"{at}: page {number} is labelled twice")
        numbers.add(number)
        out.append(_page_truth(page, number, sizes[number - 1], at, f"page {number} ({_size(sizes[number - 1])} "
                                                                       "PDF points)"))
    return sorted(out, key=lambda p: p.page)


def _page_truth(entry: dict, number: int, frame: tuple[float, float], where: str, frame_name: str) -> PageTruth:
    truth = PageTruth(number, frame)
    if "lines" in entry:
        truth.lines = _lines(entry["lines"], frame, where, frame_name)
    for key in ("text", "markdown"):
        if key in entry:
            if not isinstance(entry[key], str):
                raise ManifestError(f"{where}: \"{key}\" must be a string, not {_type(entry[key])}")
            setattr(truth, key, entry[key])
    if "fields" in entry:
        fields = entry["fields"]
        if not isinstance(fields, dict) or not fields:
            raise ManifestError(f"{where}: \"fields\" must be a non-empty object of field name → value")
        for name, value in fields.items():
            if not name.strip():
                raise ManifestError(f"{where}: a field name is empty")
            if not (value is None or isinstance(value, (str, int, float, bool))):
                raise ManifestError(f"{where}: fields[{name!r}] must be a string, number, boolean or null, "
                                    f"not {_type(value)}")
        truth.fields = dict(fields)
    if "tables" in entry:
        tables = entry["tables"]
        if not isinstance(tables, list) or not all(isinstance(t, str) and "<table" in t.lower() for t in tables):
            raise ManifestError(f"{where}: \"tables\" must be a list of HTML strings, each a <table>…</table>")
        truth.tables = list(tables)
    return truth


def _lines(lines: Any, frame: tuple[float, float], where: str, frame_name: str) -> list[TruthLine]:
    if not isinstance(lines, list):
        raise ManifestError(f"{where}: \"lines\" must be a list of {{\"text\", \"box\"}} objects")
    out: list[TruthLine] = []
    for i, line in enumerate(lines):
        at = f"{where}: lines[{i}]"
        if not isinstance(line, dict):
            raise ManifestError(f"{at} must be an object, not {_type(line)}")
        _no_unknown_keys(line, LINE_KEYS, at, "line")
        text, ignore = line.get("text"), line.get("ignore", False)
        if not isinstance(text, str):
            raise ManifestError(f"{at}: \"text\" must be a string")
        if not isinstance(ignore, bool):
            raise ManifestError(f"{at}: \"ignore\" must be true or false")
        box = _box(line["box"], frame, at, frame_name) if "box" in line else None
        if ignore and box is None:
            raise ManifestError(f"{at}: a don't-care line (\"ignore\": true) needs a \"box\"")
        out.append(TruthLine(text, box, ignore))
    boxed = [line.box is not None for line in out]
    if any(boxed) and not all(boxed):
        raise ManifestError(f"{where}: lines[{boxed.index(False)}] has no \"box\" while other lines have one "
                            "(give every line a box, or none)")
    return out


def _box(box: Any, frame: tuple[float, float], where: str, frame_name: str) -> tuple[float, float, float, float]:
    if (not isinstance(box, list) or len(box) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)):
        raise ManifestError(f"{where}: \"box\" must be [x1, y1, x2, y2] (four numbers), not {json.dumps(box)}")
    x1, y1, x2, y2 = (float(v) for v in box)
    if x1 >= x2 or y1 >= y2:
        raise ManifestError(f"{where}: box {json.dumps(box)} is empty (x1 < x2 and y1 < y2 are needed)")
    width, height = frame
    if x1 < 0 or y1 < 0 or x2 > width or y2 > height:
        raise ManifestError(f"{where}: box {json.dumps(box)} lies outside the {frame_name}")
    return x1, y1, x2, y2


def oriented_size(source: bytes | Path) -> tuple[int, int]:
    """(width, height) of a stored image with its EXIF orientation applied, from its header alone. Raises
    PIL.UnidentifiedImageError or OSError for what is not a readable image."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
        width, height = img.size
        if img.getexif().get(0x0112, 1) in _TRANSPOSED_ORIENTATIONS:
            width, height = height, width
    return width, height


def _image_frame(data: bytes, name: str, where: str) -> tuple[float, float]:
    from PIL import UnidentifiedImageError

    try:
        width, height = oriented_size(data)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ManifestError(f"{where}: {name} is not an image that can be read ({exc})") from None
    return float(width), float(height)


def image_frame_name(frame: tuple[float, float]) -> str:
    return f"image ({_size(frame)} px after EXIF orientation)"


def _pdf_page_sizes(data: bytes, where: str) -> list[tuple[float, float]]:
    """Each page's displayed size in PDF points (rotation applied), read with pypdfium2 from the user's own file."""
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        raise ManifestError(f"{where}: the PDF cannot be opened ({exc})") from None
    try:
        sizes = []
        for i in range(len(pdf)):
            page = pdf[i]
            width, height = page.get_size()
            if page.get_rotation() in (90, 270):
                width, height = height, width
            sizes.append((float(width), float(height)))
            page.close()
        return sizes
    finally:
        pdf.close()


def _no_unknown_keys(entry: dict, allowed: tuple[str, ...], where: str, what: str) -> None:
    unknown = [key for key in entry if key not in allowed]
    if unknown:
        raise ManifestError(f"{where}: unknown {what} key {unknown[0]!r} (allowed: {', '.join(allowed)})")


def _size(frame: tuple[float, float]) -> str:
    return "×".join(f"{v:g}" for v in frame)


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
