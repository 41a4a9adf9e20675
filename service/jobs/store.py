"""Where jobs live: Redis (shared by every ingress replica, TTL per job) when `redis_url` is set, else in-process.

Layout (both stores): one hash per job with the immutable `record` (JSON) and the fields that change — `status`,
`updated_at`, `heartbeat_at`, `finished_at`, `error`, the counters `done`/`failed` and the `cancel` flag — plus one
hash of page results keyed by page index. Fields are written individually, so a cancel (any replica) and the
runner's heartbeats never overwrite each other; a requested cancel shows as `cancelled` at once. Every write renews
the TTL (`job_ttl_s` after the last change).

Running-job slots (`max_running_jobs_per_tenant`): a job holds one of its tenant's slots from its `POST` until its
runner ends. In Redis a tenant's slots are one sorted set (job id → lease end, Redis clock), taken by one Lua script
that drops expired leases first, renewed with the runner's heartbeat and given back when the job ends: a replica that
dies frees its jobs' slots when their leases run out. In-process, a set of job ids per tenant.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

from service.errors import OCRError
from service.jobs.model import HEARTBEAT_S, STALE_AFTER_S, TERMINAL, ErrorInfo, JobRecord, PageResult

_MUTABLE = ("status", "updated_at", "heartbeat_at", "finished_at", "error")


def _merge(fields: dict[str, str]) -> tuple[JobRecord, int, int]:
    """Stored fields → (record with current state, pages done, pages failed)."""
    record = JobRecord.model_validate_json(fields["record"])
    updates: dict[str, Any] = {name: json.loads(fields[name]) for name in _MUTABLE if name in fields}
    record = record.model_copy(update={k: ErrorInfo(**v) if k == "error" and v else v for k, v in updates.items()})
    if fields.get("cancel") and record.status not in TERMINAL:
        record = record.model_copy(update={"status": "cancelled"})
    elif record.status in ("queued", "running") and time.time() - record.heartbeat_at > STALE_AFTER_S:
        # the replica running it died (restart, scale-down): say so instead of "running" until the TTL ends
        record = record.model_copy(update={"status": "failed", "error": ErrorInfo(
            code="internal_error", message="the job's runner stopped (ingress replica restarted); resubmit it")})
    return record, int(fields.get("done", 0)), int(fields.get("failed", 0))


class JobStore(Protocol):
    async def create(self, record: JobRecord) -> None: ...

    async def get(self, job_id: str) -> tuple[JobRecord, int, int] | None:
        """(record, pages done, pages failed) or None when unknown or expired."""

    async def exists(self, job_id: str) -> bool:
        """Whether the job's record is stored (False once it expired or the store lost it)."""

    async def restore(self, record: JobRecord) -> None:
        """Write back a job the store lost (Redis restarted or failed over without its data): the record with its
        state as given, the page counters recounted from the page results still stored."""

    async def update(self, job_id: str, **fields: Any) -> None:
        """Set mutable fields (status, updated_at, heartbeat_at, finished_at, error)."""

    async def request_cancel(self, job_id: str) -> None: ...

    async def cancel_requested(self, job_id: str) -> bool: ...

    async def put_page(self, job_id: str, page: PageResult) -> None: ...

    async def pages(self, job_id: str, start: int = 0) -> list[PageResult]:
        """Stored page results with index ≥ start, in index order (possibly with gaps)."""

    async def wait(self, job_id: str, timeout_s: float) -> None:
        """Return when the job may have changed, or after timeout_s."""

    async def take_slot(self, tenant: str, job_id: str, limit: int) -> bool:
        """One of the tenant's running-job slots for this job; False when all `limit` are held."""

    async def renew_slot(self, tenant: str, job_id: str) -> None: ...

    async def release_slot(self, tenant: str, job_id: str) -> None: ...

    async def close(self) -> None: ...


class MemoryJobStore:
    """One process (tests, laptops, a single ingress replica). Expired jobs are swept on each create."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._jobs: dict[str, dict[str, str]] = {}
        self._pages: dict[str, dict[int, PageResult]] = {}
        self._expires: dict[str, float] = {}
        self._changed = asyncio.Condition()
        self._slots: dict[str, set[str]] = {}  # tenant -> its running jobs

    async def _touch(self, job_id: str) -> None:
        self._expires[job_id] = time.monotonic() + self.ttl_s
        async with self._changed:
            self._changed.notify_all()

    def _alive(self, job_id: str) -> bool:
        return job_id in self._jobs and self._expires.get(job_id, 0) > time.monotonic()

    async def create(self, record: JobRecord) -> None:
        now = time.monotonic()
        for job_id in [j for j, t in self._expires.items() if t <= now]:
            self._jobs.pop(job_id, None)
            self._pages.pop(job_id, None)
            self._expires.pop(job_id, None)
        self._jobs[record.id] = {"record": record.model_dump_json()}
        self._pages[record.id] = {}
        await self._touch(record.id)

    async def get(self, job_id: str) -> tuple[JobRecord, int, int] | None:
        if not self._alive(job_id):
            return None
        return _merge(self._jobs[job_id])

    async def exists(self, job_id: str) -> bool:
        return self._alive(job_id)

    async def restore(self, record: JobRecord) -> None:
        pages = self._pages.setdefault(record.id, {})
        self._jobs[record.id] = {"record": record.model_dump_json(), **_counts(pages.values())}
        await self._touch(record.id)

    async def update(self, job_id: str, **fields: Any) -> None:
        if job_id in self._jobs:
            self._jobs[job_id].update({k: json.dumps(_plain(v)) for k, v in fields.items()})
            await self._touch(job_id)

    async def request_cancel(self, job_id: str) -> None:
        if job_id in self._jobs:
            self._jobs[job_id]["cancel"] = "1"
            await self._touch(job_id)

    async def cancel_requested(self, job_id: str) -> bool:
        return bool(self._jobs.get(job_id, {}).get("cancel"))

    async def put_page(self, job_id: str, page: PageResult) -> None:
        if job_id not in self._jobs or page.index in self._pages[job_id]:
            return
        self._pages[job_id][page.index] = page
        fields = self._jobs[job_id]
        fields["done"] = str(int(fields.get("done", 0)) + 1)
        if page.status == "failed":
            fields["failed"] = str(int(fields.get("failed", 0)) + 1)
        await self._touch(job_id)

    async def pages(self, job_id: str, start: int = 0) -> list[PageResult]:
        if not self._alive(job_id):
            return []
        stored = self._pages[job_id]
        return [stored[i] for i in sorted(stored) if i >= start]

    async def wait(self, job_id: str, timeout_s: float) -> None:
        try:
            async with self._changed:
                # short: a change between the caller's read and this wait is seen on the next round
                await asyncio.wait_for(self._changed.wait(), min(timeout_s, 0.5))
        except asyncio.TimeoutError:
            pass

    async def take_slot(self, tenant: str, job_id: str, limit: int) -> bool:
        held = self._slots.setdefault(tenant, set())
        if len(held) >= limit:
            return False
        held.add(job_id)
        return True

    async def renew_slot(self, tenant: str, job_id: str) -> None:
        return None

    async def release_slot(self, tenant: str, job_id: str) -> None:
        held = self._slots.get(tenant)
        if held is not None:
            held.discard(job_id)
            if not held:
                del self._slots[tenant]

    async def close(self) -> None:
        return None


# KEYS[1] = the tenant's slots (sorted set: job id -> lease end in ms of Redis TIME); ARGV = job id, limit, lease ms.
# Returns 1 when the job holds a slot now (it already did, or one was free), else 0.
TAKE_SLOT_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1] = the tenant's slots; ARGV = job id, lease ms. Extends a held slot's lease (a slot already given back stays
# given back).
RENEW_SLOT_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) ~= false then
  redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
"""
# a slot outlives a stopped heartbeat this long: a few missed beats (a slow Redis) never free a running job's slot
SLOT_LEASE_S = 6 * HEARTBEAT_S


class RedisJobStore:
    """Shared by all ingress replicas: any replica answers GET/events/DELETE for a job another replica runs."""

    POLL_S = 0.25  # events streams re-read the job this often (cheap HGET/HMGET)

    def __init__(self, url: str, ttl_s: int, *, timeout_s: float = 2.0, prefix: str = "ocr:job:"):
        import redis.asyncio as aioredis

        self.ttl_s = int(ttl_s)
        self.prefix = prefix
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        decode_responses=True)
        self._take_slot = self._redis.register_script(TAKE_SLOT_LUA)
        self._renew_slot = self._redis.register_script(RENEW_SLOT_LUA)

    def _slots_key(self, tenant: str) -> str:
        from service.admission.ratelimit import bucket_key  # the same Cluster-safe, quoted hash tag

        return bucket_key(self.prefix + "slots:", tenant)

    def _keys(self, job_id: str) -> tuple[str, str]:
        return self.prefix + job_id, self.prefix + job_id + ":pages"

    async def _run(self, coro):
        try:
            return await coro
        except OCRError:
            raise
        except Exception as exc:  # connection refused, timeouts: a 503 with a stable code, never a 500
            raise OCRError("job_store_unavailable", "the job store (Redis) is unavailable; retry later",
                           headers={"Retry-After": "1"}) from exc

    async def _write(self, job_id: str, mapping: dict[str, str], incr: dict[str, int] | None = None,
                     page: PageResult | None = None) -> None:
        job_key, pages_key = self._keys(job_id)
        pipe = self._redis.pipeline(transaction=True)
        if mapping:
            pipe.hset(job_key, mapping=mapping)
        for field, amount in (incr or {}).items():
            pipe.hincrby(job_key, field, amount)
        if page is not None:
            pipe.hset(pages_key, str(page.index), page.model_dump_json())
        pipe.expire(job_key, self.ttl_s)
        pipe.expire(pages_key, self.ttl_s)
        await self._run(pipe.execute())

    async def create(self, record: JobRecord) -> None:
        await self._write(record.id, {"record": record.model_dump_json(), "done": "0", "failed": "0"})

    async def get(self, job_id: str) -> tuple[JobRecord, int, int] | None:
        fields = await self._run(self._redis.hgetall(self._keys(job_id)[0]))
        if not fields or "record" not in fields:
            return None
        return _merge(fields)

    async def exists(self, job_id: str) -> bool:
        return bool(await self._run(self._redis.hexists(self._keys(job_id)[0], "record")))

    async def restore(self, record: JobRecord) -> None:
        job_key, _ = self._keys(record.id)
        pages = await self.pages(record.id)
        # whatever was written after the loss (counters, a stale status) is replaced as a whole
        await self._run(self._redis.delete(job_key))
        await self._write(record.id, {"record": record.model_dump_json(), **_counts(pages)})

    async def update(self, job_id: str, **fields: Any) -> None:
        if await self._run(self._redis.exists(self._keys(job_id)[0])):
            await self._write(job_id, {k: json.dumps(_plain(v)) for k, v in fields.items()})

    async def request_cancel(self, job_id: str) -> None:
        if await self._run(self._redis.exists(self._keys(job_id)[0])):
            await self._write(job_id, {"cancel": "1"})

    async def cancel_requested(self, job_id: str) -> bool:
        return bool(await self._run(self._redis.hget(self._keys(job_id)[0], "cancel")))

    async def put_page(self, job_id: str, page: PageResult) -> None:
        _, pages_key = self._keys(job_id)
        if await self._run(self._redis.hexists(pages_key, str(page.index))):
            return
        incr = {"done": 1, **({"failed": 1} if page.status == "failed" else {})}
        await self._write(job_id, {}, incr, page)

    async def pages(self, job_id: str, start: int = 0) -> list[PageResult]:
        stored = await self._run(self._redis.hgetall(self._keys(job_id)[1]))
        items = sorted((int(k), v) for k, v in stored.items() if int(k) >= start)
        return [PageResult.model_validate_json(v) for _, v in items]

    async def wait(self, job_id: str, timeout_s: float) -> None:
        await asyncio.sleep(min(self.POLL_S, timeout_s))

    async def take_slot(self, tenant: str, job_id: str, limit: int) -> bool:
        lease_ms = int(SLOT_LEASE_S * 1000)
        return bool(await self._run(self._take_slot(keys=[self._slots_key(tenant)], args=[job_id, limit, lease_ms])))

    async def renew_slot(self, tenant: str, job_id: str) -> None:
        await self._run(self._renew_slot(keys=[self._slots_key(tenant)], args=[job_id, int(SLOT_LEASE_S * 1000)]))

    async def release_slot(self, tenant: str, job_id: str) -> None:
        await self._run(self._redis.zrem(self._slots_key(tenant), job_id))

    async def close(self) -> None:
        await self._redis.aclose()


def _counts(pages) -> dict[str, str]:
    """`done`/`failed` counter fields for these stored page results."""
    pages = list(pages)
    return {"done": str(len(pages)), "failed": str(sum(p.status == "failed" for p in pages))}


def _plain(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def make_store(settings) -> JobStore:
    if settings.redis.url is not None:
        return RedisJobStore(settings.redis.url.get_secret_value(), settings.jobs.ttl_s)
    return MemoryJobStore(settings.jobs.ttl_s)
