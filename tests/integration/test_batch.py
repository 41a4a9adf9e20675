"""`ocr-serve batch` end to end with the embedded engine: inputs of every form, records and Markdown, the summary,
re-runs that skip what is written, a driver killed with SIGKILL and resumed (every page exactly once), hostile files
(error records, exit status 1), Parquet, and an S3-compatible server (moto) on loopback for inputs and output.

The runs in this process use the session's Ray cluster (tests/fixtures/serve_app.py) with one engine actor each; the
killed driver joins that cluster with `--address`. The S3 run is a subprocess with a Ray of its own, because the
cluster's workers read store credentials from their own environment, which the session's cluster does not have.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from loadtest.common import free_port
from tests.fixtures.documents import render_document
from tests.fixtures.hostile import png_header_bomb
from tests.fixtures.pdfs import encrypted_pdf, huge_box_pdf, pdf_from_images

pytestmark = pytest.mark.usefixtures("ray_cluster")

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa"]


def page_image(word: str, number: int):
    # small pages: the embedded engine reads one in a fraction of a second
    return render_document([f"Batch {word} {number}"], size=(480, 140), font_size=36, top=40, left=30).image


def write_image(path: Path, word: str, number: int, fmt: str = "PNG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    page_image(word, number).save(path, format=fmt)


def write_pdf(path: Path, words: list[str], first: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pdf_from_images([page_image(w, first + i) for i, w in enumerate(words)], resolution=72))


def run(inputs: list[str], out: Path | str, **options) -> tuple[int, str]:
    """run_batch in this process, on the session's cluster: (exit status, what it printed)."""
    from service.batch.inputs import StoreOptions
    from service.batch.run import BatchOptions, run_batch
    from service.config import Settings

    stream = io.StringIO()
    settings = Settings(engine="embedded", engine_image_transport="pixels")
    options = {"request": {"task": "text"}, "engine_actors": 1, "progress": False, "store": StoreOptions(),
               **options}
    code = run_batch(BatchOptions(inputs=inputs, out=str(out), **options), settings, stream=stream)
    return code, stream.getvalue()


def records(out: Path, fmt: str = "jsonl") -> list[dict]:
    from service.batch.output import decode_records

    return [r for part in sorted((out / "parts").iterdir()) for r in decode_records(part.read_bytes(), fmt)]


def pages_of(recs: list[dict]) -> Counter:
    return Counter((Path(r["source"]).name, r["page"]) for r in recs)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Images (PNG, JPEG, in sub-folders) and a 3-page PDF; each page says `Batch WORD N`."""
    root = tmp_path_factory.mktemp("corpus")
    write_image(root / "scans" / "a.png", "alpha", 1)
    write_image(root / "scans" / "deep" / "b.jpg", "bravo", 2, fmt="JPEG")
    write_pdf(root / "pdfs" / "c.pdf", ["charlie", "delta", "echo"], 3)
    write_image(root / "loose" / "f.png", "foxtrot", 6)
    (root / "scans" / "notes.txt").write_text("not a document")
    (root / "scans" / ".hidden.png").write_bytes(b"skipped: hidden")
    (root / "list.txt").write_text(f"# one per line\n{root / 'loose' / 'f.png'}\n\n")
    return root


def test_folder_glob_and_list_file_then_rerun_skips(corpus, tmp_path):
    out = tmp_path / "out"
    inputs = [str(corpus / "scans"), str(corpus / "pdfs" / "*.pdf"), f"@{corpus / 'list.txt'}"]
    code, printed = run(inputs, out, markdown=True)
    assert code == 0, printed
    recs = records(out)
    assert pages_of(recs) == Counter({("a.png", 1): 1, ("b.jpg", 1): 1, ("c.pdf", 1): 1, ("c.pdf", 2): 1,
                                      ("c.pdf", 3): 1, ("f.png", 1): 1})
    by_page = {(Path(r["source"]).name, r["page"]): r for r in recs}
    for (name, page), word in {("a.png", 1): "alpha", ("b.jpg", 1): "bravo", ("c.pdf", 1): "charlie",
                               ("c.pdf", 2): "delta", ("c.pdf", 3): "echo", ("f.png", 1): "foxtrot"}.items():
        record = by_page[(name, page)]
        assert word in record["text"].lower(), record
        assert record["error"] is None and record["task"] == "text" and len(record["sha256"]) == 64
        assert record["lines"] and all(len(line["box"]) == 4 and 0 <= line["confidence"] <= 1
                                       for line in record["lines"])
        assert record["usage"]["pages"] == 1 and record["timings_ms"]["total"] > 0
    assert by_page[("c.pdf", 2)]["pages"] == 3 and "render" in by_page[("c.pdf", 2)]["timings_ms"]
    # --markdown: one file per document, folders kept, pages in order
    markdown = (out / "markdown" / "c.pdf.md").read_text()
    assert markdown.index("<!-- page 1 -->") < markdown.index("<!-- page 2 -->") < markdown.index("<!-- page 3 -->")
    assert "delta" in markdown.lower()
    assert (out / "markdown" / "deep" / "b.jpg.md").exists() and (out / "markdown" / "f.png.md").exists()
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["pages"] == {"written_this_run": 6, "skipped": 0, "in_output": 6, "failed_this_run": 0,
                                "failed_in_output": 0, "missing": 0}
    assert summary["documents"] == {"listed": 4, "this_run": 4}
    assert summary["latency_ms_p50"] > 0 and summary["pages_per_s"] > 0 and summary["errors_by_code"] == {}
    assert "6 pages of 4 documents" in printed

    # the same command again: nothing is read or run, nothing is written twice
    parts = sorted(p.name for p in (out / "parts").iterdir())
    code, printed = run(inputs, out, markdown=True)
    assert code == 0, printed
    assert sorted(p.name for p in (out / "parts").iterdir()) == parts
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["pages"]["written_this_run"] == 0 and summary["pages"]["skipped"] == 6

    # a document that changed is done again; its earlier record stays as the record of its earlier content
    write_image(corpus / "loose" / "f.png", "golf", 7)
    code, printed = run(inputs, out)
    assert code == 0, printed
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["pages"]["written_this_run"] == 1 and summary["pages"]["skipped"] == 5
    assert "golf" in [r for r in records(out) if r["source"].endswith("f.png")][-1]["text"].lower()

    # other settings refuse the folder instead of mixing records
    code, printed = run(inputs, out, request={"task": "spotting"})
    assert code == 2 and "other settings" in printed


def test_hostile_files_give_error_records_in_parquet(tmp_path):
    from service.batch.output import parquet_schema

    src = tmp_path / "in"
    write_image(src / "good.png", "hotel", 8)
    hostile = {
        "truncated.png": (src / "good.png").read_bytes()[:200],
        "bomb.png": png_header_bomb(60_000, 60_000),
        "text.jpg": b"plain text pretending to be a JPEG",
        "empty.pdf": b"",
        "encrypted.pdf": encrypted_pdf(),
        "huge-box.pdf": huge_box_pdf(),
    }
    for name, data in hostile.items():
        (src / name).write_bytes(data)
    out = tmp_path / "out"
    code, printed = run([str(src)], out, format="parquet")
    assert code == 1, printed  # some page failed
    import pyarrow.parquet as pq

    part = next((out / "parts").iterdir())
    assert part.suffix == ".parquet" and pq.read_schema(part).equals(parquet_schema())
    recs = records(out, "parquet")
    by_name = {Path(r["source"]).name: r for r in recs}
    assert sorted(by_name) == sorted([*hostile, "good.png"]) and len(recs) == len(by_name)
    assert by_name["good.png"]["error"] is None and "hotel" in by_name["good.png"]["text"].lower()
    codes = {name: (by_name[name]["error"] or {}).get("code") for name in hostile}
    assert codes == {"truncated.png": "invalid_image", "bomb.png": "image_too_large",
                     "text.jpg": "unsupported_media_type", "empty.pdf": "empty_image",
                     "encrypted.pdf": "invalid_pdf", "huge-box.pdf": "invalid_pdf"}, codes  # the API's codes
    for name in hostile:
        assert by_name[name]["text"] is None and by_name[name]["error"]["message"]
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["pages"]["failed_in_output"] == len(hostile)
    assert sum(summary["errors_by_code"].values()) == len(hostile)


def test_sigkill_mid_run_then_resume_writes_every_page_once(tmp_path):
    import ray

    src = tmp_path / "in"
    expected = Counter()
    for i, word in enumerate(WORDS[:10]):
        write_image(src / f"p{i:02d}.png", word, i)
        expected[(f"p{i:02d}.png", 1)] = 1
    write_pdf(src / "q.pdf", WORDS[10:14], 10)
    expected.update({("q.pdf", n): 1 for n in range(1, 5)})
    out = tmp_path / "out"
    command = [sys.executable, "-m", "service.cli", "batch", str(src), "--out", str(out), "--engine", "embedded",
               "--address", ray.get_runtime_context().gcs_address, "--engine-actors", "1", "--commit-every", "1",
               "--no-progress"]
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 120
        # killed once two parts are committed: the run is mid-way, a part may be half written
        while time.monotonic() < deadline and driver.poll() is None:
            if (out / "parts").is_dir() and len(list((out / "parts").iterdir())) >= 2:
                break
            time.sleep(0.05)
        assert driver.poll() is None, driver.stderr.read().decode()[-2000:]
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stderr.close()
    before = records(out)
    assert 2 <= len(before) < sum(expected.values())
    assert max(pages_of(before).values()) == 1

    code, printed = run([str(src)], out)
    assert code == 0, printed
    final = records(out)
    assert pages_of(final) == expected  # every page, each exactly once
    assert len({r["key"] for r in final}) == len(final)
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["pages"]["skipped"] >= len(before) and summary["pages"]["missing"] == 0


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3-compatible server on loopback, in its own process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)


def test_s3_inputs_and_output(s3_server, corpus, tmp_path):
    import boto3

    env = {"AWS_ACCESS_KEY_ID": "batch-test", "AWS_SECRET_ACCESS_KEY": "batch-test-secret",
           "AWS_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])
    s3.create_bucket(Bucket="scans")
    s3.create_bucket(Bucket="results")
    s3.put_object(Bucket="scans", Key="in/a.png", Body=(corpus / "scans" / "a.png").read_bytes())
    s3.put_object(Bucket="scans", Key="in/sub/c.pdf", Body=(corpus / "pdfs" / "c.pdf").read_bytes())
    s3.put_object(Bucket="scans", Key="in/readme.txt", Body=b"not a document")
    s3.put_object(Bucket="scans", Key="lists/more.txt", Body=b"s3://scans/in/a.png\n")
    command = [sys.executable, "-m", "service.cli", "batch", "s3://scans/in", "@s3://scans/lists/more.txt",
               "--out", "s3://results/run1", "--s3-endpoint", s3_server, "--engine", "embedded",
               "--engine-actors", "1", "--markdown", "--no-progress"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                          env={**environment, **env, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-3000:]
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="results", Prefix="run1/")["Contents"])
    assert "run1/_summary.json" in keys and "run1/markdown/sub/c.pdf.md" in keys
    from service.batch.output import decode_records

    recs = [r for k in keys if k.startswith("run1/parts/")
            for r in decode_records(s3.get_object(Bucket="results", Key=k)["Body"].read(), "jsonl")]
    assert Counter((r["source"], r["page"]) for r in recs) == Counter(
        {("s3://scans/in/a.png", 1): 1, ("s3://scans/in/sub/c.pdf", 1): 1, ("s3://scans/in/sub/c.pdf", 2): 1,
         ("s3://scans/in/sub/c.pdf", 3): 1})
    assert all(r["error"] is None for r in recs)
    assert "alpha" in next(r for r in recs if r["source"].endswith("a.png"))["text"].lower()
