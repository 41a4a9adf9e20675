"""Rate limiting through the HTTP API with a real redis-server: the deployed Serve app (2 ingress replicas sharing
Redis buckets) for bursts, tenant isolation and refill; the in-process FastAPI app (mock engine) for what needs the
engine's request log or a Redis crash under load."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import pytest
from PIL import Image

from service.cli.keys import add_key
from service.http.app import create_app
from service.engine.mock import MockEngine
from service.config import Settings

RECOVERY_DEADLINE_S = 5.0


def png_b64(size=(64, 32)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


BODY = {"image": png_b64(), "task": "text"}


def assert_limited(resp: httpx.Response, limit: int) -> None:
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == "rate_limited"
    retry_after = resp.headers["Retry-After"]
    assert retry_after.isdigit() and int(retry_after) >= 1
    assert resp.headers["RateLimit-Limit"] == str(limit)
    assert resp.headers["RateLimit-Remaining"] == "0"
    assert int(resp.headers["RateLimit-Reset"]) >= 1


async def burst(url: str, key: str, total: int, workers: int = 8) -> list[httpx.Response]:
    """`total` requests for one key from `workers` concurrent clients."""
    queue = list(range(total))
    responses: list[httpx.Response] = []

    async def worker(client: httpx.AsyncClient):
        while queue:
            queue.pop()
            responses.append(await client.post("/v1/ocr", json=BODY, headers={"Authorization": f"Bearer {key}"}))

    clients = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(workers)]
    try:
        await asyncio.gather(*(worker(c) for c in clients))
    finally:
        for c in clients:
            await c.aclose()
    return responses


# --- the deployed Serve app ------------------------------------------------------------------------------------------

BURST = 20


@pytest.fixture(scope="module")
def keyed_serve(serve_app, redis_server_module, tmp_path_factory):
    """Serve app (mock engine, 2 ingress replicas) with a key file and the module's Redis."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = {
        # refill of 1 token per 100 s: nothing refills during a burst
        "a": add_key(key_file, tenant="tenant-a", rate=0.01, burst=BURST)[0],
        "b": add_key(key_file, tenant="tenant-b", rate=0.01, burst=BURST)[0],
        "fast": add_key(key_file, tenant="tenant-fast", rate=1.0, burst=2)[0],
    }
    url = serve_app(engine="mock", api_keys_file=str(key_file), redis_url=redis_server_module.url,
                    ingress_replicas=2, rate_limit_cost="requests")
    return url, keys, redis_server_module


async def test_burst_admits_exactly_the_bucket(keyed_serve):
    url, keys, redis_server = keyed_serve
    responses = await burst(url, keys["a"], BURST + 20)
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code != 200]
    assert abs(len(ok) - BURST) <= 1, [r.status_code for r in responses]
    for resp in limited:
        assert_limited(resp, BURST)
    for resp in ok:
        assert resp.headers["RateLimit-Limit"] == str(BURST) and "Retry-After" not in resp.headers
        assert int(resp.headers["RateLimit-Remaining"]) < BURST
    # the decision was Redis' (shared by both replicas), not a per-replica bucket
    assert redis_server.client().exists("ocr:rl:{tenant-a}")


async def test_tenants_are_isolated(keyed_serve):
    url, keys, _ = keyed_serve
    emptied = await burst(url, keys["a"], BURST + 5)  # tenant-a: emptied here (or already by the burst test)
    assert emptied[-1].status_code == 429
    responses = await burst(url, keys["b"], BURST + 5)  # tenant-b still has its whole bucket
    assert abs(sum(r.status_code == 200 for r in responses) - BURST) <= 1


async def test_refill_after_retry_after_admits_again(keyed_serve):
    url, keys, _ = keyed_serve
    statuses = []
    for _ in range(10):  # bucket of 2 at 1 token/s: the third request (or a later one on a slow machine) is refused
        resp = (await burst(url, keys["fast"], 1, workers=1))[0]
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            break
    assert statuses[:2] == [200, 200] and statuses[-1] == 429, statuses
    assert_limited(resp, 2)
    await asyncio.sleep(int(resp.headers["Retry-After"]))
    again = await burst(url, keys["fast"], 1, workers=1)
    assert again[0].status_code == 200, again[0].text


async def test_missing_key_is_refused_before_the_limiter(keyed_serve):
    url, _, _ = keyed_serve
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        resp = await client.post("/v1/ocr", json=BODY)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthorized"
    assert "RateLimit-Limit" not in resp.headers


def test_no_key_in_the_service_logs(keyed_serve):
    """Everything the Ray processes wrote (Serve access logs, replica logs with the service's own records) is free
    of the keys."""
    import ray

    url, keys, _ = keyed_serve
    httpx.post(url + "/v1/ocr", json=BODY, headers={"X-API-Key": keys["b"] + "x"}, timeout=60)  # an invalid key
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    from pathlib import Path

    logs = [p for p in (Path(session_dir) / "logs").rglob("*") if p.is_file()]
    assert logs
    # the service's own records are among them (service/serve/replica_logs.py): the refusal was logged
    assert any(b"auth: unknown API key refused" in p.read_bytes() for p in logs)
    for path in logs:
        data = path.read_bytes()
        for key in keys.values():
            assert key.encode() not in data, f"API key leaked into {path}"


# --- the in-process app (mock engine) --------------------------------------------------------------------------------

def app_client(engine_client, **settings) -> tuple[httpx.AsyncClient, object]:
    from service.pipeline.context import build_context

    ctx = build_context(Settings(**settings), engine_client)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://test", timeout=60)
    return client, ctx


async def test_denied_requests_cost_the_engine_nothing(redis_server):
    engine = MockEngine()
    client, ctx = app_client(engine, engine="mock", redis_url=redis_server.url, default_rate=0.01, default_burst=3)
    async with client:
        responses = [await client.post("/v1/ocr", json=BODY) for _ in range(5)]
    await ctx.limiter.close()
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429]
    assert [r.headers["RateLimit-Remaining"] for r in responses[:3]] == ["2", "1", "0"]
    assert_limited(responses[3], 3)
    assert len(engine.requests) == 3  # the two 429s never reached the engine


async def test_image_token_cost(redis_server):
    from service.admission.budget import PROMPT_OVERHEAD_TOKENS, plan_for_vlm

    settings = dict(engine="mock", redis_url=redis_server.url, rate_limit_cost="image_tokens",
                    default_rate=0.01, default_burst=100_000)
    s = Settings(**settings)
    plan = plan_for_vlm(64, 32, max_model_len=s.engine.max_model_len, max_tokens=s.engine.max_output_tokens,
                        min_pixels=s.engine.min_image_pixels, max_pixels=s.engine.max_engine_image_pixels,
                        prompt_overhead=PROMPT_OVERHEAD_TOKENS)
    client, ctx = app_client(MockEngine(), **settings)
    async with client:
        first = await client.post("/v1/ocr", json={**BODY, "max_tokens": s.engine.max_output_tokens})
    await ctx.limiter.close()
    assert first.status_code == 200, first.text
    assert plan.image_tokens > 1
    assert int(first.headers["RateLimit-Remaining"]) == 100_000 - plan.image_tokens


async def test_redis_killed_under_steady_load_no_5xx_and_back_on_redis(redis_server):
    errors: list[BaseException] = []
    client, ctx = app_client(MockEngine(), engine="mock", redis_url=redis_server.url, default_rate=1000,
                             default_burst=1000, rate_limit_probe_interval_s=0.5, ingress_replicas=2)
    ctx.limiter.on_backend_error = errors.append  # the metrics hook
    statuses: list[int] = []
    stop = asyncio.Event()

    async def steady():
        while not stop.is_set():
            resp = await client.post("/v1/ocr", json=BODY)
            statuses.append(resp.status_code)
            await asyncio.sleep(0.01)

    async with client:
        workers = [asyncio.create_task(steady()) for _ in range(8)]
        try:
            await asyncio.sleep(0.5)
            assert not ctx.limiter.degraded
            redis_server.kill()
            await asyncio.sleep(1.5)
            assert ctx.limiter.degraded and errors and ctx.limiter.backend_errors == len(errors)
            # fail open: this replica admits with its local share (burst 1000 / 2 replicas)
            during = await client.post("/v1/ocr", json=BODY)
            assert during.status_code == 200 and during.headers["RateLimit-Limit"] == "500"
            errors_during_outage = len(errors)
            redis_server.start()
            started = time.monotonic()
            client_redis = redis_server.client()
            while not (client_redis.exists("ocr:rl:{anonymous}") and not ctx.limiter.degraded):
                assert time.monotonic() - started <= RECOVERY_DEADLINE_S, "not back on Redis within 5 s"
                await asyncio.sleep(0.05)
            after = await client.post("/v1/ocr", json=BODY)
            assert after.headers["RateLimit-Limit"] == "1000"
        finally:
            stop.set()
            await asyncio.gather(*workers)
            await ctx.limiter.close()
    assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
    assert errors_during_outage >= 2  # probes kept failing while Redis was down


async def test_fail_closed_answers_503_with_retry_after(redis_server):
    client, ctx = app_client(MockEngine(), engine="mock", redis_url=redis_server.url, rate_limit_fail_mode="closed")
    async with client:
        assert (await client.post("/v1/ocr", json=BODY)).status_code == 200
        redis_server.kill()
        resp = await client.post("/v1/ocr", json=BODY)
    await ctx.limiter.close()
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "rate_limiter_unavailable"
    assert int(resp.headers["Retry-After"]) >= 1
