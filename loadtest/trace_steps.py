"""What one vLLM engine step costs on the GPU and what it waits for: the engine steps of a torch profiler trace
(vLLM `--profiler-config`, Chrome trace JSON, gzipped or not), each step's GPU busy time against its wall time.

vLLM's worker wraps every step in a profiler annotation `execute_context_C(CT)_generation_G(GT)` (C requests in
prefill with CT tokens, G decoding with GT tokens). A step's window runs from its annotation's start to the next
one's; the GPU's busy time in it is the union of the kernels, copies and memsets that ran inside the window. With
vLLM's async scheduling the host prepares step i+1 while the GPU runs step i, so windows are host time and a
kernel is counted in the window it ran in; over many steps the mean is the engine's own split between GPU work
and GPU waiting for the host (launches, sampling on the host, scheduling, output handling).

The profiler itself slows the host side (it records every CPU op), so a step's wall time under it is longer than
without it: `bench gpu --parts trace` reports the unprofiled time per token from the same server beside it.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from pathlib import Path
from typing import Any, Iterable

STEP_NAME = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GRAPH_LAUNCH = "cudaGraphLaunch"


def load_trace(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted (start, end) covering the same time as `intervals`."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _covered(union: list[tuple[float, float]], starts: list[float], lo: float, hi: float) -> float:
    """Time of the disjoint `union` (with its `starts`) inside [lo, hi)."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(union) and union[i][0] < hi:
        total += max(0.0, min(hi, union[i][1]) - max(lo, union[i][0]))
        i += 1
    return total


def step_windows(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per engine step that has a next step (its window ends there): times in ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    steps = sorted(((float(e["ts"]), float(e.get("dur", 0.0)), m) for e in events
                    if e.get("cat") == "user_annotation" and (m := STEP_NAME.fullmatch(e.get("name", "")))),
                   key=lambda step: step[0])  # by start only: two equal starts would compare match objects
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "")) for e in events
           if e.get("cat") in GPU_CATEGORIES]
    union = _union((s, e) for s, e, _ in gpu)
    union_starts = [s for s, _ in union]
    gpu.sort()
    gpu_starts = [s for s, _, _ in gpu]
    launches = sorted(float(e["ts"]) for e in events
                      if e.get("cat") == "cuda_runtime" and e.get("name") == GRAPH_LAUNCH)
    windows = []
    for (start, dur, m), (end, _, _) in zip(steps, steps[1:]):
        first, last = bisect.bisect_left(gpu_starts, start), bisect.bisect_left(gpu_starts, end)
        windows.append({
            "prefill_requests": int(m[1]), "prefill_tokens": int(m[2]),
            "decode_requests": int(m[3]), "decode_tokens": int(m[4]),
            "wall_ms": (end - start) / 1000, "host_ms": dur / 1000,
            "gpu_busy_ms": _covered(union, union_starts, start, end) / 1000,
            "gpu_ops": last - first,
            "graph_launches": bisect.bisect_left(launches, end) - bisect.bisect_left(launches, start),
            "kernels": gpu[first:last],
        })
    return windows


def _mean(values: list[float], digits: int = 3) -> float | None:
    return round(statistics.fmean(values), digits) if values else None


def summarise_steps(windows: list[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """Means per kind of step: `decode` (no request in prefill) and `with_prefill`. GPU fields are None when the
    trace holds no GPU activity (a CPU engine)."""
    has_gpu = any(w["gpu_ops"] for w in windows)
    out: dict[str, Any] = {"steps": len(windows), "gpu_activity": has_gpu}
    for kind, chosen in (("decode", [w for w in windows if not w["prefill_requests"] and w["decode_requests"]]),
                         ("with_prefill", [w for w in windows if w["prefill_requests"]])):
        if not chosen:
            continue
        wall = [w["wall_ms"] for w in chosen]
        entry: dict[str, Any] = {
            "steps": len(chosen),
            "batch_mean": _mean([w["decode_requests"] + w["prefill_requests"] for w in chosen], 2),
            "prefill_tokens_mean": _mean([w["prefill_tokens"] for w in chosen], 1),
            "wall_ms_mean": _mean(wall), "wall_ms_p50": round(statistics.median(wall), 3),
            "host_annotation_ms_mean": _mean([w["host_ms"] for w in chosen]),
        }
        if has_gpu:
            busy = [w["gpu_busy_ms"] for w in chosen]
            entry.update(gpu_busy_ms_mean=_mean(busy), gpu_idle_ms_mean=_mean([a - b for a, b in zip(wall, busy)]),
                         gpu_busy_share=round(sum(busy) / sum(wall), 3) if sum(wall) else None,
                         gpu_ops_mean=_mean([w["gpu_ops"] for w in chosen], 1),
                         graph_launches_mean=_mean([w["graph_launches"] for w in chosen], 2))
            by_name: dict[str, float] = {}
            for w in chosen:
                for start, end, name in w["kernels"]:
                    by_name[name] = by_name.get(name, 0.0) + (end - start)
            entry["top_gpu_ops_ms_per_step"] = {name[:100]: round(us / 1000 / len(chosen), 4) for name, us in
                                                sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}
        out[kind] = entry
    return out


def summarise_trace(path: str | Path, top: int = 8) -> dict[str, Any]:
    return {"file": Path(path).name, **summarise_steps(step_windows(load_trace(path)), top)}
