"""What the ingress hands the engine. With the PNG transport: the upload itself when it already is a bare RGB PNG
(pixel chunks only) of exactly the pixels the model must see (no re-encode), a fresh PNG otherwise (resized,
oriented, converted, carrying metadata or a trailing payload), and in every case bytes that decode to the admitted
pixels. With the pixel transport (`engine_image_transport: pixels`, for engines that take it): the admitted pixels
themselves, and a PNG for engines that take only PNG. (The hostile-input suite checks the same for polyglots.)"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image, PngImagePlugin

from service.engine.mock import MockEngine
from tests.fixtures.api_inprocess import make_client


def png(image: Image.Image, **params) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **params)
    return buf.getvalue()


def page(mode: str = "RGB", size=(800, 600)) -> Image.Image:
    rng = np.random.default_rng(0)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], channels), dtype=np.uint8), mode)


async def engine_bytes(upload: bytes, **settings) -> tuple[bytes, dict]:
    engine = MockEngine()
    async with make_client(engine, **{"engine_image_transport": "png", **settings}) as client:
        resp = await client.post("/v1/ocr", json={"image": base64.b64encode(upload).decode(), "task": "text"})
    assert resp.status_code == 200, resp.text
    request = engine.requests[-1]
    return request.image_png, {"width": request.width, "height": request.height}


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


async def test_an_rgb_png_at_its_budget_size_goes_on_unchanged():
    image = page(size=(800, 608))  # multiples of 32 inside the pixel budget: no resize
    upload = png(image, compress_level=9)
    sent, size = await engine_bytes(upload)
    assert sent == upload  # the very bytes: no re-encode
    assert size == {"width": 800, "height": 608}
    assert np.array_equal(pixels(sent), np.asarray(image))


async def test_uploads_that_change_on_admission_are_re_encoded():
    rgba = page("RGBA", size=(800, 608))
    oriented = page(size=(800, 608))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° on display
    big = Image.new("RGB", (3000, 2000), "white")  # over a 2048-token context: downscaled by the budget
    big.paste((20, 30, 40), (100, 100, 2900, 300))
    padded_info = PngImagePlugin.PngInfo()
    padded_info.add_text("comment", "hello")  # any metadata chunk: the engine never gets the upload's extras
    small = page(size=(320, 320))
    cases = {
        "rgba": (png(rgba), (800, 608)),
        "exif orientation": (png(oriented, exif=exif), (608, 800)),
        "resized": (png(big), None),
        "padded": (png(small, pnginfo=padded_info), (320, 320)),
        "trailing payload": (png(small) + b"PK\x03\x04 a zip after IEND", (320, 320)),
    }
    for name, (upload, expected_size) in cases.items():
        sent, size = await engine_bytes(upload, **({"max_model_len": 2048} if name == "resized" else {}))
        if name == "resized":
            assert size["width"] < 3000 and size["height"] < 2000
        assert sent != upload, name
        decoded = Image.open(io.BytesIO(sent))
        assert decoded.format == "PNG" and decoded.mode == "RGB", name
        assert (decoded.width, decoded.height) == (size["width"], size["height"]), name
        if expected_size:
            assert decoded.size == expected_size, name
        assert "comment" not in decoded.info, name
    # RGBA is composited on white: the engine gets the admitted pixels, not the alpha channel
    sent, _ = await engine_bytes(cases["rgba"][0])
    alpha = np.asarray(rgba)[..., 3:].astype(np.float64) / 255
    expected = np.asarray(rgba)[..., :3] * alpha + 255 * (1 - alpha)
    assert np.abs(pixels(sent).astype(np.float64) - expected).max() <= 1


async def test_a_jpeg_is_re_encoded_as_png():
    buf = io.BytesIO()
    page(size=(800, 608)).save(buf, format="JPEG", quality=90)
    sent, _ = await engine_bytes(buf.getvalue())
    assert Image.open(io.BytesIO(sent)).format == "PNG"


def test_base64_may_be_wrapped_in_any_whitespace_but_nothing_else():
    import pytest

    from service.imaging import decode_base64_image
    from service.errors import OCRError

    upload = png(page(size=(64, 32)))
    text = base64.b64encode(upload).decode()
    # MIME line breaks (76 columns, CRLF), tabs, and Unicode spaces a copy-paste brings in
    wrapped = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    wrapped = " \t" + wrapped[:50] + "\u2003\u00a0" + wrapped[50:] + "\n"
    assert decode_base64_image(wrapped, 1 << 20) == upload
    assert decode_base64_image("data:image/png;base64," + wrapped, 1 << 20) == upload
    for bad in (text[:40] + "é" + text[40:], text[:40] + "*" + text[40:]):
        with pytest.raises(OCRError) as caught:
            decode_base64_image(bad, 1 << 20)
        assert caught.value.code == "invalid_base64"


async def sent_request(upload: bytes, engine: MockEngine | None = None, **settings):
    engine = engine or MockEngine()
    async with make_client(engine, **settings) as client:
        resp = await client.post("/v1/ocr", json={"image": base64.b64encode(upload).decode(), "task": "text"})
    assert resp.status_code == 200, resp.text
    return engine.requests[-1]


async def test_pixels_are_the_admitted_pixels_whatever_came_in():
    """The pixel transport: oriented, composited, resized pixels, exactly the PNG transport's pixels."""
    rgba = page("RGBA", size=(800, 608))
    oriented = page(size=(800, 608))
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = io.BytesIO()
    page(size=(800, 608)).save(jpeg, format="JPEG", quality=90)
    big = Image.new("RGB", (3000, 2000), "white")
    big.paste((20, 30, 40), (100, 100, 2900, 300))
    for name, upload in {"bare png": png(page(size=(800, 608))), "rgba": png(rgba),
                         "exif orientation": png(oriented, exif=exif), "jpeg": jpeg.getvalue(),
                         "resized": png(big)}.items():
        settings = {"max_model_len": 2048} if name == "resized" else {}
        request = await sent_request(upload, engine_image_transport="pixels", **settings)
        assert request.image_png is None and request.image_rgb is not None, name
        assert len(request.image_rgb) == request.width * request.height * 3, name
        as_png, size = await engine_bytes(upload, **settings)
        assert size == {"width": request.width, "height": request.height}, name
        assert np.array_equal(request.rgb_array(), pixels(as_png)), name


async def test_an_engine_that_takes_only_png_gets_png():
    class PngOnlyEngine(MockEngine):
        async def info(self):
            return (await super().info()).model_copy(update={"image_transports": ["png"]})

    upload = png(page(size=(800, 608)))
    request = await sent_request(upload, PngOnlyEngine(), engine_image_transport="pixels")
    assert request.image_rgb is None and request.image_png == upload


def test_an_engine_request_holds_exactly_one_whole_image():
    import pytest
    from pydantic import ValidationError

    from service.engine.protocol import EngineRequest

    base = {"request_id": "r", "task": "text", "width": 4, "height": 2}
    for bad in ({}, {"image_png": b"x", "image_rgb": b"\0" * 24}, {"image_rgb": b"\0" * 23}):
        with pytest.raises(ValidationError):
            EngineRequest(**base, **bad)
    request = EngineRequest(**base, image_rgb=bytes(range(24)))
    assert request.rgb_array().shape == (2, 4, 3) and request.rgb_array().flags.writeable
    assert np.array_equal(np.asarray(request.pil_image()), request.rgb_array())


# --- who decodes a bare PNG's pixels (settings.engine.png_pixel_check) ---------------------------------------------------

def test_only_a_bare_rgb8_png_with_right_crcs_may_skip_the_ingress_decode():
    import zlib

    from service.imaging import bare_rgb_png_size
    from tests.fixtures.hostile import bare_png, png_chunk

    rows = [zlib.compress(b"".join(b"\x00" + bytes(30) for _ in range(5)))]
    good = bare_png(10, 5, rows)
    assert bare_rgb_png_size(good) == (10, 5)
    assert bare_rgb_png_size(png(page(size=(64, 32)))) == (64, 32)  # what Pillow writes by default
    flipped_crc = bytearray(good)
    flipped_crc[33 + 8 + len(rows[0])] ^= 1  # the IDAT chunk's CRC (after signature 8 + IHDR 25 + length/type 8)
    refused = {
        "RGBA": bare_png(10, 5, rows, colour=6), "grey": bare_png(10, 5, rows, colour=0),
        "palette": bare_png(10, 5, rows, colour=3), "16-bit": bare_png(10, 5, rows, bit_depth=16),
        "interlaced": bare_png(10, 5, rows, interlace=1),
        "text chunk": bare_png(10, 5, rows, extra=png_chunk(b"tEXt", b"Comment\x00hi")),
        "animation": bare_png(10, 5, rows, extra=png_chunk(b"acTL", bytes(8))),
        "bad CRC": bytes(flipped_crc), "trailing bytes": good + b"PK", "no IEND": good[:-12],
        "no IDAT": good[:33] + good[-12:], "truncated": good[:-20], "not a PNG": b"GIF89a" + good[6:],
    }
    for name, data in refused.items():
        assert bare_rgb_png_size(data) is None, name


class CountingEngine(MockEngine):
    """The mock engine, counting the pages that reached it (whether its decode accepted them or not)."""

    def __init__(self):
        super().__init__()
        self.pages = 0

    async def stream(self, request):
        self.pages += 1
        async for delta in super().stream(request):
            yield delta


async def test_the_ingress_leaves_a_passed_on_png_undecoded_and_the_engine_refuses_corrupt_pixels():
    """png_pixel_check: engine (the default) — a bare PNG going on unchanged is not decoded in the ingress; a
    resized one is. Corrupt pixels behind right CRCs reach the engine, whose decode answers `invalid_image`; with
    `ingress` the ingress refuses them and the engine never sees them. Damage that breaks a CRC is refused by the
    ingress either way."""
    from service.imaging import decode_image
    from service.pipeline import page as ocr
    from tests.fixtures.hostile import bare_png
    from service.pipeline.context import AppContext
    from service.schema import OCRRequest
    from service.engine.protocol import EngineInfo
    from service.config import Settings

    s = Settings()
    assert s.engine.png_pixel_check == "engine"
    vllm = EngineInfo(name="vllm", model="m", supported_tasks=["text"], image_transports=["pixels", "png"])
    ctx = AppContext(settings=s, engine=MockEngine())
    upload = png(page(size=(800, 608)))
    limits = dict(allowed_formats=s.limits.allowed_formats, max_pixels=s.limits.max_image_pixels, max_side=s.limits.max_image_side,
                  max_frames=s.limits.max_frames)
    decoded = decode_image(upload, **limits, defer_pixels=True)
    assert decoded.image is None and (decoded.width, decoded.height) == (800, 608)
    prepared = ocr.prepare_decoded_page(ctx, OCRRequest(task="text"), decoded, vllm, "r")
    assert prepared.engine_request.image_png is upload and decoded.image is None  # still not decoded
    big = decode_image(png(page(size=(3000, 2000))), **limits, defer_pixels=True)
    small_ctx = AppContext(settings=Settings(max_model_len=2048), engine=MockEngine())
    prepared = ocr.prepare_decoded_page(small_ctx, OCRRequest(task="text"), big, vllm, "r")
    assert big.image is not None and prepared.engine_request.width < 3000  # resized: decoded on the way
    assert decode_image(upload, **limits).image is not None  # jobs and the rest decode up front, as always

    width, height = 160, 60
    corrupt = bare_png(width, height, [bytes(range(7, 256)) * 4])  # right CRCs around no zlib stream at all
    damaged = bytearray(png(page(size=(width, height))))
    damaged[60] ^= 0xFF  # inside the first IDAT: its CRC no longer matches
    for check, upload, engine_sees_it in (("engine", corrupt, True), ("ingress", corrupt, False),
                                          ("engine", bytes(damaged), False), ("ingress", bytes(damaged), False)):
        engine = CountingEngine()
        async with make_client(engine, png_pixel_check=check) as client:
            resp = await client.post("/v1/ocr", json={"image": base64.b64encode(upload).decode(), "task": "text"})
            ok = await client.post("/v1/ocr", json={"image": base64.b64encode(png(page(size=(64, 32)))).decode(),
                                                    "task": "text"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_image", (check, resp.text)
        assert engine.pages == (2 if engine_sees_it else 1), check  # and the engine still answers after it
        assert ok.status_code == 200
    # streamed: the 200 waits for the engine's first output, so the engine's refusal is the answer's status
    engine = CountingEngine()
    async with make_client(engine) as client:
        resp = await client.post("/v1/ocr", json={"image": base64.b64encode(corrupt).decode(), "task": "text",
                                                  "stream": True})
        chat = await client.post("/v1/chat/completions", json={"stream": True, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(corrupt).decode()}},
            {"type": "text", "text": "Read it."}]}]})
    for answer in (resp, chat):
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_image", answer.text
    assert engine.pages == 2
