"""The token buckets without a Redis server: the Redis bucket's Lua script run by fakeredis' Lua interpreter against
the bucket's rules (tests/fixtures/token_bucket.py; the same rules against a real redis-server, and Redis killed, hung
and restarted under the failover limiter: tests/integration/test_ratelimit.py), the in-process bucket's replica share,
the failover limiter's log of an outage, and the API on the in-process bucket when no Redis is configured."""

from __future__ import annotations

import asyncio
import logging
from base64 import b64encode

import fakeredis
import pytest

from service.admission.ratelimit import Decision, FailoverLimiter, LocalTokenBucket, RedisTokenBucket
from service.engine.mock import MockEngine
from tests.fixtures.api_inprocess import make_client
from tests.fixtures.jobs import png
from tests.fixtures.token_bucket import (  # noqa: F401  (the bucket's rules, collected here against fakeredis)
    test_burst_then_denied_with_retry_after,
    test_cost_above_the_burst_takes_the_whole_bucket,
    test_key_name_is_cluster_safe_and_expires_after_twice_the_refill_time,
    test_refill_after_retry_after_admits_again,
    test_refill_uses_the_redis_clock,
    test_tenants_have_separate_buckets,
)


@pytest.fixture
def fake_server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
async def bucket(fake_server):
    limiter = RedisTokenBucket(fakeredis.FakeAsyncRedis(server=fake_server))
    yield limiter
    await limiter.close()


@pytest.fixture
def bucket_redis(fake_server):
    return fakeredis.FakeRedis(server=fake_server)


async def test_local_bucket_holds_the_replica_share():
    bucket = LocalTokenBucket(replicas=4)
    decisions = [bucket.acquire_sync("acme", 1, 0.01, 20) for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    assert decisions[0].limit == 5


async def test_back_on_redis_logs_how_long_it_was_away_never_a_negative_time(caplog):
    """A request that waits on Redis while another fails: the failure starts the outage after the waiting request's
    own start. Its success then ends the outage, and the log gives the time from the failure to now (0.5 s), not
    the negative difference from its own start ("back after -0.0s")."""
    from service.admission.ratelimit import Decision

    clock = [100.0]
    release = asyncio.Event()

    class Primary:
        async def acquire(self, tenant, cost, rate, burst):
            if tenant == "fails":
                raise ConnectionError("stale connection")
            await release.wait()
            return Decision(True, burst, burst - cost, 0.0, 0.0)

        async def close(self):
            pass

    limiter = FailoverLimiter(Primary(), clock=lambda: clock[0])
    caplog.set_level(logging.WARNING, logger="service.admission.ratelimit")
    waiting = asyncio.create_task(limiter.acquire("waits", 1, 1.0, 10))  # starts at 100.0
    await asyncio.sleep(0)
    clock[0] = 101.0
    await limiter.acquire("fails", 1, 1.0, 10)  # the outage starts at 101.0
    assert limiter.degraded
    clock[0] = 101.5
    release.set()
    assert (await waiting).allowed and not limiter.degraded
    assert [r.getMessage() for r in caplog.records if "is back" in r.getMessage()] == [
        "rate limiter: Redis is back after 0.5s; shared buckets in use again"]


async def test_no_redis_uses_the_in_process_bucket():
    engine = MockEngine()
    async with make_client(engine, default_rate=0.01, default_burst=2) as client:
        statuses = [(await client.post("/v1/ocr", json={"image": b64encode(png()).decode(), "task": "text"})).status_code
                    for _ in range(3)]
    assert statuses == [200, 200, 429] and len(engine.requests) == 2


def test_the_policy_names_its_quota_unit_unless_it_is_requests():
    decision = Decision(True, 100.0, 40.4, 29.5, 0.0, 50.0)
    assert decision.headers("requests")["RateLimit-Policy"] == '"tenant";q=100;w=50'
    assert decision.headers("pages")["RateLimit-Policy"] == '"tenant";q=100;w=50;qu="pages"'
    assert decision.headers("image_tokens")["RateLimit-Policy"] == '"tenant";q=100;w=50;qu="image-tokens"'
    assert decision.headers()["RateLimit"] == '"tenant";r=40;t=30'
