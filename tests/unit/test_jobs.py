"""Jobs through the real API in-process (no Ray): page order, retries, cancellation, rate limiting by pages, tenants,
and resuming the events stream. The engine is the mock (these test the layers above the engine seam); the PDF sandbox
is real. The Redis job store: tests/integration/test_jobs.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.engine.protocol import EngineRequest, EngineResult
from service.config import Settings
from tests.fixtures.api_inprocess import BearerTenants, make_client
from tests.fixtures.jobs import WAIT_S, image_parts, parse_sse, png, runner_of, wait_for_job
from tests.fixtures.pdfs import text_pdf


class OutOfOrderEngine(MockEngine):
    """Page 1 is held until every other page has finished, so it completes last; every answer names its page."""

    def __init__(self, pages: int):
        super().__init__(responder=lambda r: f"text of page {r.request_id.split('-p')[-1]}")
        self.finished: list[int] = []
        self.others_left = pages - 1
        self.others_done = asyncio.Event()

    async def generate(self, request: EngineRequest) -> EngineResult:
        page = int(request.request_id.split("-p")[-1])
        if page == 1:
            await asyncio.wait_for(self.others_done.wait(), WAIT_S)
        result = await super().generate(request)
        self.finished.append(page)
        if page != 1:
            self.others_left -= 1
            if self.others_left == 0:
                self.others_done.set()
        return result


async def test_events_arrive_in_page_order_although_pages_finish_out_of_order():
    engine = OutOfOrderEngine(5)
    async with make_client(engine, job_page_concurrency=5) as client:
        resp = await client.post("/v1/jobs", files={"file": ("doc.pdf", text_pdf(5), "application/pdf")},
                                 data={"task": "text"})
        assert resp.status_code == 202, resp.text
        job = resp.json()
        assert job["pages_total"] == 5 and resp.headers["location"] == f"/v1/jobs/{job['id']}"
        events = parse_sse((await client.get(job["links"]["events"])).text)
    # the engine really finished them out of order: page 1 last (pages 2-5 run at once, in any order among them)
    assert engine.finished[-1] == 1 and sorted(engine.finished[:-1]) == [2, 3, 4, 5]
    assert [e[0] for e in events] == ["page"] * 5 + ["done"]
    assert [e[2]["page"] for e in events[:5]] == [1, 2, 3, 4, 5]
    assert [e[1] for e in events[:5]] == ["0", "1", "2", "3", "4"]
    assert [e[2]["result"]["text"] for e in events[:5]] == [f"text of page {n}" for n in range(1, 6)]
    assert all(e[2]["dpi"] == 200 for e in events[:5])
    assert events[-1][2]["status"] == "succeeded" and events[-1][2]["pages_done"] == 5


async def test_a_page_whose_engine_call_fails_once_is_retried():
    engine = MockEngine()
    engine.fail_next = 1
    async with make_client(engine, job_page_concurrency=1, job_page_retries=2) as client:
        job = (await client.post("/v1/jobs", files=image_parts(3), data={"task": "text"})).json()
        events = parse_sse((await client.get(job["links"]["events"])).text)
        final = (await client.get(f"/v1/jobs/{job['id']}")).json()
    assert [e[2]["attempts"] for e in events[:3]] == [2, 1, 1]
    assert all(e[2]["status"] == "ok" for e in events[:3])
    assert len(engine.requests) == 4
    assert final["status"] == "succeeded" and final["pages_done"] == 3 and final["pages_failed"] == 0


async def test_retries_are_bounded_and_a_failed_page_is_reported_not_lost():
    engine = MockEngine()
    engine.fail_next = 3  # page 1: first call + 2 retries all fail
    async with make_client(engine, job_page_concurrency=1, job_page_retries=2) as client:
        job = (await client.post("/v1/jobs", files=image_parts(3), data={"task": "text"})).json()
        events = parse_sse((await client.get(job["links"]["events"])).text)
    first = events[0][2]
    assert first["status"] == "failed" and first["attempts"] == 3
    assert first["error"]["code"] == "engine_unavailable"
    assert [e[2]["status"] for e in events[1:3]] == ["ok", "ok"]
    assert events[-1][2]["status"] == "partial" and events[-1][2]["pages_failed"] == 1
    assert len(engine.requests) == 5


async def test_client_errors_from_the_engine_are_not_retried():
    engine = MockEngine()  # knows no adapters: the engine answers 404 unknown_adapter
    async with make_client(engine, job_page_retries=3) as client:
        job = (await client.post("/v1/jobs", files=image_parts(2),
                                 data={"task": "text", "adapter": "missing"})).json()
        events = parse_sse((await client.get(job["links"]["events"])).text)
    assert [(e[2]["status"], e[2]["attempts"], e[2]["error"]["code"]) for e in events[:2]] == \
        [("failed", 1, "unknown_adapter")] * 2
    assert events[-1][2]["status"] == "failed"


async def test_cancel_mid_way_stops_the_job():
    engine = MockEngine(delay_s=0.3)
    async with make_client(engine, job_page_concurrency=1) as client:
        job = (await client.post("/v1/jobs", files=image_parts(10), data={"task": "text"})).json()
        await wait_for_job(client, job["id"], lambda b: b["pages_done"] >= 1)
        resp = await client.delete(f"/v1/jobs/{job['id']}")
        assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
        await runner_of(client).wait_all()
        final = (await client.get(f"/v1/jobs/{job['id']}")).json()
        events = parse_sse((await client.get(job["links"]["events"])).text)
        again = await client.delete(f"/v1/jobs/{job['id']}")  # idempotent
    assert final["status"] == "cancelled" and final["finished_at"] is not None
    assert 1 <= final["pages_done"] < 10
    assert len(engine.requests) < 10
    assert [p["page"] for p in final["pages"]] == list(range(1, final["pages_done"] + 1))
    assert events[-1][0] == "done" and events[-1][2]["status"] == "cancelled"
    assert [e[2]["page"] for e in events[:-1]] == [p["page"] for p in final["pages"]]
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


async def test_jobs_count_against_the_rate_limit_by_pages():
    engine = MockEngine()
    # 3 pages of burst and a refill too slow to matter: pages 4 and 5 must wait for tokens
    async with make_client(engine, rate_limit_cost="pages", default_burst=3, default_rate=0.001) as client:
        job = (await client.post("/v1/jobs", files=image_parts(5), data={"task": "text"})).json()
        body = await wait_for_job(client, job["id"], lambda b: b["pages_done"] >= 3)
        await asyncio.sleep(0.5)
        body = (await client.get(f"/v1/jobs/{job['id']}")).json()
        assert body["status"] == "running" and body["pages_done"] == 3
        resp = await client.post("/v1/ocr", files={"file": ("x.png", png(), "image/png")}, data={"task": "text"})
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "rate_limited"
        resp = await client.post("/v1/jobs", files=image_parts(1), data={"task": "text"})
        assert resp.status_code == 429  # no token for a new job's first page either
        await client.delete(f"/v1/jobs/{job['id']}")
        await runner_of(client).wait_all()
    assert len(engine.requests) == 3


async def test_image_jobs_with_a_page_range_and_page_previews():
    engine = MockEngine()
    async with make_client(engine) as client:
        parts = [("file", (f"p{i}.png", png(colour, (200 + i, 100)), "image/png"))
                 for i, colour in enumerate(["red", "green", "blue"])]
        resp = await client.post("/v1/jobs", files=parts,
                                 data={"task": "text", "pages": "1,3", "return_page_images": "true"})
        assert resp.status_code == 202 and resp.json()["pages"] == [1, 3]
        events = parse_sse((await client.get(resp.json()["links"]["events"])).text)
    pages = [e[2] for e in events[:-1]]
    assert [p["page"] for p in pages] == [1, 3]
    assert [p["result"]["image"]["width"] for p in pages] == [200, 202]
    assert all(p["image"].startswith("data:image/jpeg;base64,") for p in pages)


async def test_events_resume_after_last_event_id():
    async with make_client(MockEngine()) as client:
        job = (await client.post("/v1/jobs", files=image_parts(4), data={"task": "text"})).json()
        await wait_for_job(client, job["id"], lambda b: b["status"] == "succeeded")
        events = parse_sse((await client.get(job["links"]["events"], headers={"Last-Event-ID": "1"})).text)
    assert [e[1] for e in events] == ["2", "3", None]


@pytest.mark.parametrize("fields, files, status, code", [
    ({"task": "text", "webhook": "http://169.254.169.254/latest"}, None, 400, "invalid_webhook"),
    ({"task": "nope"}, None, 400, "unknown_task"),
    ({"task": "text"}, [], 400, "empty_image"),
    ({"task": "text"}, [("file", ("a.pdf", b"%PDF-1.4", "application/pdf")),
                        ("file", ("b.png", b"\x89PNG\r\n\x1a\n", "image/png"))], 400, "invalid_request"),
    ({"task": "text"}, [("file", ("x.bin", b"MZ\x90\x00 not an image", "application/octet-stream"))], 415,
     "unsupported_media_type"),
])
async def test_bad_job_requests(fields, files, status, code):
    async with make_client(MockEngine(), max_pdf_pages=3) as client:
        parts = image_parts(1) if files is None else files
        resp = await client.post("/v1/jobs", files=parts or {"x": ("", b"", "text/plain")}, data=fields)
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["code"] == code


async def test_unknown_job_is_404():
    async with make_client(MockEngine()) as client:
        for method in ("GET", "DELETE"):
            resp = await client.request(method, "/v1/jobs/job-doesnotexist")
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
        resp = await client.get("/v1/jobs/job-doesnotexist/events")
        assert resp.status_code == 404


async def test_a_tenant_cannot_see_or_cancel_another_tenants_job():
    ctx = AppContext(settings=Settings(), engine=MockEngine(delay_s=0.2), authenticator=BearerTenants())
    app = create_app(ctx)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
        job = (await client.post("/v1/jobs", files=image_parts(3), data={"task": "text"}, headers=alice)).json()
        for method, path in [("GET", ""), ("GET", "/events"), ("DELETE", "")]:
            resp = await client.request(method, f"/v1/jobs/{job['id']}{path}", headers=bob)
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
        assert (await client.get(f"/v1/jobs/{job['id']}")).status_code == 401
        events = parse_sse((await client.get(f"/v1/jobs/{job['id']}/events", headers=alice)).text)
        assert events[-1][2]["status"] == "succeeded"  # bob's DELETE did not cancel it


async def test_page_retries_wait_jittered_exponential_steps(monkeypatch):
    from service.jobs import runner as runner_module
    from tests.unit.test_retry_backoff import recording

    calls = recording(monkeypatch, runner_module)
    engine = MockEngine()
    engine.fail_next = 3
    async with make_client(engine, job_page_concurrency=1, job_page_retries=2) as client:
        job = (await client.post("/v1/jobs", files=image_parts(1), data={"task": "text"})).json()
        parse_sse((await client.get(job["links"]["events"])).text)
    assert [retry for retry, _, _ in calls] == [0, 1]  # two retries, each after a wait
    assert all(step / 2 <= wait <= step for _, wait, step in calls)
    assert [step for _, _, step in calls] == [runner_module.RETRY_BACKOFF_S, 2 * runner_module.RETRY_BACKOFF_S]
