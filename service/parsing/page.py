"""One page's geometry (the uploaded image and the copy the engine saw) and what parsing makes of the engine's
output for it. Coordinates in the API are always pixels of the uploaded image (EXIF orientation applied)."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.schema import Line


@dataclass
class PageGeometry:
    width: int  # uploaded image (after EXIF orientation)
    height: int
    engine_width: int  # image sent to the engine
    engine_height: int

    @property
    def scale(self) -> float:
        return self.engine_width / self.width if self.width else 1.0


@dataclass
class ParsedOutput:
    text: str
    lines: list[Line] = field(default_factory=list)
    fields: dict | None = None
    errors: list[str] | None = None
    confidence: float | None = None
    warnings: list[str] = field(default_factory=list)


def clamp_box(x1: float, y1: float, x2: float, y2: float, width: int, height: int) -> list[int] | None:
    """Round and clamp a box to the image; None when it is degenerate (no area left)."""
    xa, xb = sorted((x1, x2))
    ya, yb = sorted((y1, y2))
    box = [max(0, min(width, round(xa))), max(0, min(height, round(ya))),
           max(0, min(width, round(xb))), max(0, min(height, round(yb)))]
    if box[2] - box[0] < 1 or box[3] - box[1] < 1:
        return None
    return box


def box_polygon(box: list[int]) -> list[list[int]]:
    x1, y1, x2, y2 = box
    return [[x1, y1], [x2, y1], [x2, y2], [x1, y2]]
