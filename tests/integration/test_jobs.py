"""The Redis job store under two ingress apps in-process (mock engine, a real redis-server): a job accepted by one is
read, streamed and cancelled through the other, with its TTL; Redis down is a 503 with a stable code."""

from __future__ import annotations

import asyncio

import httpx

from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.config import Settings
from tests.fixtures.jobs import image_parts, parse_sse, runner_of, wait_for_job


async def test_redis_store_is_shared_by_ingress_replicas(redis_server):
    """Two ingress apps on one Redis: a job accepted by A is read, streamed and cancelled through B."""
    settings = Settings(redis_url=redis_server.url, job_ttl_s=120, job_page_concurrency=1, rate_limit_enabled=False)
    engine = MockEngine(delay_s=0.2)
    apps = [create_app(AppContext(settings=settings, engine=engine)) for _ in range(2)]
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)
               for app in apps]
    a, b = clients
    try:
        done_job = (await a.post("/v1/jobs", files=image_parts(2), data={"task": "text"})).json()
        events = parse_sse((await b.get(done_job["links"]["events"])).text)
        assert [e[0] for e in events] == ["page", "page", "done"] and events[-1][2]["status"] == "succeeded"
        final = (await b.get(f"/v1/jobs/{done_job['id']}")).json()
        assert [p["result"]["text"] for p in final["pages"]] == ["MOCK LINE ONE\nmock line two"] * 2

        long_job = (await a.post("/v1/jobs", files=image_parts(20), data={"task": "text"})).json()
        await wait_for_job(b, long_job["id"], lambda body: body["pages_done"] >= 1)
        assert (await b.delete(f"/v1/jobs/{long_job['id']}")).json()["status"] == "cancelled"
        await asyncio.wait_for(runner_of(a).wait_all(), 30)  # A's runner saw B's cancel flag and stopped
        final = (await a.get(f"/v1/jobs/{long_job['id']}")).json()
        assert final["status"] == "cancelled" and final["pages_done"] < 20

        redis = redis_server.client()
        key = f"ocr:job:{done_job['id']}"
        assert 0 < redis.ttl(key) <= 120 and 0 < redis.ttl(key + ":pages") <= 120
    finally:
        for client in clients:
            await client.aclose()


async def test_redis_down_is_a_503_with_a_stable_code(redis_server):
    settings = Settings(redis_url=redis_server.url, rate_limit_enabled=False)
    app = create_app(AppContext(settings=settings, engine=MockEngine()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        redis_server.kill()
        resp = await client.post("/v1/jobs", files=image_parts(1), data={"task": "text"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "job_store_unavailable"
        resp = await client.get("/v1/jobs/job-x")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "job_store_unavailable"
