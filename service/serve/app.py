"""The Ray Serve application: a CPU ingress deployment (HTTP, validation, image decode) in front of an engine
deployment (one engine per replica; one GPU per replica for vLLM), or, with `serve_topology: colocated`, one
deployment whose replicas do both in one process. `build_app(settings)` is the single builder used by the CLI, the
tests and the Helm chart's `serveConfigV2` (`import_path: service.serve.app:app_builder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.config import AutoscalingPolicy
from ray.serve.handle import DeploymentHandle

from service.http.app import create_app, cut_requests
from service.pipeline.context import AppContext
from service.engine import make_engine
from service.engine.protocol import EngineDelta, EngineInfo, EngineRequest, EngineResult
from service.errors import OCRError
from service.observability.metrics import EngineMetrics, IngressMetrics
from service.serve.autoscaling import POLICY_IMPORT_PATH, LatencyWindow
from service.serve.edge import bind_replica_grpc_to_node_ip
from service.serve.replica_logs import route_to_replica_log
from service.config import Settings

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "OCREngine"
INGRESS_DEPLOYMENT = "OCRIngress"
COLOCATED_DEPLOYMENT = "OCRService"  # serve_topology: colocated (HTTP and engine in each replica)
# the deployments that answer HTTP (one per topology; the CLI's drain calls whichever the app has)
HTTP_DEPLOYMENTS = (INGRESS_DEPLOYMENT, COLOCATED_DEPLOYMENT)
# colocated replicas also answer /readyz, /metrics and the like: room for those beside the engine's requests
COLOCATED_HTTP_HEADROOM = 64
# max_queued_requests -1 (unbounded) in a colocated replica: Serve needs a number for the replica's own limit
COLOCATED_UNBOUNDED_QUEUE = 100_000


class EngineDeployment:
    """Holds one engine. Serve calls `check_health` periodically; a failure (e.g. a dead vLLM engine) makes Serve
    replace the replica."""

    async def __init__(self, settings: dict[str, Any]):
        bind_replica_grpc_to_node_ip()
        self.settings = Settings.model_validate(settings)
        route_to_replica_log(self.settings.log_level)
        self.engine = make_engine(self.settings)
        # request latencies for the autoscaler's latency rule (service/serve/autoscaling.py)
        self.latency = LatencyWindow(window_s=self.settings.autoscaling_look_back_s)
        self.metrics = EngineMetrics.for_settings(self.settings)  # ocr_engine_* of this replica
        await self.engine.start()
        self.metrics.healthy(True)
        # LoRA adapters through Serve model multiplexing: requests for an adapter are routed to replicas that hold
        # it; past max_adapters_per_replica, Serve evicts the least recently used one (its slot frees vLLM's)
        self._adapter_slot = serve.multiplexed(max_num_models_per_replica=self.settings.max_adapters_per_replica)(
            self._adapter_loader())

    def _adapter_loader(self):
        engine, loop = self.engine, asyncio.get_running_loop()

        async def load_adapter_slot(name: str) -> AdapterSlot:
            await engine.load_adapter(name)
            return AdapterSlot(engine, name, loop)

        return load_adapter_slot

    async def _hold_adapter(self, adapter: str | None) -> None:
        """Make this replica hold the adapter (loads it, LRU bookkeeping, reports it to Serve's router)."""
        if adapter:
            if adapter not in await self.engine.list_adapters():  # before Serve's loader, which logs failures
                raise OCRError("unknown_adapter", f"adapter {adapter!r} does not exist")
            await self._adapter_slot(adapter)

    async def generate(self, request: EngineRequest) -> EngineResult:
        with self.latency.track(), self.metrics.ongoing(), \
                self.metrics.adapter_use(request.adapter, self._has_loaded(request.adapter)):
            await self._hold_adapter(request.adapter)
            return await self.engine.generate(request)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        with self.latency.track(), self.metrics.ongoing(), \
                self.metrics.adapter_use(request.adapter, self._has_loaded(request.adapter)):
            await self._hold_adapter(request.adapter)
            async for delta in self.engine.stream(request):
                yield delta

    def _has_loaded(self, adapter: str | None) -> bool:
        """Whether the engine holds this adapter already (engines with LoRA slots expose `loaded_adapters`)."""
        loaded = getattr(self.engine, "loaded_adapters", None)
        return bool(adapter) and loaded is not None and adapter in loaded()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics Serve pushes to the controller (p95 latency over the look-back window)."""
        return self.latency.stats()

    async def check_health(self) -> None:
        try:
            await self.engine.check_health()
        except BaseException:
            self.metrics.healthy(False)
            raise
        self.metrics.healthy(True)

    async def info(self) -> EngineInfo:
        return await self.engine.info()

    async def list_adapters(self) -> list[str]:
        return await self.engine.list_adapters()

    async def load_adapter(self, name: str, path: str | None = None) -> None:
        with self.metrics.adapter_use(name, self._has_loaded(name)):
            await self.engine.load_adapter(name, path)
            await self._hold_adapter(name)

    async def adapter_status(self) -> list[dict[str, Any]]:
        """[{name, loaded}] of this replica (engines without LoRA slots: everything listed counts as loaded)."""
        status = getattr(self.engine, "adapter_status", None)
        if status is not None:
            return await status()
        return [{"name": name, "loaded": True} for name in await self.engine.list_adapters()]

    async def unload_adapter(self, name: str) -> None:
        await self.engine.unload_adapter(name)

    async def __del__(self):  # Serve calls it on graceful replica shutdown
        self.metrics.close()
        try:
            await self.engine.shutdown()
        except Exception:  # best effort: the process is going away
            pass


class AdapterSlot:
    """What Serve's multiplexing cache holds per adapter. Serve calls `__del__` when it evicts the adapter (LRU);
    that frees the engine's slot. Sync on purpose: Serve runs it in a thread, and garbage collection may run it too
    (an async `__del__` would leave an un-awaited coroutine there)."""

    def __init__(self, engine, name: str, loop: asyncio.AbstractEventLoop):
        self.engine, self.name, self._loop = engine, name, loop
        self._released = False

    def __del__(self):
        if self._released:
            return
        self._released = True
        try:
            asyncio.run_coroutine_threadsafe(self._unload(), self._loop)
        except RuntimeError:  # loop closed: the replica is gone anyway
            pass

    async def _unload(self) -> None:
        try:
            await self.engine.unload_adapter(self.name)
        except OCRError:  # already unloaded (admin) or never existed
            pass


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


class HttpReplica:
    """What a replica that answers HTTP has, in either topology: the FastAPI app around `self.ctx`, and drain."""

    ctx: AppContext

    def __serve_build_asgi_app__(self):
        return create_app(self.ctx)

    async def drain(self, cut: bool = False) -> dict[str, Any]:
        """Start draining this replica (readiness fails, new work gets 503 `shutting_down`); called through a
        handle by `ocr-serve serve` on SIGTERM, and repeatedly to watch the in-flight count reach 0. With `cut`
        (the drain's deadline) every request still open is ended: 503 `shutting_down` with Retry-After, or a last
        error event on a stream (service/http/app.py DrainGate)."""
        self.ctx.draining = True
        ended = cut_requests(self.ctx) if cut else 0
        return {"replica": serve.get_replica_context().replica_id.unique_id, "in_flight": self.ctx.in_flight,
                "open": len(self.ctx.open_requests), "cut": ended}


@serve.ingress()
class IngressDeployment(HttpReplica):
    """HTTP ingress: builds the FastAPI app around a handle to the engine deployment."""

    def __init__(self, engine: DeploymentHandle, settings: dict[str, Any]):
        bind_replica_grpc_to_node_ip()
        self.settings = Settings.model_validate(settings)
        route_to_replica_log(self.settings.log_level)
        self.ctx = build_context(self.settings, ServeEngineClient(engine))


class EngineGate:
    """In a colocated replica, what Serve's router does in front of split engine replicas: at most `ongoing`
    requests in the engine at once, at most `queued` more waiting (-1 = no limit), and past that `overloaded` at
    once (503 with Retry-After) instead of a queue that grows without end."""

    def __init__(self, ongoing: int, queued: int):
        self._slots = asyncio.Semaphore(ongoing)
        self._queued_limit = queued
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def admit(self):
        if self._slots.locked() and 0 <= self._queued_limit <= self.waiting:
            raise overloaded(1)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._slots.release()


@serve.ingress()
class ColocatedDeployment(HttpReplica, EngineDeployment):
    """`serve_topology: colocated`: the HTTP API and the engine in one replica process. The API calls the engine
    side of this same object (EngineDeployment's methods are the EngineClient interface), so a request meets no
    Serve hop, no pickling and no second event loop between admission and the engine (docs/DEPLOY.md)."""

    async def __init__(self, settings: dict[str, Any]):
        await EngineDeployment.__init__(self, settings)
        self._gate = EngineGate(self.settings.max_ongoing_requests, self.settings.max_queued_requests)
        self.ctx = build_context(self.settings, self)

    async def generate(self, request: EngineRequest) -> EngineResult:
        async with self._gate.admit():
            return await EngineDeployment.generate(self, request)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        async with self._gate.admit():
            async for delta in EngineDeployment.stream(self, request):
                yield delta


def build_context(settings: Settings, engine_client) -> AppContext:
    """AppContext with the admission components the settings ask for."""
    from service.admission.auth import make_authenticator
    from service.admission.ratelimit import make_limiter
    from service.admission.redis_state import make_redis_state_watch

    metrics = IngressMetrics.for_settings(settings)
    # limiter: Redis buckets (with failover) when redis_url is set, else this replica's share in-process;
    # Redis failures are counted as `ocr_ratelimit_backend_errors_total`, Redis restarts and state losses as
    # `ocr_redis_resets_total`
    return AppContext(settings=settings, engine=engine_client, authenticator=make_authenticator(settings),
                      limiter=make_limiter(settings, on_backend_error=metrics.limiter_backend_error),
                      redis_watch=make_redis_state_watch(settings, on_change=metrics.redis_state_changed),
                      metrics=metrics)


def engine_deployment_options(settings: Settings) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {
        "min_replicas": settings.min_replicas,
        "max_replicas": settings.max_replicas,
        "target_ongoing_requests": settings.target_ongoing_requests,
        "upscale_delay_s": settings.upscale_delay_s,
        "downscale_delay_s": settings.downscale_delay_s,
        "look_back_period_s": settings.autoscaling_look_back_s,
    }
    if settings.autoscaling_metrics_interval_s != 10.0:  # Serve warns on any explicit value (field is deprecated)
        autoscaling["metrics_interval_s"] = settings.autoscaling_metrics_interval_s
    if settings.initial_replicas is not None:
        autoscaling["initial_replicas"] = settings.initial_replicas
    if settings.latency_target_ms is not None:  # queue-depth rule + latency rule
        autoscaling["policy"] = AutoscalingPolicy(
            policy_function=POLICY_IMPORT_PATH,
            policy_kwargs={"latency_target_ms": settings.latency_target_ms,
                           "latency_downscale_ratio": settings.latency_downscale_ratio},
        )
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": settings.engine_num_cpus, "num_gpus": settings.resolved_engine_num_gpus},
        "max_ongoing_requests": settings.max_ongoing_requests,
        "max_queued_requests": settings.max_queued_requests,
        "health_check_period_s": settings.health_check_period_s,
        "health_check_timeout_s": settings.health_check_timeout_s,
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": settings.graceful_shutdown_wait_loop_s,
    }
    if settings.min_replicas == settings.max_replicas:
        options["num_replicas"] = settings.min_replicas
    else:
        options["autoscaling_config"] = autoscaling
    return options


def colocated_deployment_options(settings: Settings) -> dict[str, Any]:
    """The engine deployment's options (replicas, autoscaling, GPU, CPUs, health checks) for replicas that also
    answer HTTP. engine_num_cpus covers the one process, so a GPU worker that advertises exactly that (the Helm
    chart's) still fits it. Serve's limit per replica covers the engine's requests, those waiting at its EngineGate
    and the probes; the queue is the gate's, so Serve's own (which answers without our error body) stays unbounded."""
    options = engine_deployment_options(settings)
    queued = settings.max_queued_requests if settings.max_queued_requests >= 0 else COLOCATED_UNBOUNDED_QUEUE
    options.update(name=COLOCATED_DEPLOYMENT, max_queued_requests=-1,
                   max_ongoing_requests=settings.max_ongoing_requests + queued + COLOCATED_HTTP_HEADROOM)
    return options


def build_app(settings: Settings) -> serve.Application:
    """The whole application, ready for `serve.run`."""
    plain = settings.model_dump(mode="python")
    if settings.serve_topology == "colocated":
        return serve.deployment(ColocatedDeployment, **colocated_deployment_options(settings)).bind(plain)
    engine = serve.deployment(EngineDeployment, **engine_deployment_options(settings)).bind(plain)
    ingress = serve.deployment(
        IngressDeployment,
        name=INGRESS_DEPLOYMENT,
        num_replicas=settings.ingress_replicas,
        ray_actor_options={"num_cpus": settings.ingress_num_cpus},
        max_ongoing_requests=max(64, settings.max_ongoing_requests * settings.max_replicas * 2),
        # a client waits on its ingress replica: it gets the same time to finish as the engine's
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=settings.graceful_shutdown_wait_loop_s,
    )
    return ingress.bind(engine, plain)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve config entry point (`import_path: service.serve.app:app_builder`): `args` are settings field values
    (the Helm chart renders them from values.yaml); OCR_* environment variables fill the rest."""
    return build_app(Settings(**(args or {})))
