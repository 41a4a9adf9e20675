"""The chart's Redis holds rate-limit buckets, job records and results (and, with GCS fault tolerance, Ray's cluster
metadata): none of it may be evicted under memory pressure. The service's keys are written for real (the ingress app
in-process against a real redis-server run with the chart's `--maxmemory-policy`), then Redis is filled to its cap."""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
import redis as redis_py

from service.admission.redis_state import MARKER_KEY
from service.config import Settings
from service.engine.mock import MockEngine
from service.http.app import create_app
from service.pipeline.context import AppContext
from tests.fixtures.helm import find, render_chart, rendered_objects
from tests.fixtures.jobs import image_parts, wait_for_job
from tests.fixtures.jobs import png


def _chart_redis_policy() -> str:
    args = find(rendered_objects(render_chart()), "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--maxmemory-policy") + 1]


@asynccontextmanager
async def _service_state(url: str):
    """The app (its lifespan too: the Redis state watch writes its marker) after a rate-limited request and a
    finished two-page job; yields the client and the job's id."""
    from service.pipeline.context import build_context

    settings = Settings(engine="mock", redis_url=url, job_ttl_s=600, default_rate=10, default_burst=100)
    ctx = build_context(settings, MockEngine())
    app = create_app(ctx)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as client:
        ocr = await client.post("/v1/ocr", files={"file": ("p.png", png(), "image/png")}, data={"task": "text"})
        assert ocr.status_code == 200, ocr.text
        job = (await client.post("/v1/jobs", files=image_parts(2), data={"task": "text"})).json()
        await wait_for_job(client, job["id"], lambda body: body["status"] == "succeeded")
        try:
            yield client, job["id"]
        finally:
            await ctx.limiter.close()


async def test_every_key_the_service_writes_expires(redis_server):
    """With `noeviction` nothing is ever dropped to make room, so Redis stays bounded only if every key expires:
    buckets, job records, page results and job slots do; the reset marker is the one fixed key."""
    async with _service_state(redis_server.url) as (client, job_id):
        r = redis_server.client()
        keys = {k.decode(): r.ttl(k) for k in r.scan_iter(count=1000)}
        assert any(k.startswith("ocr:rl:") for k in keys), keys  # the limiter wrote its bucket
        assert f"ocr:job:{job_id}" in keys and f"ocr:job:{job_id}:pages" in keys
        without_ttl = {k for k, ttl in keys.items() if ttl < 0}
        assert without_ttl <= {MARKER_KEY}, keys


async def test_job_records_survive_memory_pressure(redis_server):
    policy = _chart_redis_policy()
    async with _service_state(redis_server.url) as (client, job_id):
        r = redis_server.client()
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", str(used + 2 * 1024 * 1024))
        r.config_set("maxmemory-policy", policy)
        filler = b"x" * 64 * 1024
        refused = 0
        for i in range(200):  # 12.5 MiB of expiring junk against a 2 MiB margin: the cap is reached
            try:
                r.set(f"filler:{i}", filler, ex=600)
            except redis_py.exceptions.OutOfMemoryError:
                refused += 1
        assert r.exists(f"ocr:job:{job_id}") and r.exists(f"ocr:job:{job_id}:pages"), f"{policy} evicted the job"
        assert refused, f"{policy}: the cap was never reached"
        # and it stays reached while the service works (freed client buffers could otherwise let a write through)
        r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) - 1024 * 1024))
        body = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert body["status"] == "succeeded" and len(body["pages"]) == 2
        # at the cap a new job is refused with the store's stable code, never a 500
        resp = await client.post("/v1/jobs", files=image_parts(1), data={"task": "text"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "job_store_unavailable", resp.text
        # and requests go on: the limiter answers from its local share while Redis refuses writes
        ocr = await client.post("/v1/ocr", files={"file": ("p.png", png(), "image/png")}, data={"task": "text"})
        assert ocr.status_code == 200, ocr.text
