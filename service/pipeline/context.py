"""What the API layer needs at run time, passed explicitly (no module-level state)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from service.admission.auth import Authenticator, OpenAuthenticator, make_authenticator
from service.admission.ratelimit import LocalTokenBucket, Limiter, make_limiter
from service.admission.redis_state import RedisStateWatch, make_redis_state_watch
from service.admission.workpool import WorkPool
from service.engine.protocol import EngineDelta, EngineInfo, EngineRequest, EngineResult
from service.observability.metrics import IngressMetrics
from service.config import Settings

log = logging.getLogger(__name__)


class EngineClient(Protocol):
    """How the ingress reaches engine replicas: a Serve handle in production, the engine itself in unit tests."""

    async def generate(self, request: EngineRequest) -> EngineResult: ...

    def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]: ...

    async def info(self) -> EngineInfo: ...

    async def check_health(self) -> None: ...

    async def list_adapters(self) -> list[str]: ...

    async def load_adapter(self, name: str, path: str | None = None) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...


@dataclass
class AppContext:
    settings: Settings
    engine: EngineClient
    authenticator: Authenticator = field(default_factory=OpenAuthenticator)
    limiter: Limiter = field(default_factory=LocalTokenBucket)
    redis_watch: RedisStateWatch | None = None  # notices Redis restarts and state loss; runs while the app does
    engine_info: EngineInfo | None = None
    draining: bool = False  # set on SIGTERM: readiness fails, new work is refused
    in_flight: int = 0  # HTTP requests admitted and not yet answered (drain waits for 0)
    open_requests: set[asyncio.Task] = field(default_factory=set)  # every HTTP request's task (the drain's cut)
    metrics: IngressMetrics = field(default_factory=IngressMetrics)  # off unless built for a Ray replica
    # every image decode and PDF sandbox call, shared fairly between tenants (service/admission/workpool.py)
    work_pool: WorkPool = field(init=False)

    def __post_init__(self) -> None:
        # without API keys everyone is one tenant: a share of the threads would only idle the rest
        self.work_pool = WorkPool.for_settings(self.settings,
                                               one_tenant=getattr(self.authenticator, "open_mode", False))

    async def get_engine_info(self) -> EngineInfo:
        if self.engine_info is None:
            info = await self.engine.info()
            if self.settings.engine.presize and info.image_processor is not None:
                try:
                    from service.admission.presize import check_available

                    check_available(info.image_processor.backend)
                except ImportError as exc:  # the engine still resizes: same answers, its CPU instead of ours
                    log.warning("engine_image_presize is on but this ingress cannot resize like the engine's "
                                "processor (%s); the engine resizes", exc)
                    info = info.model_copy(update={"image_processor": None})
            self.engine_info = info
            self.metrics.adapters_known(info.adapters)
        return self.engine_info


def build_context(settings: Settings, engine_client: EngineClient) -> AppContext:
    """AppContext with the admission components the settings ask for."""
    metrics = IngressMetrics.for_settings(settings)
    # limiter: Redis buckets (with failover) when redis_url is set, else this replica's share in-process;
    # Redis failures are counted as `ocr_ratelimit_backend_errors_total`, decisions without Redis show in
    # `ocr_ratelimit_fallback`, Redis restarts and state losses in `ocr_redis_resets_total`; the key file's tenants
    # (at start and at each reload) get their label sets at 0
    return AppContext(settings=settings, engine=engine_client,
                      authenticator=make_authenticator(settings, on_tenants=metrics.tenants_known),
                      limiter=make_limiter(settings, on_backend_error=metrics.limiter_backend_error,
                                           on_fallback=metrics.limiter_fallback),
                      redis_watch=make_redis_state_watch(settings, on_change=metrics.redis_state_changed),
                      metrics=metrics)
