"""Notices when Redis restarted, failed over or lost the service's state, so that it is counted, logged and alerted
on instead of passing silently (`/readyz` stays 200 through it: the service works on, with the state reset).

What Redis holds for the service: the rate-limit buckets and the jobs. Losing them is survivable but not harmless:
a missing bucket is a full one (every tenant may send up to one more burst), and a running job's results are gone
(the ingress replica that runs it marks it failed `job_lost`, service/jobs/runner.py).

How: a marker key (`MARKER_KEY`, no TTL) holds a random token. Every `interval_s` each ingress replica reads it
together with the server's `run_id` (INFO server, new on every start of a Redis process):
  - marker gone: the data was lost (restart without persistence, failover to a replica that had not caught up,
    FLUSHALL, eviction). Counted as `lost`; the replica writes a new token (SET NX: the first replica to notice
    writes it, the others read it);
  - another token than this replica saw last: another replica found the marker gone first. Counted as `lost`;
  - same token, new run_id: the server restarted or failed over and kept the data. Counted as `kept`.
A replica's first check only learns the current token and run_id (it cannot know what came before it), so every
ingress replica that was running counts an event once. A failed check (Redis down) is skipped: the rate limiter
counts and reports outages (`ocr_ratelimit_backend_errors_total`); the check after Redis is back sees the change.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable, Literal

log = logging.getLogger(__name__)

MARKER_KEY = "ocr:state"
CHECK_TIMEOUT_S = 1.0

StateChange = Literal["lost", "kept"]
StateChangeHook = Callable[[str], None]


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class RedisStateWatch:
    def __init__(self, client, *, interval_s: float, marker_key: str = MARKER_KEY,
                 on_change: StateChangeHook | None = None):
        self._client = client
        self.interval_s = interval_s
        self.marker_key = marker_key
        self.on_change = on_change
        self.changes: dict[str, int] = {"lost": 0, "kept": 0}
        self._token: str | None = None  # marker token at the last check
        self._run_id: str | None = None  # Redis server run_id at the last check
        self._task: asyncio.Task | None = None

    async def check(self) -> StateChange | None:
        """One look at Redis; returns what changed since the last look (None: nothing, or the first look)."""
        run_id = _text((await self._client.info("server")).get("run_id"))
        token = _text(await self._client.get(self.marker_key))
        change: StateChange | None = None
        if token is None:
            await self._client.set(self.marker_key, uuid.uuid4().hex, nx=True)
            token = _text(await self._client.get(self.marker_key))
            if self._token is not None:
                change = "lost"
        elif self._token is not None and token != self._token:
            change = "lost"
        elif self._run_id is not None and run_id != self._run_id:
            change = "kept"
        self._token, self._run_id = token, run_id
        if change is not None:
            self._record(change)
        return change

    def _record(self, change: StateChange) -> None:
        self.changes[change] += 1
        if change == "lost":
            log.warning("Redis lost the service's state (restart or failover without the data, flush or eviction): "
                        "rate-limit buckets start full again; running jobs of this replica are marked failed "
                        "`job_lost` at their next heartbeat")
        else:
            log.warning("Redis restarted or failed over (new server run_id); the service's state was kept")
        if self.on_change is not None:
            try:
                self.on_change(change)
            except Exception:  # a metrics hook must never stop the watch
                log.exception("Redis state watch: on_change hook failed")

    def start(self) -> None:
        """Check every `interval_s` from a task of the running event loop until `close()`."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="redis-state-watch")

    async def _loop(self) -> None:
        while True:
            try:
                await self.check()  # each call bounded by the client's socket timeout
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or slow: the limiter reports outages; look again next time
                log.debug("Redis state check failed: %s", type(exc).__name__)
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._client.aclose()


def make_redis_state_watch(settings, on_change: StateChangeHook | None = None) -> RedisStateWatch | None:
    """The watch of the Redis the settings name (None without Redis: in-process state cannot be lost apart from
    the process)."""
    if settings.redis.url is None:
        return None
    from service.admission.ratelimit import make_redis_client

    return RedisStateWatch(make_redis_client(settings.redis.url.get_secret_value(), CHECK_TIMEOUT_S),
                           interval_s=settings.redis.state_check_interval_s, on_change=on_change)
