"""Generated test documents for load tests and benchmarks: ID cards (1000×630 px) with known fields and A4 pages
(1240×1754 px, 150 dpi) with a chosen amount of text, ~500 characters for a "medium" one. Deterministic for a seed,
drawn with the Debian fonts (fonts-wqy-microhei for CJK + Latin, fonts-dejavu-core) or, without them, PIL's built-in
font: other glyphs, the same image size, and image size alone sets a VLM's token count.
"""

from __future__ import annotations

import argparse
import base64
import io
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

from PIL import Image, ImageDraw, ImageFont

FONT_CANDIDATES = (
    "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",  # CJK + Latin
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",  # Latin only
)

ID_CARD_SIZE = (1000, 630)
A4_SIZE = (1240, 1754)
MEDIUM_CHARS = 500

DocumentKind = Literal["id_card", "a4"]
Language = Literal["en", "zh", "mixed"]

ID_CARD_FIELDS = ("name", "id_number", "date_of_birth", "address", "expiry_date")

_EN_WORDS = (
    "invoice total amount customer order delivery payment account balance contract date number address service "
    "quantity price tax net gross reference period statement shipment warehouse product description unit discount "
    "report summary annual quarter revenue margin approved signature department office manager project schedule "
    "insurance policy claim coverage premium receipt transfer bank branch currency interest loan agreement terms"
).split()
_ZH_CHARS = (
    "发票号码金额合计客户订单日期地址服务数量单价税率总计账户余额合同编号付款方式银行转账"
    "收据保险保单理赔部门经理项目计划年度季度收入利润审批签字公司名称电话邮箱备注说明"
    "产品规格型号仓库物流运输交货条款协议甲乙双方责任"
)
_GIVEN = ("Alice", "Wei", "Maria", "Kenji", "Fatima", "Lukas", "Mei", "Omar", "Sofia", "Chen")
_FAMILY = ("Zhang", "Smith", "Garcia", "Tanaka", "Müller", "Li", "Haddad", "Rossi", "Wang", "Novak")
_ZH_NAMES = ("张伟", "王芳", "李娜", "刘洋", "陈静", "杨磊", "赵敏", "黄强")
_STREETS = ("Harbour Road", "Maple Street", "Station Avenue", "River Lane", "Park Place", "人民路", "中山大道")
_CITIES = ("Shenzhen", "Berlin", "Lyon", "Osaka", "Toronto", "北京市", "上海市")


@lru_cache(maxsize=1)
def font_file() -> str | None:
    """Path of the first installed Debian font, or None (PIL's built-in font is used then)."""
    return next((candidate for candidate in FONT_CANDIDATES if Path(candidate).exists()), None)


@lru_cache(maxsize=32)
def load_font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    path = font_file()
    return ImageFont.truetype(path, size) if path is not None else ImageFont.load_default(size=size)


def _can_render_cjk() -> bool:
    return font_file() == FONT_CANDIDATES[0]


@dataclass
class GeneratedDocument:
    """One rendered page and what is written on it."""

    kind: DocumentKind
    width: int
    height: int
    png: bytes = field(repr=False)
    text: str = field(repr=False)  # every rendered line, joined by newlines
    fields: dict[str, str] = field(default_factory=dict)  # ID cards: field name -> value
    seed: int = 0

    @property
    def chars(self) -> int:
        return sum(1 for c in self.text if not c.isspace())

    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode()


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    """The image's file bytes; PNG with fast compression (documents are generated per run, and encode time is not
    what is measured)."""
    buf = io.BytesIO()
    image.save(buf, format=fmt, **(options or {"compress_level": 1}))
    return buf.getvalue()


def _words(rng: random.Random, chars: int, lang: Language) -> list[str]:
    """Tokens totalling about `chars` non-space characters (CJK tokens are 2-4 ideographs)."""
    if lang != "en" and not _can_render_cjk():
        lang = "en"  # no CJK glyphs without wqy-microhei: keep the text renderable
    out, total = [], 0
    while total < chars:
        if lang == "zh" or (lang == "mixed" and rng.random() < 0.35):
            token = "".join(rng.choice(_ZH_CHARS) for _ in range(rng.randint(2, 4)))
        elif rng.random() < 0.12:
            token = (f"{rng.randint(1, 99999):,}" if rng.random() < 0.5
                     else f"{rng.randint(1, 9999)}.{rng.randint(0, 99):02d}")
        else:
            token = rng.choice(_EN_WORDS)
            if rng.random() < 0.1:
                token = token.capitalize()
        out.append(token)
        total += len(token)
    return out


def _wrap(draw: ImageDraw.ImageDraw, words: list[str], font, max_width: int) -> list[str]:
    lines, current = [], ""
    for word in words:
        candidate = f"{current} {word}" if current else word
        if draw.textlength(candidate, font=font) <= max_width or not current:
            current = candidate
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def render_a4(chars: int = MEDIUM_CHARS, *, seed: int = 0, lang: Language = "mixed") -> GeneratedDocument:
    """A page with a title and paragraphs totalling about `chars` characters (more text → smaller font, to fit)."""
    rng = random.Random(f"a4-{seed}-{chars}-{lang}")
    width, height = A4_SIZE
    margin = max(24, width // 12)
    # ~500 chars at 30 px fills a third of an A4 page at 150 dpi; dense pages shrink towards 14 px
    font_size = int(max(14, min(30, 30 * (2500 / max(chars, 1)) ** 0.5 / 2.2)))
    image = Image.new("RGB", A4_SIZE, "white")
    draw = ImageDraw.Draw(image)
    body_font = load_font(font_size)
    title = f"Statement {rng.randint(10000, 99999)}"
    draw.text((margin, margin), title, font=load_font(int(font_size * 1.5)), fill="black")
    rendered = [title]
    y = margin + int(font_size * 3)
    line_gap = int(font_size * 1.5)
    words = _words(rng, chars, lang)
    paragraphs, start = [], 0
    while start < len(words):  # paragraphs of 25-60 tokens
        step = rng.randint(25, 60)
        paragraphs.append(words[start:start + step])
        start += step
    for paragraph in paragraphs:
        for line in _wrap(draw, paragraph, body_font, width - 2 * margin):
            if y + line_gap > height - margin:
                break
            draw.text((margin, y), line, font=body_font, fill=(20, 20, 20))
            rendered.append(line)
            y += line_gap
        y += line_gap // 2
    return GeneratedDocument("a4", width, height, encode(image), "\n".join(rendered), seed=seed)


def id_card_fields(seed: int, lang: Language = "mixed") -> dict[str, str]:
    rng = random.Random(f"id-fields-{seed}")
    cjk = lang != "en" and _can_render_cjk() and rng.random() < (1.0 if lang == "zh" else 0.4)
    name = rng.choice(_ZH_NAMES) if cjk else f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}"
    places = None if _can_render_cjk() and lang != "en" else 5  # the CJK street and city names last
    year, month, day = rng.randint(1950, 2005), rng.randint(1, 12), rng.randint(1, 28)
    return {"name": name, "id_number": "".join(str(rng.randint(0, 9)) for _ in range(17)) + rng.choice("0123456789X"),
            "date_of_birth": f"{year:04d}-{month:02d}-{day:02d}",
            "address": f"{rng.randint(1, 300)} {rng.choice(_STREETS[:places])}, {rng.choice(_CITIES[:places])}",
            "expiry_date": f"{rng.randint(2027, 2040):04d}-{month:02d}-{day:02d}"}


def render_id_card(*, seed: int = 0, lang: Language = "mixed") -> GeneratedDocument:
    """A card with a header, a photo box and labelled fields (the values are returned as `fields`)."""
    width, height = ID_CARD_SIZE
    values = id_card_fields(seed, lang)
    image = Image.new("RGB", ID_CARD_SIZE, (226, 236, 246))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((10, 10, width - 10, height - 10), radius=30, outline=(70, 100, 150), width=4)
    header = "IDENTITY CARD 居民身份证" if _can_render_cjk() else "IDENTITY CARD"
    draw.text((40, 30), header, font=load_font(44), fill=(30, 50, 110))
    draw.rectangle((700, 130, 940, 430), fill=(190, 200, 215), outline=(90, 100, 120), width=2)
    label_font, value_font = load_font(26), load_font(36)
    labels = {"name": "Name", "id_number": "ID No.", "date_of_birth": "Date of birth", "address": "Address",
              "expiry_date": "Valid until"}
    rendered = [header]
    for i, name in enumerate(ID_CARD_FIELDS):
        draw.text((40, 130 + 90 * i), labels[name], font=label_font, fill=(90, 90, 90))
        draw.text((40, 160 + 90 * i), values[name], font=value_font, fill="black")
        rendered += [labels[name], values[name]]
    return GeneratedDocument("id_card", width, height, encode(image), "\n".join(rendered), dict(values), seed)


def make_documents(kind: DocumentKind, count: int = 4, *, chars: int = MEDIUM_CHARS,
                   lang: Language = "mixed") -> list[GeneratedDocument]:
    """`count` different documents of one kind (different text, same size: same token cost for a VLM)."""
    if kind == "id_card":
        return [render_id_card(seed=i, lang=lang) for i in range(count)]
    if kind == "a4":
        return [render_a4(chars, seed=i, lang=lang) for i in range(count)]
    raise ValueError(f"unknown document kind {kind!r} (id_card | a4)")


def main(argv: list[str] | None = None) -> int:
    """Write sample documents as PNG files: `python -m loadtest documents OUT_DIR [--kind a4] [--count 3]`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--kind", choices=["id_card", "a4"], default="a4")
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--chars", type=int, default=MEDIUM_CHARS, help="characters per A4 page")
    parser.add_argument("--lang", choices=["en", "zh", "mixed"], default="mixed")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for doc in make_documents(args.kind, args.count, chars=args.chars, lang=args.lang):
        path = args.out_dir / f"{doc.kind}-{doc.seed}.png"
        path.write_bytes(doc.png)
        print(f"{path}  {doc.width}x{doc.height}  {doc.chars} chars  {len(doc.png) // 1024} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
