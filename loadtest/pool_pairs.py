"""Pool the rounds of several `bench gpu --parts pair` runs into one paired summary.

One device call holds about 300 rounds of three ID-card servers (server start-up takes ~200 s of its 10 minutes),
and one round's difference between two servers varies by ±34 ms on the H200, so one call pins a median difference
to about ±5 ms. Each round's difference is measured within that round, so rounds from different calls and machines
can be pooled: the interval narrows as 1/√rounds. The servers' own p50s are not pooled the same way (machines
differ), so the pooled table gives the differences; each run's own line stays beside it.

    python -m loadtest bench pool A/results.json B/results.json [--out pooled.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loadtest import run


def load_pair(path: Path) -> dict[str, Any]:
    """The `pair` part of one run's results.json, with its per-round latencies."""
    pair = json.loads(path.read_text()).get("parts", {}).get("pair")
    if not pair or not pair.get("rounds_ms"):
        raise SystemExit(f"{path}: no pair part with per-round latencies (rounds_ms)")
    return pair


def pool(pairs: list[dict[str, Any]], names: list[str] | None = None) -> dict[str, Any]:
    """One paired summary over the complete rounds of every run, for the servers all of them ran (in the first
    run's order, or `names`); the runs must have measured the same workload."""
    workloads = {p["workload"] for p in pairs}
    if len(workloads) != 1:
        raise SystemExit(f"the runs measured different workloads: {sorted(workloads)}")
    common = [n for n in (names or pairs[0]["servers"]) if all(n in p["rounds_ms"] for p in pairs)]
    if len(common) < 2:
        raise SystemExit(f"fewer than two servers in every run: {[p['servers'] for p in pairs]}")
    rounds = [{name: run.Sample(0.0, p["rounds_ms"][name][i] / 1000, 200, True) for name in common}
              for p in pairs for i in range(len(p["rounds_ms"][common[0]]))]
    summary = run.paired_summary(rounds, common)
    summary.pop("rounds_ms")
    summary["workload"] = workloads.pop()
    summary["runs"] = [{"rounds": len(p["rounds_ms"][common[0]]), "differences": p.get("differences", {})}
                       for p in pairs]
    return summary


def report(summary: dict[str, Any], sources: list[str]) -> str:
    ref = summary["reference"]
    per_run = ", ".join(f"{source}: {r['rounds']}" for source, r in zip(sources, summary["runs"]))
    lines = [f"Pooled side by side ({summary['workload']}): {summary['complete_rounds']} rounds from "
             f"{len(sources)} runs ({per_run})",
             "", f"| server | − {ref} per round, median ms (95 % interval) | mean ms (95 % interval) | "
             "each run's median ms |", "|---|---|---|---|"]
    for name, d in {**summary["differences"], **summary["between"]}.items():
        each = ", ".join(f"{r['differences'][name]['median_ms']:+}" if name in r["differences"] else "–"
                         for r in summary["runs"]) if name in summary["differences"] else ""
        median, mean = run.difference_text(d)
        lines.append(f"| {name} | {median} | {mean} | {each} |")
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
