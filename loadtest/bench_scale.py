"""Horizontal scale: N engine replicas on N GPUs behind the service's ingress, and autoscaling from one to N (the
method: docs/BENCHMARKS.md, Scale; the CPU model: docs/design/scaling-model.md).

    python -m loadtest bench scale --plan-only                     # what it would run on this machine; starts nothing
    python -m loadtest bench scale --out results/scale             # on a multi-GPU machine: the sweeps
    python -m loadtest bench scale --parts autoscale --out results/scale-auto
    python -m loadtest bench scale --cpu --out results/scale-cpu   # the same on CPU (the test suite runs it)

Parts (`--parts`, in this order): `sweep`, closed-loop blocks per replica count; `nodekill` (`--cpu`), a worker node
killed under load; `autoscale`, a step load on an app autoscaling from 1 to N. Writes OUT/results.json (rewritten as
it goes), OUT/report.md and the Ray nodes' logs in OUT/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path
from typing import Any

from loadtest import run
from loadtest.common import (OFFLINE_ENV, BenchRecord, ManagedProcess, add_options, bench_kit, cpu_seconds,
                             cpu_snapshot, fill_defaults, fmt, free_port, md_table, new_results, nvidia_smi, plan_text,
                             report_head, session_members, throughput, with_repo_path)
from loadtest.documents import ID_CARD_FIELDS, make_documents

# ID card ≤ 500 ms, A4 page ≤ 3 s p95 (docs/BENCHMARKS.md G1, G2); client levels per replica around one engine's
WORKLOADS = {"id_card": (run.Job("id_card", "extract", 64, ID_CARD_FIELDS), 500.0),
             "a4": (run.Job("a4", "text", 512), 3000.0)}
INGRESS_RESOURCE = "ingress_host"  # only the head node has it: the ingress replicas stay there
# the planner's times (s): cluster up; a deployment's engines up (vLLM cold, then with its compile cache; mock)
CLUSTER_S = {"gpu": 20.0, "cpu": 12.0}
DEPLOY_S = {"gpu_first": 210.0, "gpu": 120.0, "cpu": 10.0}
NODE_KILL_S, STOP_S = 25.0, 20.0
# one engine's expected (latency s at one client, peak docs/s) per workload: the block length's guess (H200, fit)
EXPECTED = {"id_card": (0.2, 45.0), "a4": (1.4, 10.0)}


# --- the plan -------------------------------------------------------------------------------------------------------

def replica_counts(text: str | None, gpus: int) -> list[int]:
    """--replicas, or 1, 2, 4 … up to the GPUs, and the GPUs themselves."""
    if text:
        counts = sorted({int(v) for v in text.split(",") if v.strip()})
    else:
        counts = sorted({2 ** i for i in range(int(math.log2(max(1, gpus))) + 1)} | {max(1, gpus)})
    if not counts or counts[0] < 1 or counts[-1] > gpus:
        raise ValueError(f"replica counts {counts} must lie within 1..{gpus} (the GPUs the cluster has)")
    return counts


def levels(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"client levels {text!r}: positive integers")
    return values


def block_s(args: argparse.Namespace, workload: str, clients_per_replica: int) -> tuple[float, float]:
    """(warm-up, whole block) seconds for a closed-loop block: the warm-up one expected latency, the window at
    least --block-s and four latencies (time-scaled on CPU)."""
    latency_1, peak = EXPECTED[workload]
    latency = max(latency_1, clients_per_replica / peak) * args.time_scale
    warmup = max(args.warmup_s, latency)
    return round(warmup, 1), round(warmup + max(args.block_s, 4 * latency), 1)


def autoscale_phases(args: argparse.Namespace, most: int) -> list[tuple[str, int, float]]:
    """(name, clients, seconds) of the step load: one replica's load, N replicas', one replica's again."""
    per_replica = args.step_clients or levels(args.levels[args.autoscale_workload])[0]
    return [("one", per_replica, args.step_base_s), ("up", per_replica * most, args.step_up_s),
            ("down", per_replica, args.step_down_s)]


def autoscale_most(args: argparse.Namespace, most: int) -> int:
    """Autoscaling's upper bound: the replica counts' largest, less a killed node's GPUs after `nodekill`."""
    return min(most, args.gpus_per_node * (args.worker_nodes - 1)) if "nodekill" in args.parts else most


def settings_for(args: argparse.Namespace, part: str, replicas: int, most: int, kit: str | None = None,
                 gpu_memory_gib: float | None = None) -> dict[str, Any]:
    """The service's settings (flat names) of one deployment: its defaults, the engine (module docstring), n engine
    replicas with one GPU each (or autoscaling from 1 to `most`), the ingress replicas on the head node."""
    engine_deployment: dict[str, Any] = {"ray_actor_options": {"num_gpus": 1}}
    settings: dict[str, Any] = {"bench_fixed_output_tokens": True, "rate_limit_enabled": False}
    if args.cpu:
        settings.update(engine="mock", mock_time_scale=args.time_scale, graceful_shutdown_timeout_s=5)
        # a node's death noticed in seconds, not the product's minute; one engine per node as the chart's
        # engine.maxReplicasPerNode: a node's loss takes one engine, whose replacement finds a node with a free GPU
        engine_deployment.update(health_check_period_s=1.0, health_check_timeout_s=5.0, max_replicas_per_node=1,
                                 ray_actor_options={"num_gpus": 1, "num_cpus": 0.1})
    else:
        from loadtest.bench_gpu import service_settings

        ns = argparse.Namespace(kv_budget_gb=args.kv_budget_gb, tiny=False, engine_arg=[])
        settings.update(service_settings(ns, Path(kit or "MODEL_KIT"), gpu_memory_gib))
    if part == "autoscale":
        quick = {"upscale_delay_s": 1.0, "downscale_delay_s": 4.0, "look_back_period_s": 2.0,
                 "metrics_interval_s": 0.5} if args.cpu else {}
        engine_deployment["autoscaling_config"] = {
            "min_replicas": 1, "max_replicas": most, "initial_replicas": 1,
            "target_ongoing_requests": float(autoscale_phases(args, most)[0][1]), **quick}
        settings["latency_target_ms"] = WORKLOADS[args.autoscale_workload][1] * args.time_scale
    else:
        engine_deployment["num_replicas"] = replicas
    settings.update(engine_deployment=engine_deployment, ingress_deployment={
        "num_replicas": max(1, math.ceil((replicas if part != "autoscale" else most) * args.ingress_per_engine)),
        "ray_actor_options": {"num_cpus": 0.1 if args.cpu else 0.5, "resources": {INGRESS_RESOURCE: 0.001}}})
    return settings


def ray_cli() -> list[str]:
    """Ray's CLI: its `ray` script, or its module where Ray was installed without scripts (`pip --target`)."""
    return ["ray"] if shutil.which("ray") else [sys.executable, "-m", "ray.scripts.scripts"]


NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port", "--runtime-env-agent-port",
              "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port")


def node_commands(args: argparse.Namespace, gpus: int, port: str = "PORT", temp_dir: str = "TEMP_DIR",
                  node_ip: str = "NODE_IP", free=lambda: "FREE_PORT") -> list[list[str]]:
    """`ray start` of the head and of each worker node (--cpu), as run (in the foreground: `--block`). Nodes on one
    machine get ports of their own: raylets starting side by side otherwise bind the same one (and the dashboard
    agent's default port is fixed)."""
    head = [*ray_cli(), "start", "--head", "--block", "--node-ip-address", node_ip, "--port", port,
            "--num-cpus", str(args.head_cpus), "--num-gpus", str(0 if args.cpu else gpus),
            "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir,
            "--resources", json.dumps({INGRESS_RESOURCE: 1})]
    workers = [[*ray_cli(), "start", "--block", "--address", f"{node_ip}:{port}", "--node-ip-address", node_ip,
                "--num-cpus", str(args.worker_cpus), "--num-gpus", str(args.gpus_per_node), "--disable-usage-stats",
                "--resources", json.dumps({f"worker_node_{i}": 1}),
                *(part for flag in NODE_PORTS for part in (flag, str(free())))]
               for i in range(args.worker_nodes if args.cpu else 0)]
    return [head, *workers]


def plan(args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    """Every step of the run and its time, before anything starts; `fits`: within --budget-s."""
    counts = replica_counts(args.replicas, gpus)
    most = counts[-1]
    workloads = [w for w in args.workloads.split(",") if w]
    steps: list[str] = ["cluster: " + " && ".join(shlex.join(c) for c in node_commands(args, gpus)) +
                        f" ({CLUSTER_S['cpu' if args.cpu else 'gpu']:.0f}s)"]
    steps.append("HTTP front end on the head node: " + ("HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1)" if args.haproxy
                                                        else "Serve's proxy actor"))
    total = CLUSTER_S["cpu" if args.cpu else "gpu"]
    deployments: list[dict[str, Any]] = []
    first = True

    def deploy(part: str, replicas: int, upto: int = most) -> None:
        nonlocal total, first
        seconds = DEPLOY_S["cpu"] if args.cpu else DEPLOY_S["gpu_first" if first else "gpu"]
        first = False
        settings = settings_for(args, part, replicas, upto)
        deployments.append({"part": part, "replicas": replicas, "settings": settings})
        engines = f"1 → {upto} engine replicas" if part == "autoscale" else f"{replicas} engine replica(s)"
        steps.append(f"deploy ({part}, {engines}): {json.dumps(settings, sort_keys=True)} ({seconds:.0f}s)")
        total += seconds

    if "sweep" in args.parts:
        for n in counts:
            deploy("sweep", n)
            for w in workloads:
                for level in levels(args.levels[w]):
                    warmup, whole = block_s(args, w, level)
                    steps.append(f"  {w}: closed loop, {n * level} clients ({level} per replica), {whole:g}s "
                                 f"(warm-up {warmup:g}s) × {args.rounds} round(s)")
                    total += (whole + args.cooldown_s) * args.rounds
    if "nodekill" in args.parts:
        if not args.cpu:
            raise ValueError("nodekill needs --cpu (worker nodes of this machine)")
        if "sweep" not in args.parts:
            deploy("sweep", most)
        steps.append(f"nodekill: {most} replica(s) under {most * levels(args.levels[workloads[0]])[0]} clients, "
                     f"worker node killed, load until the replicas are back and {args.after_kill_s:g}s more "
                     f"(~{NODE_KILL_S:.0f}s)")
        total += NODE_KILL_S
    if "autoscale" in args.parts:
        scale_most = autoscale_most(args, most)
        deploy("autoscale", 1, scale_most)
        for name, clients, seconds in autoscale_phases(args, scale_most):
            steps.append(f"  step load {name}: {clients} clients ({args.autoscale_workload}) for {seconds:g}s")
            total += seconds
        total += args.settle_s
    total += STOP_S
    problems = []
    if args.budget_s and total > args.budget_s:
        problems.append(f"{total:.0f}s is over the {args.budget_s:.0f}s budget")
    return {"gpus": gpus, "replica_counts": counts, "workloads": workloads, "deployments": deployments,
            "steps": steps, "total_s": round(total), "budget_s": args.budget_s, "problems": problems,
            "fits": not problems}


# --- the cluster ----------------------------------------------------------------------------------------------------

class Cluster:
    """A Ray cluster of `ray start` processes on this machine, each node in a session of its own (a node is killed
    by killing its session); this process joins it as the driver."""

    def __init__(self, args: argparse.Namespace, gpus: int, out: Path):
        from service.serve.local import ray_node_env

        # every node on this machine's address, the one Ray itself picks (it swaps 127.0.0.1 for it); Ray refuses
        # several nodes on one machine unless told it is meant
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(
                os.path.expanduser("~/.ray/auth_token"))):
            # read when Ray is imported (next line): the driver and every node use this user's token
            os.environ["RAY_AUTH_MODE"] = "token"
        from ray._private.services import get_node_ip_address

        self.node_ip, self.out, self.port = get_node_ip_address(), out, free_port()
        self.address = f"{self.node_ip}:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="ocr-scale-")  # short: Ray's socket paths have a length limit
        # the nodes take RAY_AUTH_MODE and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (set above) too; a loaded 2-core machine
        # starts a raylet slowly
        env = with_repo_path({**{k: v for k, v in os.environ.items() if not k.startswith(("OCR_", "RAY_ADDRESS"))},
                              **ray_node_env(), "RAY_USAGE_STATS_ENABLED": "0", "RAY_raylet_start_wait_time_s": "120"})
        if args.haproxy:  # the chart's HTTP front end, as `ocr-serve serve --engine vllm` runs it
            from service.serve.local import HAPROXY_BINARY_ENV, HAPROXY_PORT_ENV, haproxy_shim

            env.update({key: str(free_port()) for key in HAPROXY_PORT_ENV}, RAY_SERVE_ENABLE_HA_PROXY="1")
            env[HAPROXY_BINARY_ENV] = haproxy_shim()
        if args.cpu:  # a killed node is declared dead within seconds
            env.update(RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="4",
                       RAY_health_check_initial_delay_ms="0")
        else:
            env.update(OFFLINE_ENV)
        self.nodes: list[ManagedProcess] = []
        try:
            for i, cmd in enumerate(node_commands(args, gpus, str(self.port), self.temp_dir, self.node_ip,
                                                  free_port)):
                name = "head" if i == 0 else f"worker_node_{i - 1}"
                self.nodes.append(ManagedProcess(name, cmd, log_path=out / "logs" / f"{name}.log", env=env))
                # one after another: each node registered before the next picks its ports
                self.nodes[-1].wait_for_output("Ray runtime started", 180)
        except BaseException:  # the nodes already up go with the one that failed
            self.stop()
            raise

    def kill(self, name: str) -> None:
        node = next(n for n in self.nodes if n.name == name)
        for pid in [node.pid, *session_members(node.pid)]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop(timeout_s=15)
        # Ray's own logs of the nodes' daemons (raylets, GCS), then the session's folder goes
        for log in Path(self.temp_dir).glob("session_*/logs/*"):
            if log.is_file() and log.name.startswith(("raylet", "gcs_server", "python-core-driver")):
                shutil.copy(log, self.out / "logs" / f"{log.parent.parent.name[-6:]}-{log.name}")
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def actors(class_suffix: str) -> list[dict[str, Any]]:
    """ALIVE actors of Serve's replica class `ServeReplica:ocr:<class_suffix>`: pid and node id."""
    import ray

    name = f"ServeReplica:ocr:{class_suffix}"
    return [{"pid": info.get("Pid"), "node": (info.get("Address") or {}).get("NodeID")}
            for info in ray._private.state.actors().values()
            if info.get("ActorClassName") == name and info.get("State") == "ALIVE"]


def node_names() -> dict[str, str]:
    """Alive node id → `head` or `worker_node_<i>` (the custom resource each node declares)."""
    import ray

    names = {}
    for node in ray.nodes():
        if node.get("Alive"):
            keys = [k for k in node.get("Resources", {}) if k.startswith("worker_node_") or k == INGRESS_RESOURCE]
            names[node["NodeID"]] = "head" if INGRESS_RESOURCE in keys else (keys[0] if keys else "?")
    return names


def placement() -> dict[str, Any]:
    """Where the engine replicas run, and the GPUs the cluster has and has free."""
    import ray

    from service.serve.app import ENGINE_DEPLOYMENT

    names = node_names()
    engines = actors(ENGINE_DEPLOYMENT)
    per_node = dict(Counter(names.get(actor["node"], "dead node") for actor in engines))
    return {"engine_replicas_per_node": per_node, "gpus_total": ray.cluster_resources().get("GPU", 0.0),
            "gpus_free": ray.available_resources().get("GPU", 0.0), "engine_replicas": len(engines)}


def replica_states() -> dict[str, int]:
    from ray import serve

    from service.serve.app import ENGINE_DEPLOYMENT

    try:
        app = serve.status().applications["ocr"]
        return {str(k): v for k, v in app.deployments[ENGINE_DEPLOYMENT].replica_states.items()}
    except Exception:  # the controller is between states
        return {}


def wait_replicas(count: int, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        states = replica_states()
        if states.get("RUNNING", 0) == count and sum(states.values()) == count:
            return time.monotonic() - started
        time.sleep(0.25)
    raise TimeoutError(f"{count} engine replicas not RUNNING within {timeout_s:.0f}s: {replica_states()}")


# --- load -----------------------------------------------------------------------------------------------------------

class StepLoad:
    """Closed-loop clients whose number follows a schedule; every request is recorded and none is cancelled: when
    the number drops, clients finish the request they have in flight first."""

    def __init__(self, url: str, target: run.OCRTarget, requests: list[run.Request], timeout_s: float):
        self.url, self.target, self.requests, self.timeout_s = url, target, requests, timeout_s
        self.wanted = 0
        self.samples: list[run.Sample] = []
        self.t0 = time.perf_counter()
        self._tasks: list[asyncio.Task] = []
        self._counter = iter(range(10 ** 12))

    async def _client(self, index: int, session) -> None:
        while index < self.wanted:
            request = self.requests[next(self._counter) % len(self.requests)]
            self.samples.append(await run._send(session, self.url + self.target.path, self.target, request,
                                                self.t0, self.timeout_s))

    def set_clients(self, clients: int, session) -> None:
        self.wanted = clients
        self._tasks = [t for t in self._tasks if not t.done()]
        running = len(self._tasks)
        self._tasks += [asyncio.create_task(self._client(i, session)) for i in range(running, clients)]

    async def finish(self) -> None:
        self.wanted = 0
        await asyncio.gather(*self._tasks)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def record(self) -> dict[str, Any]:
        """Every request: how many, their outcomes, and each one's [start s, latency s, status, error]."""
        return {"requests": len(self.samples), "outcomes": outcomes(self.samples),
                "samples": [[round(s.start_s, 3), round(s.latency_s, 3), s.status, s.error] for s in self.samples]}


def outcomes(samples: list[run.Sample]) -> dict[str, int]:
    return dict(Counter("200" if s.ok else (s.error or f"http_{s.status}") for s in samples))


def timeline(samples: list[run.Sample], ticks: list[dict[str, Any]], tick_s: float) -> list[dict[str, Any]]:
    """Per tick: the engine replicas (RUNNING, all states), answers finished in it, docs/s, p95 ms, failures."""
    rows = []
    for tick in ticks:
        t = tick["t"]
        done = [s for s in samples if t - tick_s < s.end_s <= t]
        ok = [s.latency_s * 1000 for s in done if s.ok]
        rows.append({**tick, "answers": len(done), "docs_per_s": round(len(ok) / tick_s, 2),
                     "p95_ms": run.percentile(ok, 95) if ok else None, "failed": len(done) - len(ok)})
    return rows


def replicas_back(states: dict[str, int], per_node: dict[str, int], most: int, victim: str) -> bool:
    """After a node kill: `most` engine replicas RUNNING in Serve's view and `most` alive in Ray's, none on the killed
    node. Serve's controller reports the killed replica RUNNING until it notices, while Ray already lists it gone."""
    return (states.get("RUNNING", 0) == most == sum(states.values()) == sum(per_node.values())
            and not {victim, "dead node"} & set(per_node))


# --- the run --------------------------------------------------------------------------------------------------------


class Bench(BenchRecord):
    def __init__(self, args: argparse.Namespace, planned: dict[str, Any]):
        self.args, self.out, self.planned = args, args.out, planned
        self.started = time.monotonic()
        self.results = new_results("bench scale", args.argv, plan=planned, sweep={}, nodekill=None, autoscale=None,
                                   errors={})
        self.cluster: Cluster | None = None
        self.url: str | None = None
        self.http_port = free_port()
        self.kit: str | None = None

    def prepare(self) -> None:
        from service.serve import local

        self.out.mkdir(parents=True, exist_ok=True)
        if not self.args.cpu:
            kit, self.results["model_kit"] = bench_kit(tiny=False)
            self.kit = str(kit)
        self.documents = {w: make_documents(WORKLOADS[w][0].kind, self.args.docs)
                          for w in {*self.planned["workloads"], self.args.autoscale_workload}}
        self.target = run.OCRTarget()
        started = time.monotonic()
        self.cluster = Cluster(self.args, self.planned["gpus"], self.out)
        local.connect_ray(self.cluster.address)
        self.results["cluster_s"] = round(time.monotonic() - started, 1)
        self.log(f"cluster of {len(self.cluster.nodes)} node(s) up in {self.results['cluster_s']}s")

    def requests(self, workload: str) -> list[run.Request]:
        job = WORKLOADS[workload][0]
        return run.build_requests(self.target, [job], docs_per_job=self.args.docs,
                                  documents={job.kind: self.documents[workload]})

    def deploy(self, part: str, replicas: int, most: int) -> dict[str, Any]:
        from service.config import Settings
        from service.serve import local

        from ray import serve

        flat = settings_for(self.args, part, replicas, most, self.kit,
                            self.results["environment"].get("gpu_memory_gib"))
        started = time.monotonic()
        # one HTTP proxy, on the head: the nodes of this machine share its address, and clients use one URL
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.http_port})
        self.url = local.run_app(Settings(host="127.0.0.1", port=self.http_port, **flat), wait_ready_s=900)
        wait_replicas(replicas, 900)
        ready = round(time.monotonic() - started, 1)
        self.log(f"deployed ({part}, {replicas} engine replica(s)) in {ready}s")
        return {"settings": flat, "ready_s": ready}

    async def block(self, workload: str, clients: int, per_replica: int) -> dict[str, Any]:
        from service.serve.app import INGRESS_DEPLOYMENT

        warmup, whole = block_s(self.args, workload, per_replica)
        bound = WORKLOADS[workload][1] * self.args.time_scale
        ingress = [a["pid"] for a in actors(INGRESS_DEPLOYMENT)]
        before = cpu_snapshot(ingress)
        step = await run.run_closed(self.url, self.target, self.requests(workload), clients, whole, warmup,
                                    self.args.request_timeout_s, f"{workload}@{clients}")
        after = cpu_snapshot(ingress)
        cpu_s = sum(cpu_seconds(before, after).values())
        summary = {**step.summary(bound), "clients": clients, "clients_per_replica": per_replica, "bound_ms": bound,
                   "ingress_cpu_ms_per_request": round(cpu_s * 1000 / len(step.samples), 2) if step.samples else None,
                   "outcomes": outcomes(step.samples)}
        run.print_step(summary)
        await asyncio.sleep(self.args.cooldown_s)
        return summary

    async def sweep(self) -> None:
        for n in self.planned["replica_counts"]:
            entry = {"deployment": await asyncio.to_thread(self.deploy, "sweep", n, n), "placement": placement(),
                     "blocks": {}}
            self.results["sweep"][str(n)] = entry
            for w in self.planned["workloads"]:
                for r in range(self.args.rounds):
                    for level in levels(self.args.levels[w]):
                        entry["blocks"].setdefault(w, []).append({**await self.block(w, n * level, level),
                                                                  "round": r + 1})
                        self.save()
        self.results["scaling"] = scaling(self.results["sweep"])
        self.save()

    async def nodekill(self) -> None:
        from service.serve.app import ENGINE_DEPLOYMENT

        most = self.planned["replica_counts"][-1]
        if "sweep" not in self.args.parts:
            await asyncio.to_thread(self.deploy, "sweep", most, most)
        workload = self.planned["workloads"][0]
        before = placement()
        names = node_names()
        victim = next(name for a in actors(ENGINE_DEPLOYMENT) if (name := names.get(a["node"], "")).startswith(
            "worker_node_"))
        load = StepLoad(self.url, self.target, self.requests(workload), self.args.request_timeout_s)
        ticks: list[dict[str, Any]] = []
        back = None
        async with run._session() as session:
            load.set_clients(most * levels(self.args.levels[workload])[0], session)
            await asyncio.sleep(self.args.before_kill_s)
            killed_at = load.now()
            self.cluster.kill(victim)
            self.log(f"killed {victim} under load")
            deadline = time.monotonic() + 120
            while back is None and time.monotonic() < deadline:
                states = await asyncio.to_thread(replica_states)
                per_node = (await asyncio.to_thread(placement))["engine_replicas_per_node"]
                ticks.append({"t": round(load.now(), 2), "replicas": states, "per_node": per_node})
                if replicas_back(states, per_node, most, victim):
                    back = round(load.now() - killed_at, 2)
                await asyncio.sleep(0.5)
            await asyncio.sleep(self.args.after_kill_s)
            await load.finish()
        self.results["nodekill"] = {
            "workload": workload, "killed": victim, "before": before, "after": placement(),
            "replicas_back_after_s": back, **load.record(), "ticks": ticks,
            "requests_in_flight_at_kill": sum(1 for s in load.samples if s.start_s <= killed_at < s.end_s)}
        self.log(f"node kill: replicas back after {back}s; outcomes {outcomes(load.samples)}")
        self.save()

    async def autoscale(self) -> None:
        most = autoscale_most(self.args, self.planned["replica_counts"][-1])
        deployment = await asyncio.to_thread(self.deploy, "autoscale", 1, most)
        workload = self.args.autoscale_workload
        phases = autoscale_phases(self.args, most)
        load = StepLoad(self.url, self.target, self.requests(workload), self.args.request_timeout_s)
        ticks: list[dict[str, Any]] = []
        marks: dict[str, float] = {}

        async def watch() -> None:
            while True:
                states = await asyncio.to_thread(replica_states)
                ticks.append({"t": round(load.now(), 2), "clients": load.wanted, "running": states.get("RUNNING", 0),
                              "replicas": states})
                await asyncio.sleep(self.args.tick_s)

        async with run._session() as session:
            watcher = asyncio.create_task(watch())
            for name, clients, seconds in phases:
                marks[name] = round(load.now(), 2)
                self.log(f"step load {name}: {clients} clients for {seconds:g}s")
                load.set_clients(clients, session)
                await asyncio.sleep(seconds)
            marks["settle"] = round(load.now(), 2)
            # past the step down: wait until the replicas are back at one (or the settle time ends)
            settle_end = time.monotonic() + self.args.settle_s
            while time.monotonic() < settle_end and (await asyncio.to_thread(replica_states)).get("RUNNING", 0) != 1:
                await asyncio.sleep(0.5)
            await load.finish()
            watcher.cancel()
        rows = timeline(load.samples, ticks, self.args.tick_s)
        up_at = next((r["t"] for r in rows if r["t"] >= marks["up"] and r["running"] >= most), None)
        down_at = next((r["t"] for r in rows if r["t"] >= marks["down"] and r["running"] == 1), None)
        self.results["autoscale"] = {
            "workload": workload, "deployment": deployment, "phases": phases, "marks": marks, "most": most,
            "reached_most_after_s": round(up_at - marks["up"], 2) if up_at is not None else None,
            "back_to_one_after_s": round(down_at - marks["down"], 2) if down_at is not None else None,
            "max_running": max((r["running"] for r in rows), default=0), "timeline": rows, **load.record()}
        self.log(f"autoscale: {most} replicas after {self.results['autoscale']['reached_most_after_s']}s, back to "
                 f"one after {self.results['autoscale']['back_to_one_after_s']}s; outcomes {outcomes(load.samples)}")
        self.save()

    def stop(self) -> None:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            if self.cluster is not None:
                self.cluster.stop()

    def finish(self) -> None:
        self.save()
        (self.out / "report.md").write_text(report(self.results))
        self.log(f"wrote {self.out}/results.json and report.md")


def scaling(sweep: dict[str, Any]) -> dict[str, Any]:
    """Per workload and replica count: the best docs/s of a block within the bound and without errors (the median
    over rounds at each level), the efficiency best(n) ÷ (n × best(1)), the ingress CPU per request."""
    out: dict[str, Any] = {}
    for n, entry in sweep.items():
        for workload, blocks in entry["blocks"].items():
            by_level: dict[int, list[dict[str, Any]]] = {}
            for b in blocks:
                by_level.setdefault(b["clients"], []).append(b)
            best = None
            for clients, bs in sorted(by_level.items()):
                p95 = sorted(b["latency_ms_p95"] or math.inf for b in bs)[len(bs) // 2]
                docs = sorted(throughput(b) or 0.0 for b in bs)[len(bs) // 2]
                if p95 <= bs[0]["bound_ms"] and not any(b["errors"] for b in bs) and (best is None or
                                                                                       docs > best["docs_per_s"]):
                    best = {"clients": clients, "docs_per_s": round(docs, 3), "p95_ms": p95}
            cpu = [b["ingress_cpu_ms_per_request"] for b in blocks if b.get("ingress_cpu_ms_per_request") is not None]
            out.setdefault(workload, {})[n] = {"best_within_bound": best, "ingress_cpu_ms_per_request":
                                               round(sum(cpu) / len(cpu), 2) if cpu else None}
    for workload, by_n in out.items():
        one = (by_n.get("1") or {}).get("best_within_bound")
        for n, row in by_n.items():
            best = row["best_within_bound"]
            row["efficiency"] = round(best["docs_per_s"] / (int(n) * one["docs_per_s"]), 3) if best and one else None
    return out


def report(results: dict[str, Any]) -> str:
    env = results["environment"]
    machine = f"{env.get('gpu')} × {results['plan']['gpus']}" if env.get("gpu") else env.get("cpu_model")
    lines = report_head(results, "bench scale", f"{machine}; commit {env.get('commit')}; ray {env.get('ray')}, "
                        f"vllm {env.get('vllm')}.")
    if results.get("scaling"):
        lines += ["## Scaling (best block within the bound, no errors)", "", *md_table(
            ["workload", "engine replicas", "clients", "docs/s", "p95 ms", "efficiency", "ingress CPU ms/request",
             "placement"], "lrrrrrrl",
            [[workload, n, *(fmt((row["best_within_bound"] or {}).get(k)) for k in ("clients", "docs_per_s", "p95_ms")),
              fmt(row["efficiency"]), fmt(row["ingress_cpu_ms_per_request"]),
              json.dumps(results["sweep"][n]["placement"]["engine_replicas_per_node"])]
             for workload, by_n in results["scaling"].items()
             for n, row in sorted(by_n.items(), key=lambda kv: int(kv[0]))]), ""]
        lines += ["## Blocks", "", *md_table(
            ["replicas", "workload", "clients", "docs/s", "p50 ms", "p95 ms", "errors"], "rlrrrrr",
            [[n, workload, b["clients"], fmt(throughput(b)), fmt(b["latency_ms_p50"]), fmt(b["latency_ms_p95"]),
              b["errors"]] for n, entry in results["sweep"].items() for workload, blocks in entry["blocks"].items()
             for b in blocks]), ""]
    if kill := results.get("nodekill"):
        before, after = (json.dumps(kill[k]["engine_replicas_per_node"]) for k in ("before", "after"))
        lines += ["## Worker node killed under load", "",
                  f"Killed {kill['killed']}; engine replicas per node before {before}, after {after}; back after "
                  f"{fmt(kill['replicas_back_after_s'])} s; {kill['requests']} requests "
                  f"({kill['requests_in_flight_at_kill']} in flight at the kill): {json.dumps(kill['outcomes'])}.", ""]
    if auto := results.get("autoscale"):
        lines += ["## Autoscaling under a step load", "",
                  f"{auto['workload']}, phases {auto['phases']}: {auto['most']} replicas reached "
                  f"{fmt(auto['reached_most_after_s'])} s after the step up, one replica again "
                  f"{fmt(auto['back_to_one_after_s'])} s after the step down; {auto['requests']} requests: "
                  f"{json.dumps(auto['outcomes'])}.", "", *md_table(
                      ["t s", "clients", "replicas running", "docs/s", "p95 ms", "failed"], "rrrrrr",
                      [[fmt(r["t"]), r["clients"], r["running"], fmt(r["docs_per_s"]), fmt(r["p95_ms"]), r["failed"]]
                       for r in auto["timeline"]]), ""]
    if results.get("errors"):
        lines += ["Errors: " + "; ".join(str(v).strip().splitlines()[-1] for v in results["errors"].values()), ""]
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------------------------------

PARTS = ("sweep", "nodekill", "autoscale")
# (option, type, default on a GPU machine, default with --cpu, help)
OPTIONS = [
    ("--parts", str, "sweep", ",".join(PARTS), f"comma-separated, of {', '.join(PARTS)}"),
    ("--replicas", str, None, "1,2", "engine replica counts (GPU: 1, 2, 4 … N and N, N = the GPUs; --cpu 1,2)"),
    ("--gpus", int, None, None, "GPUs of this machine (default: nvidia-smi's count)"),
    ("--workloads", str, "id_card,a4", "id_card", "id_card,a4"),
    ("--id-levels", str, "8,12,16,24", "8", "ID-card clients per engine replica"),
    ("--a4-levels", str, "8,16,24", "8", "A4 clients per engine replica"),
    ("--rounds", int, 1, 1, "rounds of each block"),
    ("--kv-budget-gb", float, 24.0, 24.0, "KV cache per engine, GiB (vLLM)"),
    ("--ingress-per-engine", float, 2.0, 0.5, "ingress replicas per engine replica"),
    ("--time-scale", float, 1.0, 8.0, "--cpu: the mock engine's time × this; latency bounds × the same"),
    ("--worker-nodes", int, 3, 3, "--cpu: worker nodes (at most one engine replica each: one stays free)"),
    ("--gpus-per-node", int, 2, 2, "--cpu: GPUs each worker node declares"),
    ("--head-cpus", int, None, 2, "CPUs the head node declares (default: this machine's; --cpu 2)"),
    ("--worker-cpus", int, 1, 1, "--cpu: CPUs each worker node declares"),
    ("--block-s", float, 20.0, 6.0, "shortest measured window of a block"),
    ("--warmup-s", float, 2.0, 2.0, "shortest unmeasured start of a block"),
    ("--cooldown-s", float, 1.0, 1.0, "pause after each block"),
    ("--step-clients", int, None, None, "autoscale: clients per replica's load (default: the workload's first level)"),
    ("--step-base-s", float, 30.0, 5.0, "autoscale: seconds at one replica's load"),
    ("--step-up-s", float, 200.0, 14.0, "autoscale: seconds at N replicas' load (GPU: 60 + one engine start)"),
    ("--step-down-s", float, 100.0, 6.0, "autoscale: seconds at one replica's load after the step"),
    ("--settle-s", float, 60.0, 10.0, "autoscale: at most this long more at one replica's load until one is left"),
    ("--tick-s", float, 1.0, 1.0, "autoscale: seconds between the timeline's samples"),
    ("--before-kill-s", float, 3.0, 3.0, "nodekill: load before the kill"),
    ("--after-kill-s", float, 3.0, 3.0, "nodekill: load after the replicas are back"),
    ("--docs", int, 4, 4, "different documents per workload"),
    ("--request-timeout-s", float, 300.0, 300.0, "client timeout per request"),
    ("--budget-s", float, 540.0, None, "the whole run, seconds (--cpu or 0: none)"),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest bench scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan-only", action="store_true", help="print the plan, start nothing (exit 2 if it won't fit)")
    p.add_argument("--cpu", action="store_true", help="worker nodes declaring GPUs, the mock engine timed like a GPU's")
    add_options(p, OPTIONS, "--cpu")
    p.add_argument("--haproxy", action=argparse.BooleanOptionalAction, default=None, help="HAProxy as the HTTP "
                   "front end (default on; --cpu off: Serve's proxy actor)")
    p.add_argument("--autoscale-workload", default="id_card", choices=list(WORKLOADS))
    p.add_argument("--out", type=Path, default=Path("results/scale"))
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = parser().parse_args(argv)
    fill_defaults(args, [*OPTIONS, ("--haproxy", bool, True, False, "")], args.cpu)
    if not args.cpu and args.time_scale != 1.0:
        parser().error("--time-scale is for --cpu (the mock engine)")
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := set(args.parts) - set(PARTS):
        parser().error(f"unknown parts {sorted(unknown)}")
    args.levels = {"id_card": args.id_levels, "a4": args.a4_levels}
    args.head_cpus = args.head_cpus or os.cpu_count() or 1
    args.budget_s = args.budget_s or None
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    gpus = args.worker_nodes * args.gpus_per_node if args.cpu else args.gpus if args.gpus is not None else len(
        nvidia_smi("index"))
    try:
        planned = plan(args, gpus)
    except ValueError as exc:
        parser().error(str(exc))
    print(plan_text(planned, f", {gpus} GPUs, replicas {planned['replica_counts']}"), flush=True)
    if args.plan_only or not planned["fits"]:
        return 0 if planned["fits"] else 2
    bench = Bench(args, planned)
    return 0 if bench.run(bench.prepare, *(lambda part=part: asyncio.run(getattr(bench, part)())
                                           for part in PARTS if part in args.parts)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
