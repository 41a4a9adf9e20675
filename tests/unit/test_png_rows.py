"""A PNG whose image data ends before its last row is refused (`invalid_image`), on both sides that decode PNG
pixels: the ingress (`decode_image`) and the engine replica (`decode_png_pixels`, for a passed-on bare PNG).

Pillow decodes such a file without an error when its zlib stream ends cleanly after a whole row: the rows it never
wrote stay black. The service fills the image memory with an unlikely colour first and counts the PNG's rows only
when that colour is left in the last two rows (service.imaging.load_png_whole). The hostile-input suite
runs the same files through the API, the embedded engine and Serve (`corrupt_pixels`)."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from service import imaging as images
from service.imaging import decode_image, decode_png_pixels, png_rows_complete
from service.errors import OCRError
from tests.fixtures.hostile import ADAM7, bare_png


def png_of_rows(width: int, height: int, rows: list[bytes], *, colour: int = 2, interlace: int = 0) -> bytes:
    """A PNG around the given filtered rows (one zlib stream that ends cleanly after the last given row)."""
    return bare_png(width, height, [zlib.compress(b"".join(rows))], colour=colour, interlace=interlace)


def rgb_rows(pixels: np.ndarray, interlace: bool = False) -> list[bytes]:
    """Filter-0 rows of an (h, w, 3) array, in the order a PNG stores them (Adam7's seven passes if interlaced)."""
    grids = ADAM7 if interlace else ((0, 0, 1, 1),)
    rows = []
    for x0, y0, dx, dy in grids:
        sub = pixels[y0::dy, x0::dx]
        if sub.shape[0] and sub.shape[1]:
            rows += [b"\x00" + row.tobytes() for row in sub]
    return rows


def ingress(data: bytes) -> Image.Image:
    return decode_image(data, allowed_formats=["PNG"], max_pixels=10**8, max_side=10**5, max_frames=1).image


def both_sides_refuse(data: bytes, width: int, height: int, *, says_cut: bool = True) -> None:
    with pytest.raises(OCRError) as refused:
        ingress(data)
    assert refused.value.code == "invalid_image"
    if says_cut:  # says what is wrong with the file
        assert "ends before its last row" in refused.value.message
    if images.bare_rgb_png_size(data):
        with pytest.raises(OCRError) as refused:
            decode_png_pixels(data, width, height)
        assert refused.value.code == "invalid_image"
        if says_cut:  # says what is wrong with the file
            assert "ends before its last row" in refused.value.message


@pytest.mark.parametrize("size", [(64, 32), (37, 23), (1, 5), (5, 1), (9, 2)])
@pytest.mark.parametrize("interlace", [False, True])
def test_every_clean_cut_before_the_last_row_is_refused_and_the_whole_file_is_not(size, interlace):
    width, height = size
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    rows = rgb_rows(pixels, interlace)
    whole = png_of_rows(width, height, rows, interlace=int(interlace))
    assert np.array_equal(np.asarray(ingress(whole)), pixels)
    if not interlace:
        assert np.array_equal(np.asarray(decode_png_pixels(whole, width, height)), pixels)
    for kept in range(len(rows)):  # with no row at all, Pillow's own error comes first
        both_sides_refuse(png_of_rows(width, height, rows[:kept], interlace=int(interlace)), width, height,
                          says_cut=kept > 0)


def test_pillow_alone_takes_a_clean_cut_as_a_whole_image():
    """Why the check exists: without it, the cut page decodes and its missing rows are black."""
    pixels = np.full((32, 64, 3), 200, dtype=np.uint8)
    cut = png_of_rows(64, 32, rgb_rows(pixels)[:27])
    image = Image.open(io.BytesIO(cut))
    image.load()
    assert (np.asarray(image)[27:] == 0).all() and (np.asarray(image)[:27] == 200).all()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1", "I;16"])
def test_every_colour_mode_pillow_writes_decodes_whole(mode):
    rng = np.random.default_rng(1)
    base = Image.fromarray(rng.integers(0, 256, (45, 70, 3), dtype=np.uint8))
    image = Image.fromarray(rng.integers(0, 65535, (45, 70), dtype=np.uint16)) if mode == "I;16" else base.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    assert png_rows_complete(buf.getvalue())
    decoded = ingress(buf.getvalue())
    assert decoded.size == (70, 45) and decoded.mode == "RGB"


@pytest.mark.parametrize("colour, channels", [(0, 1), (3, 1), (4, 2), (6, 4)])
def test_cut_grey_palette_and_alpha_pngs_are_refused_by_the_ingress(colour, channels):
    """Not bare RGB, so the ingress decodes them itself (a palette PNG without a PLTE is refused anyway)."""
    width, height = 40, 12
    pixels = np.full((height, width, channels), 90, dtype=np.uint8)
    rows = [b"\x00" + row.tobytes() for row in pixels]
    whole = png_of_rows(width, height, rows, colour=colour)
    if colour != 3:
        assert ingress(whole).size == (width, height)
    with pytest.raises(OCRError) as refused:
        ingress(png_of_rows(width, height, rows[:height - 1], colour=colour))
    assert refused.value.code == "invalid_image"


def test_a_page_whose_last_rows_hold_the_marker_colour_is_counted_and_kept(monkeypatch):
    marker = images._UNWRITTEN_8BIT[:3]
    pixels = np.zeros((20, 30, 3), dtype=np.uint8)
    pixels[-2:] = marker
    whole = png_of_rows(30, 20, rgb_rows(pixels))
    counted = []
    monkeypatch.setattr(images, "png_rows_complete", lambda data: counted.append(1) or png_rows_complete(data))
    assert np.array_equal(np.asarray(decode_png_pixels(whole, 30, 20)), pixels)
    assert counted == [1]  # the colour made it count the rows, and they were all there


def test_the_count_does_not_read_the_checksum_after_the_rows():
    """The count runs after Pillow decoded the rows; a damaged adler32 behind them is not the count's business."""
    rows = rgb_rows(np.random.default_rng(3).integers(0, 256, (20, 30, 3), dtype=np.uint8))
    stream = bytearray(zlib.compress(b"".join(rows)))
    stream[-1] ^= 0xFF  # adler32
    data = bare_png(30, 20, [bytes(stream)])
    with pytest.raises(zlib.error):
        zlib.decompress(bytes(stream))
    assert png_rows_complete(data)


def test_an_ordinary_page_is_not_inflated_twice(monkeypatch):
    pixels = np.random.default_rng(2).integers(0, 17, (40, 50, 3), dtype=np.uint8)  # never the marker's 201
    whole = png_of_rows(50, 40, rgb_rows(pixels))
    monkeypatch.setattr(images, "png_rows_complete", lambda data: pytest.fail("counted the rows of a whole page"))
    assert np.array_equal(np.asarray(decode_png_pixels(whole, 50, 40)), pixels)
    assert np.array_equal(np.asarray(ingress(whole)), pixels)


def test_counting_rows_takes_no_memory_for_a_zlib_bomb():
    """A stream far longer than the header's rows: the count stops at the rows it needs."""
    import tracemalloc

    bomb = png_of_rows(16, 16, [bytes(64 * 2**20)])
    tracemalloc.start()
    try:
        assert png_rows_complete(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20


def test_headers_and_streams_that_do_not_add_up_are_incomplete():
    rows = rgb_rows(np.zeros((8, 8, 3), dtype=np.uint8))
    assert png_rows_complete(png_of_rows(8, 8, rows))
    assert not png_rows_complete(png_of_rows(8, 9, rows))  # the header claims one row more
    assert not png_rows_complete(png_of_rows(9, 8, rows))  # longer rows than the data has
    assert not png_rows_complete(b"\x89PNG\r\n\x1a\n")  # no header at all
    stream = zlib.compress(b"".join(rows))
    broken = stream[:2] + b"\xff" * 20  # after the zlib header, a deflate block of the reserved type 3
    assert not png_rows_complete(bare_png(8, 8, [broken]))
