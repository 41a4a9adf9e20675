"""`ocr-serve eval sample DIR --n N --seed S`: a deterministic labelled sample set with exact truths.

Three kinds of document, in English and in Chinese, rendered with PIL; every piece of text is one `draw.text` call,
and its truth box is the renderer's own ink box of that text (`textbbox`), so boxes are exact:
- receipts (PNG): merchant, address, date, item and price columns, total; truths: lines, text, fields (merchant,
  date, total) and the items as an HTML table;
- ID cards (JPEG, every other one stored rotated with EXIF orientation 6, whose boxes are in the upright frame the
  API answers in): labels and values; truths: lines, text, fields;
- letters (PDF of one or two A4 pages at 150 dpi, boxes in PDF points): sender, date, recipient, paragraphs;
  truths per page: lines, text, markdown.

Document i is kind i mod 3 and, with `--lang both`, English for the first three of every six and Chinese for the
next three; its content comes from its own `random.Random(f"{seed}:{i}")`, so a set is the same on every run with
the same fonts. Fonts are found like the load-test documents': Debian's fonts-wqy-microhei (CJK and Latin), else
fonts-dejavu-core (Latin only: Chinese documents then refuse to render), else PIL's built-in font.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from service.eval import EvalError

FONT_CANDIDATES = (
    "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",  # CJK + Latin
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",  # Latin only
)
KINDS = ("receipt", "id_card", "letter")
LANGUAGES = ("en", "zh")
LETTER_DPI = 150.0
A4_PX = (1240, 1754)  # A4 at 150 dpi
POINTS_PER_PX = 72.0 / LETTER_DPI
EXIF_ORIENTATION = 0x0112
PDF_DATE = time.gmtime(946684800)  # fixed PDF dates: the same seed writes the same bytes

_MERCHANTS = {"en": ("Harbour Cafe", "Maple Bakery", "Station Deli", "River Market", "Park Grocery"),
              "zh": ("海港咖啡", "枫叶面包房", "车站熟食店", "河畔超市", "公园便利店")}
_ITEMS = {"en": ("Coffee", "Bagel", "Orange juice", "Sandwich", "Muffin", "Green tea", "Salad", "Water", "Croissant",
                 "Soup of the day"),
          "zh": ("咖啡", "面包", "橙汁", "三明治", "松饼", "绿茶", "沙拉", "矿泉水", "牛角包", "例汤")}
_STREETS = {"en": ("Harbour Road", "Maple Street", "Station Avenue", "River Lane", "Park Place"),
            "zh": ("人民路", "中山大道", "解放路", "建设街", "和平路")}
_CITIES = {"en": ("Shenzhen", "Berlin", "Lyon", "Osaka", "Toronto"), "zh": ("北京市", "上海市", "广州市", "深圳市", "杭州市")}
_GIVEN = ("Alice", "Maria", "Kenji", "Fatima", "Lukas", "Sofia", "Omar", "Chen")
_FAMILY = ("Smith", "Garcia", "Tanaka", "Haddad", "Rossi", "Novak", "Wang", "Moreau")
_ZH_NAMES = ("张伟", "王芳", "李娜", "刘洋", "陈静", "杨磊", "赵敏", "黄强")
_EN_WORDS = ("please find attached the signed contract for the delivery of office supplies we confirm the order "
             "and the payment terms agreed in our meeting the invoice will follow by post and the goods will be "
             "shipped from our warehouse next week do not hesitate to contact our office with any question about "
             "the schedule the prices or the reference number of this order").split()
_ZH_PHRASES = ("随函附上", "已签署的合同", "办公用品", "交货日期", "付款方式", "我们确认", "订单内容", "发票将",
               "另行寄出", "货物将于", "下周发出", "如有疑问", "请联系", "我们的办公室", "参考编号", "感谢合作")
_LABELS = {"en": {"header": "IDENTITY CARD", "name": "Name", "id_number": "ID No.", "date_of_birth": "Date of birth",
                  "address": "Address", "expiry_date": "Valid until"},
           "zh": {"header": "居民身份证", "name": "姓名", "id_number": "公民身份号码", "date_of_birth": "出生",
                  "address": "住址", "expiry_date": "有效期限"}}
_RECEIPT_WORDS = {"en": {"total": "TOTAL", "date": "Date", "thanks": "Thank you for your visit"},
                  "zh": {"total": "合计", "date": "日期", "thanks": "谢谢惠顾"}}


@dataclass
class SampleLine:
    text: str
    box: tuple[float, float, float, float]


@dataclass
class SamplePage:
    lines: list[SampleLine] = field(default_factory=list)
    markdown: str | None = None


@lru_cache(maxsize=1)
def font_file() -> str | None:
    for candidate in FONT_CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return None


@lru_cache(maxsize=32)
def load_font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    path = font_file()
    return ImageFont.truetype(path, size) if path else ImageFont.load_default(size=size)


def can_render(lang: str) -> bool:
    return lang == "en" or font_file() == FONT_CANDIDATES[0]


class Canvas:
    """A page that records the ink box of every text it draws."""

    def __init__(self, size: tuple[int, int], background: Any = "white"):
        self.image = Image.new("RGB", size, background)
        self.draw = ImageDraw.Draw(self.image)
        self.page = SamplePage()

    def text(self, xy: tuple[float, float], text: str, size: int, fill: Any = "black",
             anchor: str = "la") -> SampleLine:
        font = load_font(size)
        self.draw.text(xy, text, font=font, fill=fill, anchor=anchor)
        line = SampleLine(text, tuple(float(v) for v in self.draw.textbbox(xy, text, font=font, anchor=anchor)))
        self.page.lines.append(line)
        return line

    def width_of(self, text: str, size: int) -> float:
        return self.draw.textlength(text, font=load_font(size))


def write_sample(out: Path, n: int, seed: int, lang: str = "both") -> Path:
    """Write `out/manifest.jsonl` and `out/images/*`; returns the manifest's path."""
    languages = LANGUAGES if lang == "both" else (lang,)
    for language in languages:
        if not can_render(language):
            raise EvalError(f"Chinese sample documents need the font {FONT_CANDIDATES[0]} (Debian fonts-wqy-microhei); "
                            "install it or pass --lang en")
    if n < 1:
        raise EvalError("--n must be at least 1")
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        language = languages[(i // len(KINDS)) % len(languages)]
        rng = random.Random(f"{seed}:{i}")
        doc_id = f"{kind}-{language}-{i:03d}"
        entries.append(RENDERERS[kind](rng, language, doc_id, images, i))
    manifest = out / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries), encoding="utf-8")
    return manifest


def _truth(page: SamplePage, scale: float = 1.0) -> dict[str, Any]:
    lines = [{"text": line.text, "box": [round(v * scale, 2) for v in line.box]} for line in page.lines]
    return {"lines": lines, "text": "\n".join(line.text for line in page.lines)}


# --- receipts -----------------------------------------------------------------------------------------------------

def _receipt(rng: random.Random, lang: str, doc_id: str, folder: Path, index: int) -> dict[str, Any]:
    items = rng.sample(_ITEMS[lang], rng.randint(3, 6))
    prices = [f"{rng.randint(1, 24)}.{rng.choice((0, 20, 50, 80, 95)):02d}" for _ in items]
    total = f"{sum(float(p) for p in prices):.2f}"
    merchant = rng.choice(_MERCHANTS[lang])
    address = f"{rng.randint(1, 300)} {rng.choice(_STREETS[lang])}, {rng.choice(_CITIES[lang])}"
    date = f"{rng.randint(2021, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    words = _RECEIPT_WORDS[lang]
    width, left, right = 640, 40, 600
    canvas = Canvas((width, 360 + 64 * len(items) + 230), (252, 251, 247))
    canvas.text((width / 2, 40), merchant, 40, anchor="ma")
    canvas.text((width / 2, 104), address, 26, fill=(60, 60, 60), anchor="ma")
    canvas.text((left, 170), f"{words['date']}: {date}", 28)
    y = 240
    canvas.draw.line((left, y - 20, right, y - 20), fill=(120, 120, 120), width=2)
    for item, price in zip(items, prices):
        canvas.text((left, y), item, 30)
        canvas.text((right, y), price, 30, anchor="ra")
        y += 64
    canvas.draw.line((left, y, right, y), fill=(120, 120, 120), width=2)
    y += 30
    canvas.text((left, y), words["total"], 34)
    canvas.text((right, y), total, 34, anchor="ra")
    canvas.text((width / 2, y + 110), words["thanks"], 26, fill=(60, 60, 60), anchor="ma")
    name = f"{doc_id}.png"
    canvas.image.save(folder / name, format="PNG")
    table = "<table>" + "".join(f"<tr><td>{i}</td><td>{p}</td></tr>" for i, p in zip(items, prices)) + "</table>"
    return {"id": doc_id, "image": f"images/{name}", **_truth(canvas.page),
            "fields": {"merchant": merchant, "date": date, "total": total}, "tables": [table]}


# --- ID cards -----------------------------------------------------------------------------------------------------

def _id_card(rng: random.Random, lang: str, doc_id: str, folder: Path, index: int) -> dict[str, Any]:
    name = rng.choice(_ZH_NAMES) if lang == "zh" else f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}"
    year, month, day = rng.randint(1950, 2005), rng.randint(1, 12), rng.randint(1, 28)
    values = {
        "name": name,
        "id_number": "".join(str(rng.randint(0, 9)) for _ in range(17)) + rng.choice("0123456789X"),
        "date_of_birth": f"{year:04d}-{month:02d}-{day:02d}",
        "address": f"{rng.randint(1, 300)} {rng.choice(_STREETS[lang])}, {rng.choice(_CITIES[lang])}",
        "expiry_date": f"{rng.randint(2027, 2040):04d}-{month:02d}-{day:02d}",
    }
    labels = _LABELS[lang]
    canvas = Canvas((1000, 630), (226, 236, 246))
    canvas.draw.rounded_rectangle((10, 10, 990, 620), radius=30, outline=(70, 100, 150), width=4)
    canvas.text((40, 30), labels["header"], 44, fill=(30, 50, 110))
    canvas.draw.rectangle((700, 130, 940, 430), fill=(190, 200, 215), outline=(90, 100, 120), width=2)
    y = 120
    for key in ("name", "id_number", "date_of_birth", "address", "expiry_date"):
        canvas.text((40, y), labels[key], 24, fill=(90, 90, 90))
        canvas.text((40, y + 32), values[key], 34)
        y += 94
    image = canvas.image
    exif = Image.Exif()
    if index % 2:  # stored turned a quarter left; orientation 6 tells viewers (and the API) to turn it back
        image = image.transpose(Image.Transpose.ROTATE_90)
        exif[EXIF_ORIENTATION] = 6
    name_jpg = f"{doc_id}.jpg"
    image.save(folder / name_jpg, format="JPEG", quality=95, exif=exif.tobytes())
    return {"id": doc_id, "image": f"images/{name_jpg}", **_truth(canvas.page), "fields": values}


# --- letters ------------------------------------------------------------------------------------------------------

def _letter(rng: random.Random, lang: str, doc_id: str, folder: Path, index: int) -> dict[str, Any]:
    zh = lang == "zh"
    sender = rng.choice(_ZH_NAMES) if zh else f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}"
    recipient = rng.choice(_ZH_NAMES) if zh else f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}"
    pages_wanted = rng.randint(1, 2)
    paragraphs = [_paragraph(rng, zh) for _ in range(3 * pages_wanted)]
    body, margin, gap = 30, 110, 50
    pages: list[Canvas] = []

    def new_page() -> Canvas:
        pages.append(Canvas(A4_PX))
        return pages[-1]

    canvas = new_page()
    canvas.text((margin, 110), sender, body)
    canvas.text((margin, 110 + gap), f"{rng.randint(1, 300)} {rng.choice(_STREETS[lang])}", body)
    canvas.text((margin, 110 + 2 * gap), rng.choice(_CITIES[lang]), body)
    date = f"{rng.randint(2021, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    canvas.text((A4_PX[0] - margin, 110 + 3 * gap), date, body, anchor="ra")
    salutation = f"尊敬的{recipient}：" if zh else f"Dear {recipient},"
    canvas.text((margin, 380), salutation, body)
    y = 380 + gap + 20
    markdown: list[list[str]] = [[salutation]]
    for number, paragraph in enumerate(paragraphs):
        if number and number % 3 == 0:  # three paragraphs a page
            canvas, y = new_page(), 140
            markdown.append([])
        rows = _wrap(canvas, paragraph, body, A4_PX[0] - 2 * margin, zh)
        for row in rows:
            canvas.text((margin, y), row, body)
            y += gap
        markdown[-1].append(("" if zh else " ").join(rows))
        y += gap // 2
    closing = ["此致", "敬礼", sender] if zh else ["Yours sincerely,", sender]
    for row in closing:
        canvas.text((margin, y + 20), row, body)
        y += gap
    markdown[-1] += closing
    name = f"{doc_id}.pdf"
    images = [p.image for p in pages]
    images[0].save(folder / name, format="PDF", save_all=True, append_images=images[1:], resolution=LETTER_DPI,
                   creationDate=PDF_DATE, modDate=PDF_DATE)
    page_truths = []
    for number, (page, md) in enumerate(zip(pages, markdown), start=1):
        page_truths.append({"page": number, **_truth(page.page, POINTS_PER_PX), "markdown": "\n\n".join(md)})
    return {"id": doc_id, "image": f"images/{name}", "pages": page_truths}


def _paragraph(rng: random.Random, zh: bool) -> list[str]:
    if zh:
        return [rng.choice(_ZH_PHRASES) for _ in range(rng.randint(10, 16))]
    words = [rng.choice(_EN_WORDS) for _ in range(rng.randint(28, 44))]
    words[0] = words[0].capitalize()
    return words[:-1] + [words[-1] + "."]


def _wrap(canvas: Canvas, tokens: list[str], size: int, width: float, zh: bool) -> list[str]:
    joiner = "" if zh else " "
    rows, current = [], ""
    for token in tokens:
        candidate = f"{current}{joiner}{token}" if current else token
        if canvas.width_of(candidate, size) <= width or not current:
            current = candidate
        else:
            rows.append(current)
            current = token
    if current:
        rows.append(current + ("。" if zh else ""))
    return rows


RENDERERS = {"receipt": _receipt, "id_card": _id_card, "letter": _letter}

