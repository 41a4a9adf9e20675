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
