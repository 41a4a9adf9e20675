"""The Serve deployments: `EngineDeployment` (one engine per replica), `IngressDeployment` (the HTTP app in front
of a handle to the engine deployment) and `ColocatedDeployment` (both in one replica, `serve_topology: colocated`).
Their options are set by service/serve/app.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.handle import DeploymentHandle

from service.config import Settings
from service.engine import make_engine
from service.engine.protocol import EngineDelta, EngineInfo, EngineRequest, EngineResult
from service.errors import OCRError
from service.http.app import create_app
from service.http.middleware import cut_requests
from service.observability.metrics import EngineMetrics
from service.pipeline.context import AppContext, build_context
from service.serve.autoscaling import LatencyWindow
from service.serve.client import ServeEngineClient, overloaded
from service.serve.edge import bind_replica_grpc_to_node_ip
from service.serve.replica_logs import route_to_replica_log

log = logging.getLogger(__name__)


class EngineDeployment:
    """Holds one engine. Serve calls `check_health` periodically; a failure (e.g. a dead vLLM engine) makes Serve
    replace the replica."""

    async def __init__(self, settings: dict[str, Any]):
        bind_replica_grpc_to_node_ip()
        self.settings = Settings.model_validate(settings)
        route_to_replica_log(self.settings.server.log_level)
        self.engine = make_engine(self.settings)
        # request latencies for the autoscaler's latency rule (service/serve/autoscaling.py)
        self.latency = LatencyWindow(window_s=self.settings.serve.autoscaling()["look_back_period_s"])
        self.metrics = EngineMetrics.for_settings(self.settings)  # ocr_engine_* of this replica
        await self.engine.start()
        self.metrics.adapters_known(await self.engine.list_adapters())
        self.metrics.healthy(True)
        # LoRA adapters through Serve model multiplexing: requests for an adapter are routed to replicas that hold
        # it; past max_adapters_per_replica, Serve evicts the least recently used one (its slot frees vLLM's)
        self._adapter_slot = serve.multiplexed(max_num_models_per_replica=self.settings.engine.lora.max_adapters_per_replica)(
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


class ProxyCancelAsDisconnect:
    """A client that closes while its body is still being read: Serve's proxy cancels the task that feeds this
    replica the body, and the replica's `receive()` raises TaskCancelledError where an ASGI server would return
    `http.disconnect`. Here it returns that, so the app counts a 499 `client_disconnected`, not a 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect if scope["type"] == "http" else receive, send)


class HttpReplica:
    """What a replica that answers HTTP has, in either topology: the FastAPI app around `self.ctx`, and drain."""

    ctx: AppContext

    def __serve_build_asgi_app__(self):
        app = create_app(self.ctx)
        app.add_middleware(ProxyCancelAsDisconnect)  # outermost of ours: every layer sees the disconnect
        return app

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
        route_to_replica_log(self.settings.server.log_level)
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
        options = self.settings.engine_deployment
        self._gate = EngineGate(options["max_ongoing_requests"], options["max_queued_requests"])
        self.ctx = build_context(self.settings, self)

    async def generate(self, request: EngineRequest) -> EngineResult:
        async with self._gate.admit():
            return await EngineDeployment.generate(self, request)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        async with self._gate.admit():
            async for delta in EngineDeployment.stream(self, request):
                yield delta
