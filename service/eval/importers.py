"""`ocr-serve eval import FORMAT SRC OUT.jsonl`: public annotation formats to the eval manifest.

- `funsd`: FUNSD form annotations (`annotations/*.json` beside `images/*.png`): every entity of `form[]` with text
  becomes a line (its `text` and `box`); its `words[]` are not used (lines are what the service returns).
- `icdar`: ICDAR 2015-style ground truth text files (`gt_img_1.txt` for `img_1.jpg`), one region a line
  `x1,y1,x2,y2,x3,y3,x4,y4,transcription` (the transcription may hold commas). A quadrilateral becomes its
  axis-aligned bounding box, clamped to the image; `###` marks an illegible region, imported as a don't-care line
  (`"ignore": true`): a detection lying mostly inside it is neither a false positive nor a match, and it is not
  part of the text truth.

Image paths in the manifest are relative to the manifest's folder, as the manifest format wants. Boxes are checked
against the image's size the way `ocr-serve eval` checks them, so an import that succeeds loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from service.eval import EvalError
from service.eval.manifest import oriented_size

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp", ".gif")
DONT_CARE = "###"


class ImportErrorLine(EvalError):
    """One line naming the source file (and line) that could not be imported."""


def import_dataset(fmt: str, src: Path, out: Path, images: Path | None = None) -> dict[str, int]:
    """Write the manifest; returns counts (documents, lines, skipped lines)."""
    readers = {"funsd": _funsd, "icdar": _icdar}
    if fmt not in readers:
        raise EvalError(f"unknown import format {fmt!r} (funsd | icdar)")
    if not src.exists():
        raise EvalError(f"{src}: not found")
    counts = {"documents": 0, "lines": 0, "skipped": 0}
    entries = list(readers[fmt](src, images, counts))
    if not entries:
        raise EvalError(f"{src}: no {fmt} annotation files found")
    out.parent.mkdir(parents=True, exist_ok=True)
    base = out.parent.resolve()
    with out.open("w", encoding="utf-8") as fh:
        for entry in entries:
            entry["image"] = Path(os.path.relpath(entry["image"].resolve(), base)).as_posix()
            fh.write(json.dumps(entry, ensure_ascii=False) + "\n")
    counts["documents"] = len(entries)
    return counts


# --- FUNSD --------------------------------------------------------------------------------------------------------

def _funsd(src: Path, images: Path | None, counts: dict[str, int]) -> Iterator[dict[str, Any]]:
    files = [src] if src.is_file() else sorted((src / "annotations" if (src / "annotations").is_dir() else src)
                                               .glob("*.json"))
    for file in files:
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            form = data["form"]
            if not isinstance(form, list):
                raise TypeError("form is not a list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ImportErrorLine(f"{file}: not a FUNSD annotation ({exc})") from None
        image = _find_image(file.stem, images or _sibling_images(file))
        width, height = _image_size(image)
        lines = []
        for i, entity in enumerate(form):
            text = str(entity.get("text", "")).strip() if isinstance(entity, dict) else ""
            box = _clamped(entity.get("box") if isinstance(entity, dict) else None, width, height)
            if not text or box is None:  # FUNSD has entities with no text (checkboxes) and degenerate boxes
                counts["skipped"] += 1
                continue
            lines.append({"text": text, "box": box})
        counts["lines"] += len(lines)
        yield {"id": file.stem, "image": image, "lines": lines}


def _sibling_images(annotation: Path) -> Path:
    parent = annotation.parent
    if parent.name == "annotations" and (parent.parent / "images").is_dir():
        return parent.parent / "images"
    return parent


# --- ICDAR --------------------------------------------------------------------------------------------------------

def _icdar(src: Path, images: Path | None, counts: dict[str, int]) -> Iterator[dict[str, Any]]:
    files = [src] if src.is_file() else sorted(src.glob("*.txt"))
    for file in files:
        stem = file.stem[3:] if file.stem.startswith("gt_") else file.stem
        image = _find_image(stem, images or file.parent)
        width, height = _image_size(image)
        try:
            text = file.read_text(encoding="utf-8-sig")  # the ICDAR 2015 files start with a BOM
        except (OSError, UnicodeDecodeError) as exc:
            raise ImportErrorLine(f"{file}: cannot read ({exc})") from None
        lines = []
        for number, row in enumerate(text.splitlines(), start=1):
            if not row.strip():
                continue
            parts = row.split(",", 8)
            try:
                if len(parts) != 9:
                    raise ValueError("fewer than nine comma-separated values")
                coords = [float(v) for v in parts[:8]]
            except ValueError as exc:
                raise ImportErrorLine(f"{file}:{number}: expected x1,y1,x2,y2,x3,y3,x4,y4,transcription "
                                      f"({exc})") from None
            xs, ys = coords[0::2], coords[1::2]
            box = _clamped([min(xs), min(ys), max(xs), max(ys)], width, height)
            if box is None:
                counts["skipped"] += 1
                continue
            transcription = parts[8].strip()
            if transcription == DONT_CARE:
                lines.append({"text": DONT_CARE, "box": box, "ignore": True})
            else:
                lines.append({"text": transcription, "box": box})
        counts["lines"] += sum(1 for line in lines if not line.get("ignore"))
        yield {"id": stem, "image": image, "lines": lines}


# --- shared -------------------------------------------------------------------------------------------------------

def _find_image(stem: str, folder: Path) -> Path:
    for suffix in IMAGE_SUFFIXES:
        for candidate in (folder / f"{stem}{suffix}", folder / f"{stem}{suffix.upper()}"):
            if candidate.is_file():
                return candidate
    raise ImportErrorLine(f"no image {stem}.png/.jpg/... in {folder} (pass --images DIR)")


def _image_size(path: Path) -> tuple[int, int]:
    """Size with EXIF orientation applied: the frame the manifest's boxes are in."""
    from PIL import UnidentifiedImageError

    try:
        return oriented_size(path)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImportErrorLine(f"{path}: not a readable image ({exc})") from None


def _clamped(box: Any, width: int, height: int) -> list[float] | None:
    """[x1, y1, x2, y2] clamped to the image, or None when it is not a box or has no area left."""
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        return None
    try:
        x1, y1, x2, y2 = (float(v) for v in box)
    except (TypeError, ValueError):
        return None
    x1, x2 = sorted((min(max(x1, 0.0), width), min(max(x2, 0.0), width)))
    y1, y2 = sorted((min(max(y1, 0.0), height), min(max(y2, 0.0), height)))
    if x2 <= x1 or y2 <= y1:
        return None
    return [_num(x1), _num(y1), _num(x2), _num(y2)]


def _num(value: float) -> float | int:
    value = float(value)
    return int(value) if value.is_integer() else round(value, 2)
