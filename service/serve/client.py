"""How the ingress reaches the engine deployment: `ServeEngineClient` (the pipeline's EngineClient over a Serve
deployment handle; LoRA adapters route through Serve's model multiplexing), and Ray/Serve failures mapped to stable
API errors."""

from __future__ import annotations

import logging
import math
from typing import Any, AsyncIterator

from ray.serve.handle import DeploymentHandle

from service.engine.protocol import EngineDelta, EngineInfo, EngineRequest, EngineResult
from service.errors import OCRError

log = logging.getLogger(__name__)


def overloaded(retry_after_s: float) -> OCRError:
    """503 `overloaded`: the engines' queue is full (Serve's router in the split topology, EngineGate colocated)."""
    return OCRError("overloaded", "all engine replicas are busy; retry later",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def translate_engine_error(exc: BaseException) -> OCRError | None:
    """Map Ray/Serve failures to stable API errors (None = not a known engine-side failure)."""
    if isinstance(exc, OCRError):
        return exc
    name = type(exc).__name__
    if "BackPressureError" in name:  # max_queued_requests reached: answer at once instead of queueing further
        return overloaded(getattr(exc, "retry_after_s", None) or 1)
    if any(k in name for k in ("ActorDiedError", "ActorUnavailableError", "RayActorError", "EngineDeadError",
                               "DeploymentUnavailableError")):
        return OCRError("engine_unavailable", "the engine replica is unavailable; retry later",
                        headers={"Retry-After": "1"})
    return None


def replica_died(exc: BaseException) -> bool:
    """The engine replica's process died (or became unreachable) under the request: safe to retry elsewhere.
    A dead engine inside a live replica (vLLM EngineDeadError) is not retried: the request may be what killed it."""
    from ray.exceptions import RayActorError  # ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(exc, (RayActorError, ReplicaUnavailableError))


class ServeEngineClient:
    """EngineClient over a Serve deployment handle; adapters route through Serve model multiplexing."""

    def __init__(self, handle: DeploymentHandle):
        self._handle = handle

    def _for(self, request: EngineRequest) -> DeploymentHandle:
        if request.adapter:
            return self._handle.options(multiplexed_model_id=request.adapter)
        return self._handle

    @staticmethod
    def _retry_or_raise(exc: Exception, attempt: int, request_id: str, *, may_retry: bool) -> None:
        """Return (= retry once) when the replica's process died under the first attempt: OCR is idempotent and the
        router has dropped the dead replica, so the retry goes to another one. Otherwise raise the stable API error
        (or the original exception when it is not a known engine-side failure)."""
        if attempt == 1 and may_retry and replica_died(exc):
            log.warning("engine replica died under request %s (%s); retrying once", request_id, type(exc).__name__)
            return
        err = translate_engine_error(exc)
        if err is None:
            raise exc
        raise err from None

    async def generate(self, request: EngineRequest) -> EngineResult:
        for attempt in (1, 2):
            try:
                return await self._for(request).generate.remote(request)
            except Exception as exc:
                self._retry_or_raise(exc, attempt, request.request_id, may_retry=True)
        raise AssertionError("unreachable")

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        for attempt in (1, 2):
            yielded = False
            try:
                gen = self._for(request).options(stream=True).stream.remote(request)
                async for delta in gen:
                    yielded = True
                    yield delta
                return
            except Exception as exc:  # retry only while nothing was sent
                self._retry_or_raise(exc, attempt, request.request_id, may_retry=not yielded)

    async def info(self) -> EngineInfo:
        return await self._handle.info.remote()

    async def check_health(self) -> None:
        await self._handle.check_health.remote()

    async def list_adapters(self) -> list[str]:
        return await self._handle.list_adapters.remote()

    async def load_adapter(self, name: str, path: str | None = None) -> None:
        await self._handle.load_adapter.remote(name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._handle.unload_adapter.remote(name)

    async def adapter_status(self) -> list[dict[str, Any]]:
        return await self._handle.adapter_status.remote()
