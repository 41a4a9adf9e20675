"""The Ray Serve application: a CPU ingress deployment (HTTP, validation, image decode) in front of an engine
deployment (one engine per replica; one GPU per replica for vLLM), or, with `serve_topology: colocated`, one
deployment whose replicas do both in one process. `build_app(settings)` is the single builder used by the CLI, the
tests and the Helm chart's `serveConfigV2` (`import_path: service.serve.app:app_builder`).
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingPolicy

from service.config import Settings
from service.serve.autoscaling import POLICY_IMPORT_PATH
from service.serve.deployments import ColocatedDeployment, EngineDeployment, IngressDeployment

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


def engine_deployment_options(settings: Settings) -> dict[str, Any]:
    """The engine deployment's Serve options (config.ServeConfig.engine_options: the product's defaults, the GPU the
    engine needs, `engine_deployment` on top), with the latency rule as its autoscaling policy when set."""
    options = {"name": ENGINE_DEPLOYMENT, **settings.engine_deployment}
    scaling = options.get("autoscaling_config")
    if scaling is not None and settings.serve.latency_target_ms is not None:  # queue-depth rule + latency rule
        options["autoscaling_config"] = {**scaling, "policy": AutoscalingPolicy(
            policy_function=POLICY_IMPORT_PATH,
            policy_kwargs={"latency_target_ms": settings.serve.latency_target_ms,
                           "latency_downscale_ratio": settings.serve.latency_downscale_ratio})}
    return options


def colocated_deployment_options(settings: Settings) -> dict[str, Any]:
    """The engine deployment's options (replicas, autoscaling, GPU, CPUs, health checks) for replicas that also
    answer HTTP. Its CPUs cover the one process, so a GPU worker that advertises exactly that (the Helm chart's)
    still fits it. Serve's limit per replica covers the engine's requests, those waiting at its EngineGate and the
    probes; the queue is the gate's, so Serve's own (which answers without our error body) stays unbounded."""
    options = engine_deployment_options(settings)
    queued = options["max_queued_requests"]
    queued = queued if queued >= 0 else COLOCATED_UNBOUNDED_QUEUE
    options.update(name=COLOCATED_DEPLOYMENT, max_queued_requests=-1,
                   max_ongoing_requests=options["max_ongoing_requests"] + queued + COLOCATED_HTTP_HEADROOM)
    return options


def ingress_deployment_options(settings: Settings) -> dict[str, Any]:
    """The ingress deployment's options: room for every request the engines can hold (twice over) by default,
    `ingress_deployment` on top. A client waits on its ingress replica: it gets the engine's time to finish."""
    _, most = settings.serve.engine_replicas(settings.engine.kind)
    room = max(64, settings.engine_deployment["max_ongoing_requests"] * most * 2)
    return {"name": INGRESS_DEPLOYMENT, "max_ongoing_requests": room, **settings.serve.ingress_options()}


def build_app(settings: Settings) -> serve.Application:
    """The whole application, ready for `serve.run`."""
    plain = settings.model_dump(mode="python")
    if settings.serve.topology == "colocated":
        return serve.deployment(ColocatedDeployment, **colocated_deployment_options(settings)).bind(plain)
    engine = serve.deployment(EngineDeployment, **engine_deployment_options(settings)).bind(plain)
    return serve.deployment(IngressDeployment, **ingress_deployment_options(settings)).bind(engine, plain)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve config entry point (`import_path: service.serve.app:app_builder`): `args` are settings by flat name
    (the Helm chart renders them from values.yaml's `settings:`); OCR_* environment variables fill the rest."""
    return build_app(Settings(**(args or {})))
