"""Pool the rounds of several `bench gpu --parts pair` runs into one paired summary.

One device call holds about 300 rounds of three ID-card servers (server start-up takes ~200 s of its 10 minutes),
and one round's difference between two servers varies by ±34 ms on the H200, so one call pins a median difference
to about ±5 ms. Each round's difference is measured within that round, so rounds from different calls and machines
can be pooled: the interval narrows as 1/√rounds. The servers' own p50s are not pooled the same way (machines
differ), so the pooled table gives the differences; each run's own median and interval stay beside it.

That interval holds only if every run measured the same difference. Machines do differ (2026-12-01, H200, ID card:
service − raw +3.5, +13.2 and +19.1 ms in three calls, the first two intervals apart), so the table also gives an
interval that resamples the runs as well as their rounds, and names the differences whose runs disagree, i.e. where
two runs' own intervals do not overlap. With few runs that interval is rough, and it is the honest one.

    python -m loadtest bench pool A/results.json B/results.json [--out pooled.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import run


def load_pair(path: Path) -> dict[str, Any]:
    """The `pair` part of one run's results.json, with its per-round latencies."""
    pair = json.loads(path.read_text()).get("parts", {}).get("pair")
    if not pair or not pair.get("rounds_ms"):
        raise SystemExit(f"{path}: no pair part with per-round latencies (rounds_ms)")
    return pair


def pool(pairs: list[dict[str, Any]], names: list[str] | None = None, resamples: int = 2000, seed: int = 0
         ) -> dict[str, Any]:
    """One paired summary over the complete rounds of every run, for the servers all of them ran (in the first
    run's order, or `names`); the runs must have measured the same workload. Also each run's own summary (`runs`),
    and per difference an interval over runs and rounds resampled together (`across_runs`)."""
    workloads = {p["workload"] for p in pairs}
    if len(workloads) != 1:
        raise SystemExit(f"the runs measured different workloads: {sorted(workloads)}")
    common = [n for n in (names or pairs[0]["servers"]) if all(n in p["rounds_ms"] for p in pairs)]
    if len(common) < 2:
        raise SystemExit(f"fewer than two servers in every run: {[p['servers'] for p in pairs]}")
    per_run = []
    for p in pairs:
        count = len(p["rounds_ms"][common[0]])
        engine = {name: (p.get("engine_rounds_ms") or {}).get(name) or [None] * count for name in common}
        per_run.append([{name: run.Sample(0.0, p["rounds_ms"][name][i] / 1000, 200, True, engine_ms=engine[name][i])
                         for name in common} for i in range(count)])
    summary = run.paired_summary([r for rounds in per_run for r in rounds], common, resamples, seed)
    for key in ("rounds_ms", "engine_rounds_ms"):
        summary.pop(key, None)
    summary["workload"] = workloads.pop()
    summary["runs"] = []
    for rounds in per_run:
        own = run.paired_summary(rounds, common, resamples, seed)
        summary["runs"].append({"rounds": len(rounds), "differences": {**own["differences"], **own["between"]}})
    summary["across_runs"] = {
        label: {**across_runs([np.array(p["rounds_ms"][b]) - np.array(p["rounds_ms"][a]) for p in pairs],
                              resamples, seed),
                "runs_disagree": disagree([r["differences"][label]["ci95_ms"] for r in summary["runs"]])}
        for label, a, b in run.paired_labels(common)}
    return summary


def across_runs(deltas_per_run: list[np.ndarray], resamples: int, seed: int) -> dict[str, list[float]]:
    """95 % intervals of the pooled median and mean difference when the runs are resampled as well as their rounds
    (a two-level bootstrap): a run's machine or call shifts all its rounds alike, so the runs, not the rounds, are
    the independent units of that shift."""
    rng = np.random.default_rng(seed)
    medians, means = np.empty(resamples), np.empty(resamples)
    for i in range(resamples):
        picked = [deltas_per_run[k] for k in rng.integers(len(deltas_per_run), size=len(deltas_per_run))]
        pooled = np.concatenate([d[rng.integers(len(d), size=len(d))] for d in picked])
        medians[i], means[i] = np.median(pooled), pooled.mean()
    return {"ci95_ms": _interval(medians), "mean_ci95_ms": _interval(means)}


def _interval(values: np.ndarray) -> list[float]:
    low, high = np.percentile(values, [2.5, 97.5])
    return [round(float(low), 1), round(float(high), 1)]


def disagree(intervals: list[list[float]]) -> bool:
    """Whether some two runs' own 95 % intervals of a difference do not overlap."""
    return max(low for low, _ in intervals) > min(high for _, high in intervals)


def report(summary: dict[str, Any], sources: list[str]) -> str:
    ref = summary["reference"]
    per_run = ", ".join(f"{source}: {r['rounds']}" for source, r in zip(sources, summary["runs"]))
    lines = [f"Pooled side by side ({summary['workload']}): {summary['complete_rounds']} rounds from "
             f"{len(sources)} runs ({per_run})",
             "", f"| server | − {ref} per round, median ms (95 % interval) | mean ms (95 % interval) | "
             "median ms, runs resampled too | each run's median ms (95 % interval) |", "|---|---|---|---|---|"]
    split = []
    for name, d in {**summary["differences"], **summary["between"]}.items():
        median, mean = run.difference_text(d)
        across = summary["across_runs"][name]
        each = ", ".join(run.difference_text(r["differences"][name])[0] for r in summary["runs"])
        lines.append(f"| {name} | {median} | {mean} | {d['median_ms']:+} ({across['ci95_ms'][0]:+} … "
                     f"{across['ci95_ms'][1]:+}) | {each} |")
        if across["runs_disagree"]:
            split.append(name)
    if summary.get("outside_engine"):  # runs that kept each round's engine time (twelfth session on)
        lines += ["", "Per round, the time outside each server's own engine: " + "; ".join(
            "{} median {}, mean {}".format(name, *run.difference_text(d, " ms"))
            for name, d in summary["outside_engine"].items())]
    if split:
        lines += ["", f"The runs disagree on {', '.join(split)}: two runs' own intervals do not overlap, so the "
                  "machines or calls differed by more than their rounds' noise. The pooled interval leaves that out; "
                  "the one with the runs resampled too counts it."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest bench pool", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="results.json of `bench gpu --parts pair` runs")
    p.add_argument("--servers", help="comma-separated servers to compare, the first the reference (default: the "
                                     "first run's order, those every run has)")
    p.add_argument("--out", type=Path, help="write the pooled summary here as JSON")
    args = p.parse_args(argv)
    if len({path.resolve() for path in args.results}) < len(args.results):
        p.error("a run named twice would count its rounds twice")
    summary = pool([load_pair(path) for path in args.results],
                   [s.strip() for s in args.servers.split(",")] if args.servers else None)
    summary["sources"] = [str(path) for path in args.results]
    print(report(summary, summary["sources"]), end="")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
