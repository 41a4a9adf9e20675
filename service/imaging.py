"""Image admission: bytes from the client → a validated, oriented RGB image, or a 4xx with a stable code.

Order matters for safety: base64 is decoded strictly, the real type is sniffed from magic bytes (Content-Type is
ignored), width/height/frames are read from the header *before* pixels are decoded (decompression bombs), then the
image is decoded, EXIF orientation applied, odd colour modes normalised, and re-encoded as PNG for the engine so no
original container bytes ever reach it.

One exception to "decode here": a bare 8-bit RGB PNG (pixel chunks only, every CRC right) is already the form the
engine takes. With `defer_pixels` its pixels are not decoded here at all when it goes on unchanged: the engine
replica decodes every PNG page anyway, and answers `invalid_image` when the pixel stream is corrupt
(`EngineRequest.pil_image`). That saves one full decode per page on the request path.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import re
import warnings
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from PIL import ExifTags, Image, ImageOps

from service.errors import OCRError

# magic bytes -> Pillow format name
_MAGIC: list[tuple[bytes, int, str]] = [
    (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
    (b"\xff\xd8\xff", 0, "JPEG"),
    (b"GIF87a", 0, "GIF"),
    (b"GIF89a", 0, "GIF"),
    (b"BM", 0, "BMP"),
    (b"II*\x00", 0, "TIFF"),
    (b"MM\x00*", 0, "TIFF"),
    (b"%PDF-", 0, "PDF"),
]
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)
_B64_CHARS = re.compile(rb"^[A-Za-z0-9+/]*={0,2}$")
_B64URL_CHARS = re.compile(rb"^[A-Za-z0-9_-]*={0,2}$")


def decode_base64_image(value: str, max_bytes: int) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, optional `data:` URL prefix, whitespace allowed) → bytes."""
    text = value.strip()
    match = _DATA_URL.match(text)
    if match:
        if not match.group("b64"):
            raise OCRError("invalid_base64", "data URL must be base64-encoded (`;base64,`)")
        text = text[match.end():]
    raw = "".join(text.split()).encode("ascii", errors="replace")  # any whitespace; 15× faster than re.sub
    if not raw:
        raise OCRError("empty_image", "the image is empty")
    # base64 is 4/3 of the payload: refuse before allocating the decoded copy
    if len(raw) * 3 // 4 > max_bytes:
        raise OCRError("payload_too_large", f"decoded image would exceed {max_bytes} bytes")
    if _B64_CHARS.match(raw):
        alphabet = None
    elif _B64URL_CHARS.match(raw):
        alphabet = b"-_"
    else:
        raise OCRError("invalid_base64", "the image is not valid base64 (unexpected characters)")
    raw = raw.rstrip(b"=")
    if len(raw) % 4 == 1:
        raise OCRError("invalid_base64", "the image is not valid base64 (bad length)")
    raw += b"=" * (-len(raw) % 4)
    try:
        data = base64.b64decode(raw, altchars=alphabet, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise OCRError("invalid_base64", "the image is not valid base64") from exc
    if not data:
        raise OCRError("empty_image", "the image is empty")
    return data


def sniff_format(data: bytes) -> str | None:
    """Format name from magic bytes, or None when unknown."""
    for magic, offset, name in _MAGIC:
        if data[offset:offset + len(magic)] == magic:
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


@dataclass
class DecodedImage:
    image: Image.Image | None  # RGB, EXIF orientation applied; None until `pixels()` for a deferred bare PNG
    format: str
    width: int
    height: int
    # the upload itself when it is a bare RGB PNG (pixel chunks only) of exactly these pixels: sent on unchanged
    # unless resized, which saves the re-encode (ingress CPU per page 2-3× lower: `bench cpu --parts admission`)
    png: bytes | None = None

    def pixels(self) -> Image.Image:
        """The RGB image, decoded now if admission deferred it (a bare PNG); a corrupt pixel stream is the
        client's `invalid_image`, as in `decode_image`."""
        if self.image is None:
            assert self.png is not None, "a deferred image keeps its PNG"
            self.image = decode_png_pixels(self.png, self.width, self.height)
        return self.image


def image_format(data: bytes, allowed_formats: list[str]) -> str:
    """The image's real format (magic bytes) if it is an accepted image; OCRError otherwise."""
    if not data:
        raise OCRError("empty_image", "the image is empty")
    fmt = sniff_format(data)
    if fmt is None:
        raise OCRError("unsupported_media_type", "the file is not an image of a supported type")
    if fmt == "PDF":
        raise OCRError("unsupported_media_type", "PDF is handled by the PDF path, not as an image")
    if fmt not in allowed_formats:
        raise OCRError("unsupported_media_type", f"{fmt} images are not accepted")
    return fmt


def probe_image(data: bytes, *, allowed_formats: list[str], max_pixels: int, max_side: int) -> tuple[str, int, int]:
    """(format, width, height) from the image's header, its size limits checked, no pixel decoded: what a request
    is charged by before it is decoded, and what a job's decoded-pixel budget counts. Width and height are before
    any EXIF rotation (the pixel count is the same). Microseconds for a well-formed header; run it off the event
    loop all the same (a hostile file can make a header parser walk megabytes of markers)."""
    fmt = image_format(data, allowed_formats)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[fmt]) as img:
                width, height = img.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise OCRError("image_too_large", "image exceeds the decompression limit") from exc
    except Exception as exc:  # noqa: BLE001 — whatever a header parser raises on hostile bytes is the file's fault
        raise OCRError("invalid_image", f"the {fmt} file could not be decoded (corrupt or truncated)") from exc
    _check_size(width, height, max_pixels=max_pixels, max_side=max_side)
    return fmt, width, height


def decode_image(data: bytes, *, allowed_formats: list[str], max_pixels: int, max_side: int,
                 max_frames: int, defer_pixels: bool = False) -> DecodedImage:
    """Validate and decode image bytes. Raises OCRError with a stable code for every client mistake.

    `defer_pixels`: a bare 8-bit RGB PNG is checked from its chunks (structure, CRCs, header limits) and its pixels
    are left undecoded (`DecodedImage.pixels()` decodes them if the page needs a resize; otherwise the engine
    decodes, and validates, them). Only for callers that hand the page to an engine right away."""
    fmt = image_format(data, allowed_formats)
    # a bare PNG (no EXIF, 8-bit RGB) is already the engine's form: it may go on as it is, decoded here or not
    bare_size = bare_rgb_png_size(data) if fmt == "PNG" else None
    if defer_pixels and bare_size is not None:
        _check_size(*bare_size, max_pixels=max_pixels, max_side=max_side)
        return DecodedImage(image=None, format=fmt, width=bare_size[0], height=bare_size[1], png=data)
    try:
        with warnings.catch_warnings():
            # Our own pixel cap is below Pillow's; turn Pillow's bomb warning into an error too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt])
            width, height = img.size  # from the header: no pixels decoded yet
            _check_size(width, height, max_pixels=max_pixels, max_side=max_side)
            if _too_many_frames(img, max_frames):
                raise OCRError("image_too_large", f"image has more than {max_frames} frame(s); "
                               f"at most {max_frames} accepted")
            if fmt == "PNG":
                load_png_whole(img, data)
            else:
                img.load()
            upright = img.getexif().get(ExifTags.Base.Orientation, 1) == 1
            if not upright:  # exif_transpose copies even an upright image: a third of an A4 page's decode time
                img = ImageOps.exif_transpose(img)
            img = _to_rgb(img)
    except OCRError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise OCRError("image_too_large", "image exceeds the decompression limit") from exc
    except PngRowsMissing as exc:
        raise OCRError("invalid_image", str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 — whatever a decoder raises on hostile bytes is the file's fault
        # (OSError, SyntaxError, struct.error, ZeroDivisionError, MemoryError, ... seen from Pillow's plugins)
        raise OCRError("invalid_image", f"the {fmt} file could not be decoded (corrupt or truncated)") from exc
    return DecodedImage(image=img, format=fmt, width=img.width, height=img.height,
                        png=data if bare_size is not None else None)


def _check_size(width: int, height: int, *, max_pixels: int, max_side: int) -> None:
    if width <= 0 or height <= 0:
        raise OCRError("invalid_image", "the image has no pixels")
    if width * height > max_pixels or max(width, height) > max_side:
        raise OCRError("image_too_large",
                       f"image is {width}x{height}; limits are {max_pixels} pixels and {max_side} px per side")


def decode_png_pixels(data: bytes, width: int, height: int) -> Image.Image:
    """The RGB pixels of a PNG whose header was already admitted as `width`×`height` (a deferred bare PNG, in the
    ingress or in an engine replica): whatever the decoder raises on its pixel stream is the file's fault."""
    try:
        img = Image.open(io.BytesIO(data), formats=["PNG"])
        if img.size != (width, height):
            raise ValueError(f"the PNG is {img.size}, not the admitted {width}x{height}")
        load_png_whole(img, data)
        return img if img.mode == "RGB" else img.convert("RGB")
    except PngRowsMissing as exc:
        raise OCRError("invalid_image", str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 — zlib.error, OSError (truncated), ValueError, ... on hostile bytes
        raise OCRError("invalid_image", "the PNG file could not be decoded (corrupt pixel data)") from exc


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Pillow decodes a PNG whose zlib stream ends cleanly after a whole row, before the last one, without an error: the
# rows it never wrote keep the image memory's first value (black). Such a file is damaged, not a page with a black
# bottom. So the memory starts in an unlikely colour instead, and only when a pixel of the last two rows still holds
# it (a row never written, or rarely a real pixel) are the PNG's rows counted, with one more inflate of its data.
# Two rows: an interlaced PNG's last pass writes the odd rows, so a cut one misses the last or the one before it.
_UNWRITTEN_8BIT = (17, 201, 99, 7)
_UNWRITTEN_WIDE = 40961  # 16- and 32-bit grey
# Adam7 passes: first column, first row, column step, row step
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type


class PngRowsMissing(ValueError):
    """A PNG whose image data ends before its last row."""


def load_png_whole(img: Image.Image, data: bytes) -> None:
    """`img.load()` for a PNG opened from `data`; PngRowsMissing when its image data ends before its last row."""
    marker = _unwritten_marker(img.mode)
    if marker is not None:
        try:
            img.im = Image.core.fill(img.mode, img.size, marker)  # ImageFile.load_prepare keeps memory it finds
        except (ValueError, TypeError):
            marker = None  # a mode Pillow cannot fill: the rows are counted instead
    img.load()
    if (marker is None or _marker_in_last_rows(img, marker)) and not png_rows_complete(data):
        raise PngRowsMissing("the PNG's image data ends before its last row (a cut or damaged file)")


def _unwritten_marker(mode: str) -> int | tuple[int, ...] | None:
    if mode == "1":
        return None  # two values only: every bilevel PNG gets the count (at 1 bit a pixel, a cheap one)
    if mode.startswith("I"):
        return _UNWRITTEN_WIDE
    bands = Image.getmodebands(mode)
    return _UNWRITTEN_8BIT[1] if bands == 1 else _UNWRITTEN_8BIT[:bands]


def _marker_in_last_rows(img: Image.Image, marker: int | tuple[int, ...]) -> bool:
    """Whether the marker pixel's bytes occur in the last two rows (at a pixel's start or, rarely, across two
    pixels: then the rows are counted for nothing). 15 µs for an ID card's rows."""
    rows = img.crop((0, max(0, img.height - 2), img.width, img.height)).tobytes()
    return Image.new(img.mode, (1, 1), marker).tobytes() in rows


def png_rows_complete(data: bytes) -> bool:
    """Whether a PNG's IDAT data inflates to every row its header declares (all seven passes when interlaced).
    Inflates at most 1 MiB at a time and stops at the last row (the stream's checksum is not read: Pillow decoded
    the rows before this runs), so a zlib bomb costs no memory here."""
    header, pieces = None, []
    for kind, body, _, _ in _png_chunks(data):
        if kind == b"IHDR" and len(body) == 13:
            header = body
        elif kind == b"IDAT":
            pieces.append(body)
        elif kind == b"IEND":
            break
    if header is None or header[9] not in _PNG_CHANNELS:
        return False
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    bits = _PNG_CHANNELS[header[9]] * header[8]
    grids = _ADAM7 if header[12] else ((0, 0, 1, 1),)
    needed = 0
    for x0, y0, dx, dy in grids:
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if columns > 0 and rows > 0:
            needed += rows * (1 + (columns * bits + 7) // 8)  # each row: its filter byte, then its pixels
    # raw deflate after the 2-byte zlib header (PNG has no preset dictionary): the adler32 after the last block is
    # not checked, and zlib.error would drop the output of the call that raised it
    stream, inflater, produced = b"".join(pieces)[2:], zlib.decompressobj(-zlib.MAX_WBITS), 0
    try:
        while stream and produced < needed and not inflater.eof:
            produced += len(inflater.decompress(stream, min(1 << 20, needed - produced)))
            stream = inflater.unconsumed_tail
    except zlib.error:
        return False  # broken before the rows were out
    return produced >= needed


def bare_rgb_png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG that may go to the engine as it is, and whose pixels the engine may decode in our
    place: IHDR first, 8-bit RGB, not interlaced, then IDAT chunks and IEND only (no text, ICC or EXIF chunk), nothing
    after IEND (no polyglot's payload), and every chunk's CRC right (a damaged or truncated upload gets the full
    decode here, which refuses it). None for anything else. Reads no pixels: 0.04-0.08 ms for an ID card or A4 page."""
    if not data.startswith(_PNG_SIGNATURE):
        return None
    size, idat = None, False
    for kind, body, end, crc in _png_chunks(data):
        if end > len(data) or zlib.crc32(body, zlib.crc32(kind)) != crc:
            return None
        if size is None:  # IHDR: width, height, bit depth 8, colour type 2 (RGB), compression/filter/interlace 0
            if kind != b"IHDR" or len(body) != 13 or body[8:] != b"\x08\x02\x00\x00\x00":
                return None
            size = (int.from_bytes(body[0:4], "big"), int.from_bytes(body[4:8], "big"))
        elif kind == b"IDAT":
            idat = True
        elif kind == b"IEND":
            return size if idat and end == len(data) and not body else None
        else:
            return None
    return None


def _png_chunks(data: bytes) -> Iterator[tuple[bytes, bytes, int, int]]:
    """(kind, body, end offset, stored CRC) of each chunk after the signature, in order. A last chunk that runs
    past the data has `end` > len(data), its body cut short and CRC -1."""
    pos = len(_PNG_SIGNATURE)
    while pos + 12 <= len(data):
        end = pos + 12 + int.from_bytes(data[pos:pos + 4], "big")
        crc = int.from_bytes(data[end - 4:end], "big") if end <= len(data) else -1
        yield data[pos + 4:pos + 8], data[pos + 8:end - 4], end, crc
        pos = end


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any mode (palette, CMYK, 16-bit, alpha) → 8-bit RGB; transparency composited on white."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16-bit (and 32-bit integer) grey → 8-bit by dropping the low byte; numpy handles every byte order
        grey = (np.clip(np.asarray(img, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA"):
        rgba = img.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return img.convert("RGB")


# formats whose extra frames are content (animations, multi-page scans); MPO's extra frames are previews/depth maps
# of the same photo, so only its first frame is read and it is never rejected for its frame count
_MULTI_FRAME_FORMATS = ("GIF", "TIFF", "PNG", "WEBP")


def _too_many_frames(img: Image.Image, max_frames: int) -> bool:
    """Frame cap without walking a hostile file's every frame when the cap is 1 (the default)."""
    if img.format not in _MULTI_FRAME_FORMATS:
        return False
    if max_frames == 1:
        return bool(getattr(img, "is_animated", False))  # looks for a second frame only
    return getattr(img, "n_frames", 1) > max_frames


# Pages at least this large give the allocator's free memory back when their work is done (release_freed_memory)
RELEASE_AFTER_PIXELS = 4_000_000


def release_freed_memory() -> None:
    """Hand the C allocator's free pages back to the system (glibc `malloc_trim`; elsewhere nothing). A large page
    decoded on a thread leaves its pixels' memory free but resident in that thread's arena (measured: 174-185 MiB after
    a 6300² page, until the arena happens to be reused); trimming takes about 8 ms after such a page and
    microseconds otherwise."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 — glibc only
        return libc
    except (OSError, AttributeError):
        return None


def encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def resize_to(img: Image.Image, width: int, height: int) -> Image.Image:
    if (width, height) == img.size:
        return img
    return img.resize((width, height), Image.Resampling.LANCZOS if width < img.width else Image.Resampling.BICUBIC)
