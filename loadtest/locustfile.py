"""Locust users posting generated documents to `POST /v1/ocr` (interactive UI or headless).

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000                     # web UI on :8089
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 2m --csv results/locust

Environment (all optional):
    OCR_LOADTEST_API_KEY   API key sent as `Authorization: Bearer ...` (default: none, open mode)
    OCR_LOADTEST_WORKLOAD  mixed | id_card | a4 | a4_document (default mixed: ID cards and A4 pages, 1:1)
    OCR_LOADTEST_TASK      task for every request; default `auto`: extract for ID cards, text/document for pages,
                           and `text` on the embedded engine (it does spotting/text only; read from /readyz)
    OCR_LOADTEST_CHARS     characters of text per A4 page (default 500, a "medium" document)
    OCR_LOADTEST_DOCS      different documents per kind (default 4)
    OCR_LOADTEST_WAIT_S    think time between a user's requests, seconds (default 0: closed loop)

Requests are named `/v1/ocr [kind task]`; 429 answers are failures named `rate_limited` (Retry-After not honoured).
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from pathlib import Path

import gevent
from locust import HttpUser, constant, events, stats, task

# `locust -f loadtest/locustfile.py` puts loadtest/ on sys.path, not the repository root that holds the package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.run import WORKLOADS, Job, OCRTarget, resolve_task
from loadtest.documents import make_documents


def _env(name: str, default: str) -> str:
    return os.environ.get(f"OCR_LOADTEST_{name}", default)


@lru_cache(maxsize=4)
def _bodies(host: str) -> dict[Job, list[tuple[str, bytes]]]:
    """Request bodies per job, built once per process (the same bytes for every user)."""
    target = OCRTarget(task_override=resolve_task(host, _env("TASK", "auto")))
    docs = int(_env("DOCS", "4"))
    chars = int(_env("CHARS", "500"))
    out = {}
    for job in WORKLOADS[_env("WORKLOAD", "mixed")]:
        name = f"/v1/ocr [{job.kind} {target.task_override or job.task}]"
        out[job] = [(name, target.body(job, doc)) for doc in make_documents(job.kind, docs, chars=chars)]
    return out


@events.test_stop.add_listener
def _let_the_csv_writer_see_the_last_answers(environment, **_kwargs) -> None:
    """Locust rewrites its `--csv` files once a second, not on the way out: answers arriving during `--stop-timeout`
    would miss the CSV. test_stop fires once every user has stopped; one more writer tick puts them in."""
    if getattr(environment.parsed_options, "csv_prefix", None):
        gevent.sleep(stats.CSV_STATS_INTERVAL_SEC + 0.25)


class OCRUser(HttpUser):
    wait_time = constant(float(_env("WAIT_S", "0")))

    def on_start(self) -> None:
        self.bodies = _bodies(self.host)
        self.schedule = [job for job in self.bodies for _ in range(job.weight)]
        self.turn = 0
        self.headers = OCRTarget(api_key=_env("API_KEY", "") or None).headers()

    @task
    def post_document(self) -> None:
        job = self.schedule[self.turn % len(self.schedule)]
        name, body = self.bodies[job][(self.turn // len(self.schedule)) % len(self.bodies[job])]
        self.turn += 1
        with self.client.post("/v1/ocr", data=body, headers=self.headers, name=name, catch_response=True,
                              timeout=300) as resp:
            if resp.status_code == 200:
                resp.success()
            else:
                try:
                    code = resp.json()["error"]["code"]
                except Exception:  # not our error body (proxy, connection): report the status
                    code = f"http_{resp.status_code}"
                resp.failure(code)
