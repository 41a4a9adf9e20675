"""Fair, bounded sharing of scarce slots between tenants, and the ingress's admission pool built on it.

`FairSlots`: `capacity` slots; one tenant holds at most `per_tenant` of them, and when a slot frees it goes to the
next tenant in turn that has someone waiting (round robin over tenants, first come first served within a tenant).
At most `max_waiting` waiters per tenant: beyond that, 503 `overloaded` at once instead of a queue without end.
The job page scheduler (service/jobs/runner.py) uses it for job pages at the engines.

`WorkPool`: every image decode and PDF sandbox call of the ingress runs here, never on asyncio's default executor
(which `asyncio.to_thread` shares with everything else in the process): a flood of heavy documents from one tenant
fills that tenant's share of the threads and its own queue, and other tenants' work is taken in turn.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from service.errors import OCRError

T = TypeVar("T")


class FairSlots:
    def __init__(self, capacity: int, per_tenant: int | None = None, max_waiting: int | None = None,
                 what: str = "slots"):
        self.capacity = capacity
        self.per_tenant = min(capacity, per_tenant or capacity)
        self.max_waiting = max_waiting  # per tenant; None = unbounded
        self.what = what  # for the 503's message
        self.free = capacity
        self.held: collections.Counter[str] = collections.Counter()
        self._waiting: dict[str, collections.deque[asyncio.Future]] = {}
        self._turns: collections.deque[str] = collections.deque()  # tenants with waiters, next one first

    def waiting(self, tenant: str | None = None) -> int:
        if tenant is not None:
            return len(self._waiting.get(tenant, ()))
        return sum(len(q) for q in self._waiting.values())

    def _may_take(self, tenant: str) -> bool:
        return self.free > 0 and self.held[tenant] < self.per_tenant

    async def acquire(self, tenant: str) -> None:
        if self._may_take(tenant) and not self._waiting.get(tenant):
            self._take(tenant)
            return
        queue = self._waiting.setdefault(tenant, collections.deque())
        if self.max_waiting is not None and len(queue) >= self.max_waiting:
            if not queue:
                del self._waiting[tenant]
            raise OCRError("overloaded", f"too much of this tenant's work is waiting for {self.what}; retry later",
                           headers={"Retry-After": "1"})
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        if tenant not in self._turns:
            self._turns.append(tenant)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # granted just as we were cancelled: pass it on
                self.release(tenant)
            else:
                self._forget(tenant, waiter)
            raise

    def release(self, tenant: str) -> None:
        self.free += 1
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        self._grant()

    def _take(self, tenant: str) -> None:
        self.free -= 1
        self.held[tenant] += 1

    def _grant(self) -> None:
        """Free slots to waiting tenants in turn: the first tenant in the rotation that may take one gets it and
        goes to the back; until no slot is free or no waiting tenant may take one."""
        idle = 0  # tenants visited since the last grant
        while self.free > 0 and self._turns and idle < len(self._turns):
            tenant = self._turns[0]
            self._turns.rotate(-1)
            queue = self._waiting.get(tenant)
            if not queue:
                self._drop_turn(tenant)
                continue
            if not self._may_take(tenant):
                idle += 1
                continue
            self._take(tenant)
            queue.popleft().set_result(None)
            idle = 0
            if not queue:
                del self._waiting[tenant]
                self._drop_turn(tenant)

    def _forget(self, tenant: str, waiter: asyncio.Future) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[tenant]
                self._drop_turn(tenant)

    def _drop_turn(self, tenant: str) -> None:
        try:
            self._turns.remove(tenant)
        except ValueError:
            pass


class WorkPool:
    """Blocking work (decode, PDF sandbox) on `threads` threads of its own, shared fairly between tenants. A call
    holds its slot until its thread has finished, even when the awaiting request was cancelled (a client that went
    away): the thread count is never exceeded."""

    def __init__(self, threads: int, per_tenant: int, max_waiting: int):
        self.slots = FairSlots(threads, per_tenant, max_waiting, what="the ingress's image and PDF work")
        self._executor: ThreadPoolExecutor | None = None  # threads start on first use
        self._threads = threads

    @classmethod
    def for_settings(cls, settings, one_tenant: bool = False) -> "WorkPool":
        per_tenant = settings.limits.admission_threads if one_tenant else settings.limits.admission_threads_per_tenant
        return cls(settings.limits.admission_threads, per_tenant, settings.limits.admission_queue_per_tenant)

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        await self.slots.acquire(tenant)
        loop = asyncio.get_running_loop()
        try:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="ocr-admission")
            future = self._executor.submit(functools.partial(fn, *args, **kwargs))
        except BaseException:
            self.slots.release(tenant)
            raise
        def finished(_) -> None:
            try:
                loop.call_soon_threadsafe(self.slots.release, tenant)
            except RuntimeError:  # the loop is closed: the replica is going away
                pass

        future.add_done_callback(finished)
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
