"""HunyuanOCR spotting and layout output → items (text, 0-1000 points, category) with their character spans.

Formats read (auto-detected; all four seen in HunyuanOCR's own scorers, `train_verl/reward/task_scorers`):

1. ref-first   `<ref>text</ref><quad>(x1,y1),(x2,y2)</quad>`           (spotting_hunyuan)
2. quad-first  `<quad>(x1,y1),(x2,y2)</quad><ref>text</ref>`, also `<quad><pos_x1><pos_y1><pos_x2><pos_y2></quad>`
3. bare        `text(x1,y1),(x2,y2)` — format 1 after special tokens were stripped by the detokenizer (and its
               quad-first mirror `(x1,y1),(x2,y2)text`)
4. JSON        `[{"box": [x1,y1,x2,y2], "text": "…"}, …]`                (spotting_json; `bbox` accepted, fences too)
Layout (1.5): `text<hy-meta><layout>cat</layout><quad|poly>(x,y),…</quad|poly></hy-meta>` and
              `[{"layout_type": cat, "bbox": "(x,y),…" | [..], "text": …}]`.

Coordinates are HunyuanOCR's 0-1000 normalised units of the image the model saw; mapping to pixels happens in
service.parsing.vlm. Every item keeps `span`, the characters of the raw text that produced it (markup, text and
coordinates), so token logprobs can be attributed to it (service.parsing.confidence).

The parser is total: any string gives a result. A truncated last item (max_tokens, repetition cut) is dropped and
counted; text containing parentheses is kept whole, because items are anchored on complete coordinate groups.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

Point = tuple[float, float]

@dataclass
class SpottedItem:
    text: str
    points: list[Point]  # 0-1000; 2 points = opposite box corners, ≥ 3 = polygon
    span: tuple[int, int]  # characters of the raw output that produced this item
    category: str | None = None  # layout category


@dataclass
class SpottingParse:
    items: list[SpottedItem]
    format: str  # ref_quad | quad_ref | bare | bare_quad_first | json | layout_hymeta | layout_json | none
    dropped: int = 0  # incomplete or unreadable items (typically a truncated last one)
    warnings: list[str] = field(default_factory=list)


_NUM = r"\d+(?:\.\d+)?"
_POINT = rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)"
_POINT_RE = re.compile(_POINT)
_POS_RE = re.compile(r"<pos_(\d+)>")
# tagged coordinates: "(x,y),(x,y)[,…]" or "<pos_x><pos_y><pos_x><pos_y>"
_COORDS = rf"(?:{_POINT}(?:\s*,\s*{_POINT})+|(?:<pos_\d+>){{4}})"
_COORDS_NG = _COORDS.replace("(" + _NUM + ")", _NUM)  # same, without capture groups
_TEXT = r"((?:(?!</?ref>|</?quad>|</?box>|</?poly>).)*?)"
_TAGGED = re.compile(
    rf"<ref>{_TEXT}</ref>\s*<(?:quad|box|poly)>\s*({_COORDS_NG})\s*</(?:quad|box|poly)>"
    rf"|<(?:quad|box|poly)>\s*({_COORDS_NG})\s*</(?:quad|box|poly)>\s*<ref>{_TEXT}</ref>",
    re.DOTALL,
)
_HYMETA = re.compile(
    r"<hy-meta>\s*<layout>([^<]*)</layout>\s*<(?:quad|poly|box)>\s*([^<]*?)\s*</(?:quad|poly|box)>\s*</hy-meta>",
    re.DOTALL,
)
# bare coordinates: no spaces (as the model emits them), at least two points
_BARE_COORDS = re.compile(r"\(\d+(?:\.\d+)?,\d+(?:\.\d+)?\)(?:,\(\d+(?:\.\d+)?,\d+(?:\.\d+)?\))+")
# special tokens and leftover markup that never belong to an item's text
_SPECIAL = re.compile(r"<[｜|][^<>]{0,128}?[｜|]>|</?(?:ref|quad|box|poly|hy-meta|layout)>|<pos_\d+>|```[\w-]*")
_FENCE_OPEN = re.compile(r"\A\s*```[\w-]*[ \t]*\n?")


def parse_points(coords: str) -> list[Point]:
    """`(x,y),(x,y)…` or `<pos_x><pos_y>…` → points (0-1000 units); [] if unreadable."""
    if "<pos_" in coords:
        values = [float(v) for v in _POS_RE.findall(coords)]
        return [(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
    return [(float(x), float(y)) for x, y in _POINT_RE.findall(coords)]


_NOISE = re.compile(r"<[｜|][^<>]{0,128}?[｜|]>|```[\w-]*")


def _clean_text(text: str) -> str:
    return _SPECIAL.sub("", text).strip()


def _leftover(text: str) -> bool:
    """Output between/after items that is more than blanks, fences and special tokens (an incomplete item)."""
    return bool(_NOISE.sub("", text).strip())


def _box_points(box) -> list[Point] | None:
    """A JSON `box`/`bbox` value: [x1,y1,x2,y2], [[x,y],…] or a "(x,y),(x,y)" string."""
    if isinstance(box, str):
        points = parse_points(box)
        return points if len(points) >= 2 else None
    if not isinstance(box, list) or not box:
        return None
    try:
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
            if len(box) < 4 or len(box) % 2:
                return None
            return [(float(box[i]), float(box[i + 1])) for i in range(0, len(box), 2)]
        if all(isinstance(p, (list, tuple)) and len(p) == 2 for p in box) and len(box) >= 2:
            return [(float(p[0]), float(p[1])) for p in box]
    except (TypeError, ValueError):
        return None
    return None


def _looks_like_json(text: str, start: int) -> bool:
    head = text[start:start + 1]
    if head == "[" and re.match(r"\[\s*\]", text[start:]):
        return True  # an empty line list
    return head in ("[", "{") and bool(re.search(r'"(?:box|bbox|layout_type)"\s*:', text))


def _parse_json(text: str, start: int) -> SpottingParse:
    """Items of a JSON array (or a stream of objects), one `raw_decode` at a time: a truncated tail stays readable."""
    decoder = json.JSONDecoder(strict=False)
    items: list[SpottedItem] = []
    dropped = 0
    is_layout = False
    if start >= len(text):
        return SpottingParse(items, "json", 0)
    pos = start + 1 if text[start] == "[" else start
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        if text[pos] != "{":
            dropped += 1
            break
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            dropped += 1  # truncated (or broken) object: nothing after it can be trusted
            break
        box = obj.get("box", obj.get("bbox")) if isinstance(obj, dict) else None
        points = _box_points(box)
        if points is None:
            dropped += 1
        else:
            content = obj.get("text", "")
            category = obj.get("layout_type", obj.get("category"))
            is_layout = is_layout or category is not None
            items.append(SpottedItem(
                text=(content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)).strip(),
                points=points, span=(pos, end), category=str(category).strip() if category is not None else None,
            ))
        pos = end
    return SpottingParse(items, "layout_json" if is_layout else "json", dropped)


def _parse_tagged(text: str, start: int = 0) -> SpottingParse:
    items: list[SpottedItem] = []
    fmt = "ref_quad"
    last = start
    gaps = 0
    for m in _TAGGED.finditer(text, start):
        if m.group(1) is not None or m.group(2) is not None:
            content, coords = m.group(1), m.group(2)
        else:
            content, coords, fmt = m.group(4), m.group(3), "quad_ref"
        gaps += _leftover(text[last:m.start()])
        points = parse_points(coords)
        if len(points) >= 2:
            items.append(SpottedItem(_clean_text(content), points, (m.start(), m.end())))
        else:
            gaps += 1
        last = m.end()
    dropped = gaps + _leftover(text[last:])
    return SpottingParse(items, fmt, dropped)


def _parse_hymeta(text: str, start: int = 0) -> SpottingParse:
    """Layout: each element's text precedes its `<hy-meta>` block (it may hold markdown/HTML, so take all of it)."""
    items: list[SpottedItem] = []
    last = start
    dropped = 0
    for m in _HYMETA.finditer(text, start):
        points = parse_points(m.group(2))
        if len(points) >= 2:
            items.append(SpottedItem(_clean_text(text[last:m.start()]), points, (last, m.end()),
                                     category=m.group(1).strip()))
        else:
            dropped += 1
        last = m.end()
    dropped += _leftover(text[last:])
    return SpottingParse(items, "layout_hymeta", dropped)


def _bare_points(group: str, keep: str) -> tuple[list[Point], int]:
    """Points of a bare coordinate run; a run of 3 or > 4 points lends its extra points to the neighbouring text
    (`keep` = which end holds the coordinates). Returns the points and how many characters of the run they use."""
    pieces = re.findall(r"\([^()]*\)", group)
    if len(pieces) in (2, 4):
        use = pieces
    else:
        take = 2 if len(pieces) == 3 else 4
        use = pieces[-take:] if keep == "end" else pieces[:take]
    used = ",".join(use)
    return parse_points(used), len(used)


def _parse_bare(text: str, start: int = 0, quad_first: bool | None = None) -> SpottingParse:
    """`text(x1,y1),(x2,y2)` items back to back (or the quad-first mirror); anchored on complete coordinate runs."""
    runs = list(_BARE_COORDS.finditer(text, start))
    if not runs:
        return SpottingParse([], "none", 1 if _clean_text(text[start:]) else 0)
    items: list[SpottedItem] = []
    dropped = 0
    if quad_first is None:
        quad_first = not _clean_text(text[start:runs[0].start()])
    if not quad_first:
        last = start
        for m in runs:
            points, used = _bare_points(m.group(0), "end")
            coord_start = m.end() - used
            content = _clean_text(text[last:coord_start])
            if content:
                items.append(SpottedItem(content, points, (last, m.end())))
            else:
                dropped += 1
            last = m.end()
        dropped += bool(_clean_text(text[last:]))
        return SpottingParse(items, "bare", dropped)
    for i, m in enumerate(runs):
        points, used = _bare_points(m.group(0), "start")
        end = runs[i + 1].start() if i + 1 < len(runs) else len(text)
        content = _clean_text(text[m.start() + used:end])
        if i + 1 == len(runs) and not content:
            dropped += 1  # coordinates whose text never came (truncated)
            continue
        items.append(SpottedItem(content, points, (m.start(), end)))
    return SpottingParse(items, "bare_quad_first", dropped)


def parse_spotting(text: str) -> SpottingParse:
    """Items of any supported spotting/layout format; never raises."""
    fence = _FENCE_OPEN.match(text)
    start = fence.end() if fence else 0
    while start < len(text) and text[start].isspace():
        start += 1
    if start < len(text) and _looks_like_json(text, start):
        result = _parse_json(text, start)
    elif "<hy-meta>" in text:
        result = _parse_hymeta(text)
    elif re.search(r"<(?:ref|quad)>", text):
        result = _parse_tagged(text)
    else:
        result = _parse_bare(text)
    if result.dropped:
        result.warnings.append(f"{result.dropped} incomplete or unreadable item(s) in the model output were skipped")
    return result


def _parse_from(fmt: str, text: str, start: int) -> SpottingParse:
    """Continue parsing a known format from `start` (the end of the last complete item)."""
    if fmt in ("json", "layout_json"):
        return _parse_json(text, start)
    if fmt == "layout_hymeta":
        return _parse_hymeta(text, start)
    if fmt in ("ref_quad", "quad_ref"):
        return _parse_tagged(text, start)
    return _parse_bare(text, start, quad_first=fmt == "bare_quad_first")


def complete_items(parse: SpottingParse, text_len: int) -> list[SpottedItem]:
    """Items that can no longer change while more output streams in (everything except an item at the very end)."""
    items = parse.items
    if items and items[-1].span[1] >= text_len:
        return items[:-1]
    return items


class IncrementalSpotting:
    """Lines as they complete while output streams in (for SSE `line` events); each item is returned once.

    The format is detected on the whole text until the first item completes, then parsing resumes after the last
    complete item, so the cost per delta stays proportional to the unfinished tail.
    """

    def __init__(self) -> None:
        self.text = ""
        self.format: str | None = None
        self.offset = 0  # end of the last item returned

    def feed(self, delta: str) -> list[SpottedItem]:
        self.text += delta
        if not delta or not any(c in delta for c in ")>}]"):
            return []  # no item can have completed
        if self.format is None:
            parse = parse_spotting(self.text)
        else:
            parse = _parse_from(self.format, self.text, self.offset)
        new = complete_items(parse, len(self.text))
        if new:
            self.format = parse.format
            self.offset = new[-1].span[1]
        return new
