"""Rate-limiter benchmark: decisions per second and decision latency (p50/p99) of the Redis token bucket (one
EVALSHA per decision) and, for comparison, the in-process bucket (the method: docs/BENCHMARKS.md; goal G7).

    python -m loadtest bench limiter --out results/limiter      # its own redis-server on a free loopback port
    python -m loadtest bench limiter --redis-url redis://127.0.0.1:6379/0 --processes 2 --concurrency 16

The `ping` row is no limiter: one PING round trip, the floor of any Redis decision here; `redis us/decision` is the
script's own time inside Redis (INFO commandstats). Writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import redis

from loadtest.common import ManagedProcess, environment_facts, free_port
from service.admission.ratelimit import LocalTokenBucket, RedisTokenBucket


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else float("nan")


async def _run_limiter(limiter, duration_s: float, concurrency: int, tenants: int, warmup_s: float) -> list[float]:
    latencies_ms: list[float] = []
    measure_from = time.perf_counter() + warmup_s
    stop_at = measure_from + duration_s

    async def worker(n: int) -> None:
        while (started := time.perf_counter()) < stop_at:
            await limiter.acquire(f"tenant-{n % tenants}", 1, 1e6, 1e9)
            if started >= measure_from:
                latencies_ms.append((time.perf_counter() - started) * 1000)
            n += concurrency

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies_ms


class _PingFloor:
    """Not a limiter: one PING round trip on the same client, the floor any Redis decision pays on this machine."""

    def __init__(self, url: str):
        from service.admission.ratelimit import make_redis_client

        self._client = make_redis_client(url, 1.0)

    async def acquire(self, *_args) -> None:
        await self._client.ping()

    async def close(self) -> None:
        await self._client.aclose()


def _process(kind: str, url: str | None, duration_s: float, concurrency: int, tenants: int, warmup_s: float,
             start_at: float, out) -> None:
    async def main() -> list[float]:
        limiter = {"redis": lambda: RedisTokenBucket.from_url(url, timeout_s=1.0), "ping": lambda: _PingFloor(url),
                   "local": LocalTokenBucket}[kind]()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        try:
            return await _run_limiter(limiter, duration_s, concurrency, tenants, warmup_s)
        finally:
            await limiter.close()

    out.put(asyncio.run(main()))


def bench(kind: str, url: str | None, *, processes: int, concurrency: int, duration_s: float, tenants: int,
          warmup_s: float = 1.0) -> dict:
    if kind == "redis":
        redis.Redis.from_url(url).config_resetstat()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0  # let every spawned interpreter import first
    procs = [ctx.Process(target=_process, args=(kind, url, duration_s, concurrency, tenants, warmup_s, start_at, out))
             for _ in range(processes)]
    for p in procs:
        p.start()
    latencies = sorted(ms for _ in procs for ms in out.get(timeout=duration_s + warmup_s + 120))
    for p in procs:
        p.join(timeout=30)
    server_us = None
    if kind == "redis":  # the script's own cost inside Redis, free of client-side CPU contention
        stats = redis.Redis.from_url(url).info("commandstats")
        server_us = round(stats.get("cmdstat_evalsha", {}).get("usec_per_call", float("nan")), 2)
    return {"limiter": kind, "processes": processes, "concurrency_per_process": concurrency, "tenants": tenants,
            "decisions": len(latencies), "duration_s": duration_s,
            "decisions_per_s": round(len(latencies) / duration_s),
            "p50_ms": round(_percentile(latencies, 0.50), 3), "p99_ms": round(_percentile(latencies, 0.99), 3),
            "max_ms": round(latencies[-1], 3) if latencies else None, "redis_us_per_decision": server_us}


def _start_redis(workdir: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    cmd = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir",
           workdir, "--save", "", "--appendonly", "no"]
    proc = ManagedProcess("redis-server", cmd, log_path=Path(workdir) / "redis.log")
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(port=port, socket_timeout=0.2).ping():
                return proc, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            if time.monotonic() > deadline:
                proc.stop()
                raise
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    parser = argparse.ArgumentParser(prog="python -m loadtest bench limiter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="existing Redis (default: start redis-server on a free loopback port)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per scenario")
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--processes", type=int, default=1, help="client processes (ingress replicas)")
    parser.add_argument("--concurrency", type=int, default=8, help="in-flight decisions per process")
    parser.add_argument("--out", type=Path, default=Path("results/limiter"))
    args = parser.parse_args(argv)

    load_before = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as workdir:
        proc, url = _start_redis(workdir) if args.redis_url is None else (None, args.redis_url)
        try:
            results = [bench(kind, url if kind != "local" else None, processes=processes, concurrency=concurrency,
                             duration_s=args.duration, tenants=args.tenants)
                       for kind, processes, concurrency in (("ping", 1, 1), ("redis", 1, 1),
                                                            ("redis", args.processes, args.concurrency),
                                                            ("local", 1, args.concurrency))]
        finally:
            if proc is not None:
                proc.stop(timeout_s=5)
    print(f"load average before/after: {load_before} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'limiter':8} {'procs':>5} {'conc':>5} {'decisions/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'redis us/decision':>18}")
    for r in results:
        print(f"{r['limiter']:8} {r['processes']:>5} {r['concurrency_per_process']:>5} {r['decisions_per_s']:>12,} "
              f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['max_ms']:>8.3f} {str(r['redis_us_per_decision']):>18}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "environment": environment_facts(),
         "load_average": [load_before, f"{os.getloadavg()[0]:.1f}"], "results": results}, indent=2))
    return 0 if all(r["decisions"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
