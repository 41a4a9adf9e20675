"""The load tools' parts that need no service: the document generator (sizes, fields, deterministic per seed), and the
Locust file's CSV counting the answers that arrive during `--stop-timeout` (a stand-in server that answers late).
Each tool run for real against the service: tests/integration/test_loadtest_smoke.py."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path


from loadtest.documents import A4_SIZE, ID_CARD_FIELDS, ID_CARD_SIZE, make_documents, render_a4


REPO = Path(__file__).resolve().parents[2]


def test_documents_have_requested_size_and_text():
    card = make_documents("id_card", 2)
    assert [(d.width, d.height) for d in card] == [ID_CARD_SIZE] * 2
    assert set(card[0].fields) == set(ID_CARD_FIELDS)
    assert card[0].fields != card[1].fields  # different seeds, different cards
    for value in card[0].fields.values():
        assert value in card[0].text  # every field value is rendered
    medium, dense = render_a4(500, seed=1), render_a4(2000, seed=1)
    assert (medium.width, medium.height) == A4_SIZE
    assert 500 <= medium.chars <= 600  # ~500 characters: the "medium" document
    assert 2000 <= dense.chars <= 2200
    assert render_a4(500, seed=1).png == medium.png  # deterministic for a seed


def test_locust_csv_counts_answers_that_arrive_during_the_stop_timeout(tmp_path):
    """Every request in flight at `--run-time` ends during `--stop-timeout`; Locust printed those answers but left
    them out of its CSV (an empty CSV after a 20 s run whose single request took longer). A stand-in
    server answers each OCR request after 4 s; a 2 s run must still count its answer in the CSV."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class SlowOCR(BaseHTTPRequestHandler):
        def _answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # /readyz: the embedded engine, so the locustfile asks for `text`
            self._answer(b'{"status": "ready", "engine": "embedded"}')

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(4.0)
            self._answer(b'{"lines": []}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowOCR)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        env = {**os.environ, "OCR_LOADTEST_WORKLOAD": "id_card", "OCR_LOADTEST_DOCS": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
             "--host", f"http://127.0.0.1:{server.server_port}", "--headless", "-u", "1", "-r", "1", "-t", "2s",
             "--stop-timeout", "30", "--csv", str(tmp_path / "locust"), "--only-summary"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (tmp_path / "locust_stats.csv").open() as fh:
        rows = {row["Name"]: row for row in csv.DictReader(fh)}
    assert int(rows["Aggregated"]["Request Count"]) == 1, rows
    assert int(rows["/v1/ocr [id_card text]"]["Failure Count"]) == 0
