"""Schemathesis hooks for the service's OpenAPI document (loaded by its runner through SCHEMATHESIS_HOOKS in
tests/integration/test_openapi_schemathesis.py, and imported by tests/unit/test_fuzz_openapi.py): real files for the
image formats and upload media types the document names, so that schema-valid requests can succeed."""

from __future__ import annotations

import base64
import io

import schemathesis
from schemathesis import GenerationMode
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from service.http.openapi import IMAGE_BASE64, IMAGE_DATA_URL


def _page(size: tuple[int, int], text: str) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((8, 8), text, fill="black")
    return image


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


PAGES = [_page((96, 48), "Total 42"), _page((160, 64), "Invoice 7"), _page((48, 200), "tall")]
FILES = {"image/png": [_encoded(p, "PNG") for p in PAGES], "image/jpeg": [_encoded(p, "JPEG") for p in PAGES],
         "image/webp": [_encoded(p, "WEBP") for p in PAGES], "image/bmp": [_encoded(p, "BMP") for p in PAGES],
         "image/tiff": [_encoded(p, "TIFF") for p in PAGES], "image/gif": [_encoded(p, "GIF") for p in PAGES],
         "application/pdf": [_encoded(PAGES[0], "PDF")]}
IMAGES = [(media_type, data) for media_type, files in FILES.items() if media_type != "application/pdf"
          for data in files]

for media_type, files in FILES.items():
    schemathesis.openapi.media_type(media_type, st.sampled_from(files))
schemathesis.openapi.format(IMAGE_DATA_URL, st.sampled_from(
    [f"data:{media_type};base64,{base64.b64encode(data).decode()}" for media_type, data in IMAGES]))
schemathesis.openapi.format(IMAGE_BASE64, st.sampled_from(
    [base64.b64encode(data).decode() for _, data in IMAGES]
    + [f"data:{media_type};base64,{base64.b64encode(data).decode()}" for media_type, data in IMAGES[:3]]))


@schemathesis.hook
def map_case(context, case):
    """A job's `file` is an array of files; schemathesis puts a media type's sample in place of the whole array,
    which it then sends without a filename (a form field, not a file): one sample is a list of one file."""
    if case.meta is not None and case.meta.generation.mode is not GenerationMode.POSITIVE:
        return case  # a negative case's file that is no array stays one
    if case.operation.path == "/v1/jobs" and isinstance(case.body, dict) and isinstance(case.body.get("file"), bytes):
        case.body = {**case.body, "file": [case.body["file"]]}
    return case
