"""Token-bucket rate limiting per tenant. `LocalTokenBucket` is the in-process bucket (no Redis configured)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Decision:
    allowed: bool
    limit: float  # bucket size (burst)
    remaining: float  # tokens left after this decision
    reset_s: float  # seconds until the bucket is full again
    retry_after_s: float  # seconds until `cost` tokens are available (0 when allowed)

    def headers(self) -> dict[str, str]:
        out = {
            "RateLimit-Limit": str(int(self.limit)),
            "RateLimit-Remaining": str(max(0, int(self.remaining))),
            "RateLimit-Reset": str(max(0, math.ceil(self.reset_s))),
        }
        if not self.allowed:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


class Limiter(Protocol):
    async def acquire(self, tenant: str, cost: float, rate: float, burst: float) -> Decision: ...

    async def close(self) -> None: ...


class LocalTokenBucket:
    """In-process buckets; exact for one process, `rate` is divided by the replica count by the caller."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill time)

    async def acquire(self, tenant: str, cost: float, rate: float, burst: float) -> Decision:
        return self.acquire_sync(tenant, cost, rate, burst)

    def acquire_sync(self, tenant: str, cost: float, rate: float, burst: float) -> Decision:
        now = self._clock()
        tokens, last = self._buckets.get(tenant, (burst, now))
        tokens = min(burst, tokens + (now - last) * rate)
        if cost <= tokens:
            tokens -= cost
            self._buckets[tenant] = (tokens, now)
            return Decision(True, burst, tokens, (burst - tokens) / rate, 0.0)
        self._buckets[tenant] = (tokens, now)
        return Decision(False, burst, tokens, (burst - tokens) / rate, (cost - tokens) / rate)

    async def close(self) -> None:
        return None
