"""Token-bucket rate limiting per tenant.

- `LocalTokenBucket`: in-process buckets (no Redis configured; also the fail-open fallback).
- `RedisTokenBucket`: one bucket per tenant in Redis, decided by one atomic Lua script (EVALSHA) that reads the clock
  with Redis `TIME`, so every ingress replica shares the bucket and no client clock is trusted.
- `FailoverLimiter`: Redis first; when Redis fails, `open` admits through a local bucket holding this replica's
  share (rate/replicas, burst/replicas) and `closed` answers 503 `rate_limiter_unavailable`. While Redis is down,
  one probe per `probe_interval_s` tries it again (so a dead Redis costs one short timeout per interval, not one
  per request) and the first successful probe puts the limiter back on Redis.

A request that costs more than the whole bucket is charged the whole bucket (it could never be admitted otherwise).

Requests pay before any work, from what is known then (image headers, a PDF's page boxes); `adjust` settles the
difference once the real cost is known: a refund (capped at a full bucket) or a further charge that is taken even
when the bucket cannot cover it (the work is done), leaving the bucket in debt down to minus one bucket, so the
tenant's next requests wait for it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, Protocol
from urllib.parse import quote

from service.errors import OCRError

log = logging.getLogger(__name__)


# The rate-limit fields of a response. `RateLimit-Policy` and `RateLimit` are draft-ietf-httpapi-ratelimit-headers-09
# (and -10, unchanged there): Structured Field lists naming the policy. `RateLimit-Limit`, `-Remaining` and `-Reset`
# are the separate fields of drafts -03 to -06, which most clients and proxies still read: both are sent.
POLICY_NAME = "tenant"  # one token bucket per tenant
# `qu` of the policy for each `rate_limit_cost` mode (none: the draft's default unit, requests)
QUOTA_UNITS = {"requests": None, "pages": "pages", "image_tokens": "image-tokens"}


@dataclass(frozen=True)
class Decision:
    allowed: bool
    limit: float  # bucket size (burst)
    remaining: float  # tokens left after this decision
    reset_s: float  # seconds until the bucket is full again
    retry_after_s: float  # seconds until `cost` tokens are available (0 when allowed)
    window_s: float = 0.0  # seconds an empty bucket takes to fill (burst / rate): the policy's window

    def headers(self, cost_mode: str = "requests") -> dict[str, str]:
        limit, remaining = int(self.limit), max(0, int(self.remaining))
        reset = max(0, math.ceil(self.reset_s))
        policy = f'"{POLICY_NAME}";q={limit};w={max(1, math.ceil(self.window_s))}'
        if QUOTA_UNITS.get(cost_mode):
            policy += f';qu="{QUOTA_UNITS[cost_mode]}"'
        out = {
            "RateLimit-Policy": policy,
            "RateLimit": f'"{POLICY_NAME}";r={remaining};t={reset}',
            "RateLimit-Limit": str(limit),
            "RateLimit-Remaining": str(remaining),
            "RateLimit-Reset": str(reset),
        }
        if not self.allowed:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


class Limiter(Protocol):
    async def acquire(self, tenant: str, cost: float, rate: float, burst: float) -> Decision: ...

    async def adjust(self, tenant: str, delta: float, rate: float, burst: float) -> None:
        """Take `delta` more tokens (negative: give them back) without a decision: tokens stay within
        [-burst, burst]."""


    async def close(self) -> None: ...


def _decision(allowed: bool, tokens: float, cost: float, rate: float, burst: float) -> Decision:
    retry_after = 0.0 if allowed else (cost - tokens) / rate
    return Decision(allowed, burst, tokens, (burst - tokens) / rate, retry_after, burst / rate)


class LocalTokenBucket:
    """In-process buckets, exact for one process. With `replicas` > 1 each bucket holds this replica's share
    (rate/replicas, burst/replicas) so that N replicas together admit about what one shared bucket would."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, replicas: int = 1):
        self._clock = clock
        self._share = 1.0 / max(1, replicas)
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill time)

    async def acquire(self, tenant: str, cost: float, rate: float, burst: float) -> Decision:
        return self.acquire_sync(tenant, cost, rate, burst)

    def acquire_sync(self, tenant: str, cost: float, rate: float, burst: float) -> Decision:
        rate, burst = rate * self._share, max(1.0, burst * self._share)
        cost = min(cost, burst)
        now = self._clock()
        tokens, last = self._buckets.get(tenant, (burst, now))
        tokens = min(burst, tokens + max(0.0, now - last) * rate)
        allowed = cost <= tokens
        if allowed:
            tokens -= cost
        self._buckets[tenant] = (tokens, now)
        return _decision(allowed, tokens, cost, rate, burst)

    async def adjust(self, tenant: str, delta: float, rate: float, burst: float) -> None:
        self.adjust_sync(tenant, delta, rate, burst)

    def adjust_sync(self, tenant: str, delta: float, rate: float, burst: float) -> None:
        rate, burst = rate * self._share, max(1.0, burst * self._share)
        now = self._clock()
        tokens, last = self._buckets.get(tenant, (burst, now))
        tokens = min(burst, tokens + max(0.0, now - last) * rate)
        self._buckets[tenant] = (max(-burst, min(burst, tokens - delta)), now)

    async def close(self) -> None:
        return None


# KEYS[1] = the tenant's bucket (a hash: tokens, ts in microseconds of Redis TIME)
# ARGV = rate (tokens/s), burst, amount, mode. The bucket is refilled to now first. Mode `acquire` (amount = cost):
# returns {allowed 0|1, tokens left, seconds until `cost` is available}. Mode `adjust` (amount = tokens to take,
# negative gives them back): moves the bucket within [-burst, burst] without a decision; returns {1, tokens left, 0}.
# Numbers go back as strings: Redis truncates Lua numbers in replies to integers.
TOKEN_BUCKET_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now_us
end
local elapsed = math.max(0, now_us - ts) / 1000000
tokens = math.min(burst, tokens + elapsed * rate)
local allowed = 1
local retry_after = 0
if ARGV[4] == 'adjust' then
  tokens = math.max(-burst, math.min(burst, tokens - amount))
elseif amount <= tokens then
  tokens = tokens - amount
else
  allowed = 0
  retry_after = (amount - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%d', now_us))
-- keep the bucket about twice its refill time (1 s to 30 days; from minus one bucket to a full one is exactly
-- that); an expired bucket is a full one
local ttl_ms = math.min(2592000000, math.max(1000, math.ceil(2000 * burst / rate)))
redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl_ms))
return {allowed, string.format('%.17g', tokens), string.format('%.17g', retry_after)}
"""


def bucket_key(prefix: str, tenant: str) -> str:
    """`<prefix>{<tenant>}`: the hash tag keeps a tenant's keys in one Redis Cluster slot; the tenant is
    percent-quoted so braces in a tenant name cannot change the tag."""
    return f"{prefix}{{{quote(tenant, safe='')}}}"


def make_redis_client(url: str, timeout_s: float):
    """An asyncio Redis client that fails fast: short connect/read timeouts, and the failover limiter decides what a
    failure means. One exception: a connection error is retried once, at once, on a new connection. A Redis restart
    leaves every idle pooled connection stale, and each would otherwise fail its next request once, flapping the
    limiter back to the local bucket after Redis is back. While Redis is down, the retry's connect is refused as
    fast as the first (a connect timeout is a timeout, not retried). Timeouts are not retried: the script may have
    run, and a slow Redis should not be asked twice. (A connection lost after the script ran charges that request
    twice; rare, and the lesser harm.)"""
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                                health_check_interval=0)


class RedisTokenBucket:
    """Per-tenant buckets shared by all replicas through Redis. Raises the client's errors (redis.RedisError,
    OSError) to the caller; see FailoverLimiter."""

    def __init__(self, client, key_prefix: str = "ocr:rl:"):
        self._client = client
        self._key_prefix = key_prefix
        self._script = client.register_script(TOKEN_BUCKET_LUA)  # EVALSHA, reloaded on NOSCRIPT

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.05, key_prefix: str = "ocr:rl:") -> "RedisTokenBucket":
        return cls(make_redis_client(url, timeout_s), key_prefix)

    def key(self, tenant: str) -> str:
        return bucket_key(self._key_prefix, tenant)

    async def acquire(self, tenant: str, cost: float, rate: float, burst: float) -> Decision:
        cost = min(cost, burst)
        allowed, tokens, retry_after = await self._script(keys=[self.key(tenant)],
                                                          args=[rate, burst, cost, "acquire"])
        tokens = float(tokens)
        return Decision(bool(int(allowed)), burst, tokens, (burst - tokens) / rate, float(retry_after), burst / rate)

    async def adjust(self, tenant: str, delta: float, rate: float, burst: float) -> None:
        await self._script(keys=[self.key(tenant)], args=[rate, burst, delta, "adjust"])

    async def close(self) -> None:
        await self._client.aclose()


BackendErrorHook = Callable[[BaseException], None]
FallbackHook = Callable[[str, bool], None]  # (fail mode, deciding without Redis now)


class FailoverLimiter:
    """Redis bucket with a documented behaviour when Redis fails (see the module docstring).

    `on_backend_error(exc)` is called once per failed Redis call (the metrics layer counts
    `ocr_ratelimit_backend_errors_total` with it); `backend_errors` counts the same, `degraded` says whether
    decisions are currently local. `on_fallback(fail_mode, degraded)` is called at start (False) and whenever
    `degraded` changes (the `ocr_ratelimit_fallback` gauge).
    """

    def __init__(self, primary: Limiter, *, fail_mode: Literal["open", "closed"] = "open", replicas: int = 1,
                 probe_interval_s: float = 1.0, log_interval_s: float = 30.0,
                 on_backend_error: BackendErrorHook | None = None, on_fallback: FallbackHook | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.primary = primary
        self.fallback = LocalTokenBucket(clock=clock, replicas=replicas)
        self.fail_mode = fail_mode
        self.probe_interval_s = probe_interval_s
        self.log_interval_s = log_interval_s
        self.on_backend_error = on_backend_error
        self.on_fallback = on_fallback
        self.backend_errors = 0
        self._clock = clock
        self._next_probe = 0.0  # while degraded: when the next request may try Redis again
        self._degraded_since: float | None = None
        self._last_log = -math.inf
        self._errors_since_log = 0
        self._report_fallback()

    @property
    def degraded(self) -> bool:
        return self._degraded_since is not None

    def _report_fallback(self) -> None:
        if self.on_fallback is not None:
            try:
                self.on_fallback(self.fail_mode, self.degraded)
            except Exception:  # a metrics hook must never fail a request
                log.exception("rate limiter: on_fallback hook failed")

    async def acquire(self, tenant: str, cost: float, rate: float, burst: float) -> Decision:
        now = self._clock()
        if self.degraded and now < self._next_probe:
            return self._without_backend(tenant, cost, rate, burst, now)
        if self.degraded:
            self._next_probe = now + self.probe_interval_s  # this request is the probe; others stay local
        try:
            decision = await self.primary.acquire(tenant, cost, rate, burst)
        except Exception as exc:  # any backend failure (connection, timeout, OOM, script error) is handled alike
            self._record_failure(exc, now)
            return self._without_backend(tenant, cost, rate, burst, now)
        if self.degraded:  # the clock read again: a request that failed while this one waited set the start later
            log.warning("rate limiter: Redis is back after %.1fs; shared buckets in use again",
                        self._clock() - self._degraded_since)
            self._degraded_since = None
            self._report_fallback()
        return decision

    async def adjust(self, tenant: str, delta: float, rate: float, burst: float) -> None:
        """Best effort, like the bucket it settles: the local share while Redis is away (or closed: nothing to
        settle, the request was refused or admitted by Redis)."""
        now = self._clock()
        if not self.degraded:
            try:
                await self.primary.adjust(tenant, delta, rate, burst)
                return
            except Exception as exc:  # the same handling as a failed acquire
                self._record_failure(exc, now)
        if self.fail_mode == "open":
            self.fallback.adjust_sync(tenant, delta, rate, burst)

    def _record_failure(self, exc: BaseException, now: float) -> None:
        self.backend_errors += 1
        self._errors_since_log += 1
        if self.on_backend_error is not None:
            try:
                self.on_backend_error(exc)
            except Exception:  # a metrics hook must never fail a request
                log.exception("rate limiter: on_backend_error hook failed")
        if self._degraded_since is None:
            self._degraded_since = now
            self._report_fallback()
        self._next_probe = now + self.probe_interval_s
        if now - self._last_log >= self.log_interval_s:
            # the exception type only: its text may contain the Redis URL (and its password)
            log.error("rate limiter: Redis unavailable (%s; %d error(s) since last report); fail mode %s: %s",
                      type(exc).__name__, self._errors_since_log, self.fail_mode,
                      "admitting through this replica's local bucket" if self.fail_mode == "open"
                      else "answering 503")
            self._last_log = now
            self._errors_since_log = 0

    def _without_backend(self, tenant: str, cost: float, rate: float, burst: float, now: float) -> Decision:
        if self.fail_mode == "closed":
            wait = max(1, math.ceil(self._next_probe - now))
            raise OCRError("rate_limiter_unavailable", "the rate limiter is unavailable; retry later",
                           headers={"Retry-After": str(wait)})
        return self.fallback.acquire_sync(tenant, cost, rate, burst)

    async def close(self) -> None:
        await self.primary.close()


def make_limiter(settings, on_backend_error: BackendErrorHook | None = None,
                 on_fallback: FallbackHook | None = None) -> Limiter:
    """The limiter the settings ask for: Redis with failover when `redis_url` is set, else in-process buckets
    holding this replica's share."""
    replicas = settings.serve.ingress_options()["num_replicas"]
    if settings.redis.url is None:
        return LocalTokenBucket(replicas=replicas)
    primary = RedisTokenBucket.from_url(settings.redis.url.get_secret_value(),
                                        timeout_s=settings.rate_limit.redis_timeout_ms / 1000,
                                        key_prefix=settings.rate_limit.key_prefix)
    return FailoverLimiter(primary, fail_mode=settings.rate_limit.fail_mode, replicas=replicas,
                           probe_interval_s=settings.rate_limit.probe_interval_s,
                           log_interval_s=settings.rate_limit.backend_log_interval_s,
                           on_backend_error=on_backend_error, on_fallback=on_fallback)
