"""Jobs end to end on the deployed Serve app with the embedded engine (real text recognition): a 5-page PDF streams
one event per page in page order over real HTTP, and `ocr-serve ocr doc.pdf` shows a progress bar fed by it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.fixtures.documents import normalise_text
from tests.fixtures.pdfs import page_texts, text_pdf

pytestmark = pytest.mark.ray


def test_five_page_pdf_streams_pages_in_order_with_the_right_text(embedded_url, five_page_pdf):
    expected = page_texts(5)
    with httpx.Client(base_url=embedded_url, timeout=300) as client:
        resp = client.post("/v1/jobs", files={"file": ("five.pdf", five_page_pdf, "application/pdf")},
                           data={"task": "spotting"})
        assert resp.status_code == 202, resp.text
        job = resp.json()
        assert job["pages"] == [1, 2, 3, 4, 5]
        events = []
        with client.stream("GET", job["links"]["events"]) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            event, event_id = None, None
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    events.append((event, event_id, json.loads(line[5:])))
                    event_id = None
        final = client.get(f"/v1/jobs/{job['id']}").json()

    assert [e[0] for e in events] == ["page"] * 5 + ["done"]
    assert [e[1] for e in events[:5]] == ["0", "1", "2", "3", "4"]
    for (_, _, page), lines, number in zip(events[:5], expected, range(1, 6)):
        assert page["page"] == number and page["status"] == "ok"
        text = normalise_text(page["result"]["text"])
        for line in lines:
            assert normalise_text(line) in text, (number, page["result"]["text"])
        assert len(page["result"]["lines"]) >= 2
    done = events[-1][2]
    assert done["status"] == "succeeded" and done["pages_done"] == 5 and done["pages_failed"] == 0
    assert final["status"] == "succeeded" and len(final["pages"]) == 5
    assert [p["result"]["text"] for p in final["pages"]] == [e[2]["result"]["text"] for e in events[:5]]


def test_cli_shows_a_progress_bar_fed_by_the_events(embedded_url, tmp_path):
    path = tmp_path / "three.pdf"
    path.write_bytes(text_pdf(3))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "service.cli", "ocr", str(path), "--task", "text",
                           "--url", embedded_url], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    progress = proc.stderr.strip().splitlines()
    assert progress[0].startswith("[" + "." * 30 + "] 0/3 pages")
    assert [line.split("] ")[1].split("  ")[0] for line in progress[1:4]] == ["1/3 pages", "2/3 pages", "3/3 pages"]
    assert "page 3 ok" in progress[3] and "succeeded" in progress[-1]
    result = json.loads(proc.stdout)
    assert result["status"] == "succeeded" and [p["page"] for p in result["pages"]] == [1, 2, 3]
    assert "Keyword" in result["pages"][2]["result"]["text"]
