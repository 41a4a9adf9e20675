"""CPU comparison: what the service costs on top of the engine it wraps, on this machine.

    python -m loadtest bench cpu --out results/cpu
    python -m loadtest bench cpu --parts overhead --variant haproxy --out results/cpu-haproxy

Parts: `embedded`, the embedded engine through `ocr-serve serve` against rapidocr called directly in this process
(the engine's own RapidOCR object) on the same pages: per request, paired one by one (JPEG and PNG uploads), and
throughput in alternating blocks (goal G6); `overhead`, the service with the mock engine, sequential requests per
payload: the client's latency, the ingress handler's time and what lay outside it, also per `--variant`.
Writes OUT/results.json and OUT/report.md; the services' logs in OUT/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from loadtest import run
from loadtest.common import (PRESETS, embedded_ocr, load_average, md_table, median, new_results, parse_variants,
                             port_holder, report_head, run_parts, start_service)
from loadtest.documents import GeneratedDocument, encode, make_documents

PARTS = ("embedded", "overhead")
GOAL_RATIO = 1.1  # issue 50: the embedded engine per request within 1.1× of rapidocr called directly
# every client is the one (anonymous) tenant: neither its bucket nor its concurrency cap is what is measured
SERVICE = {"rate_limit_enabled": False, "graceful_shutdown_timeout_s": 5, "log_level": "WARNING"}


def upload_body(data: bytes, mime: str) -> bytes:
    return json.dumps({"image": f"data:{mime};base64,{base64.b64encode(data).decode()}", "task": "text"}).encode()


def post_sequential(url: str, body: bytes, count: int) -> list[dict[str, float]]:
    """`count` requests one after another on one keep-alive connection: client latency + the server's timings."""
    import httpx

    out = []
    with httpx.Client(timeout=300) as client:
        for _ in range(count):
            started = time.perf_counter()
            resp = client.post(url + "/v1/ocr", content=body, headers={"Content-Type": "application/json"})
            latency_ms = (time.perf_counter() - started) * 1000
            if resp.status_code != 200:
                raise RuntimeError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
            timings = resp.json().get("timings_ms", {})
            out.append({"latency_ms": latency_ms, **{f"server_{k}_ms": v for k, v in timings.items()}})
    return out


p50 = functools.partial(median, digits=2)  # a median in ms, to 0.01


# --- embedded engine vs rapidocr called directly ---------------------------------------------------------------------

def bench_embedded(out: Path, docs: int, pair_rounds: int, rounds: int, block_s: float) -> dict[str, Any]:
    documents = make_documents("a4", docs) + make_documents("id_card", docs)
    jpeg = {id(doc): encode(Image.open(io.BytesIO(doc.png)).convert("RGB"), "JPEG", quality=90) for doc in documents}
    uploads = [(doc, fmt, data, mime) for doc in documents
               for fmt, data, mime in (("jpeg", jpeg[id(doc)], "image/jpeg"), ("png", doc.png, "image/png"))]
    bodies = {id(data): upload_body(data, mime) for _, _, data, mime in uploads}
    engine, ocr = embedded_ocr()

    def direct(data: bytes) -> dict[str, float]:
        started = time.perf_counter()
        ocr(data)
        return {"latency_ms": (time.perf_counter() - started) * 1000}

    proc, url = start_service({**SERVICE, "engine": "embedded"}, log_path=out / "logs" / "service-embedded.log")
    try:
        api = lambda data: post_sequential(url, bodies[id(data)], 1)[0]  # noqa: E731
        for _, _, data, _ in uploads:  # every upload once on each side, unmeasured
            direct(data)
            api(data)
        pairs: dict[str, list[tuple[dict, dict]]] = {"jpeg": [], "png": []}
        for r in range(pair_rounds):
            for i, (doc, kind, data, _) in enumerate(uploads):
                if (r + i) % 2:
                    a, d = api(data), direct(data)
                else:
                    d, a = direct(data), api(data)
                pairs[kind].append((d, a))
        blocks = embedded_blocks(url, documents, direct, api, rounds, block_s)
    finally:
        proc.stop(timeout_s=30)
        asyncio.run(engine.shutdown())
    per_upload = {}
    for fmt, rows in pairs.items():
        direct_ms, api_ms = [d["latency_ms"] for d, _ in rows], [a["latency_ms"] for _, a in rows]
        per_upload[fmt] = {"pairs": len(rows), "direct_p50_ms": p50(direct_ms), "api_p50_ms": p50(api_ms),
                           "p50_ratio": round(p50(api_ms) / p50(direct_ms), 3),
                           "pair_ratio": run.ratio_summary([a / d for d, a in zip(direct_ms, api_ms)]),
                           "api_engine_p50_ms": p50([a["server_engine_ms"] for _, a in rows]),
                           "api_decode_p50_ms": p50([a["server_decode_ms"] for _, a in rows])}
        print(f"  embedded {fmt}: direct p50 {per_upload[fmt]['direct_p50_ms']} ms, API p50 "
              f"{per_upload[fmt]['api_p50_ms']} ms ({per_upload[fmt]['p50_ratio']}×)", flush=True)
    return {"documents": f"{docs} A4 pages (~500 characters) and {docs} ID cards, each as JPEG (quality 90) and PNG",
            "per_request": per_upload, "throughput": blocks}


def embedded_blocks(url: str, documents: list[GeneratedDocument], direct: Callable, api: Callable, rounds: int,
                    block_s: float) -> dict[str, Any]:
    """Blocks of `block_s` alternating direct and API at one client, cycling through the PNG documents; then two
    clients on the API for as long as the API's blocks took together."""
    samples: dict[str, dict[str, list[float]]] = {"direct": {}, "api": {}}
    for _ in range(rounds):
        for side, call in (("direct", direct), ("api", api)):
            started, i = time.perf_counter(), 0
            while time.perf_counter() - started < block_s:
                doc = documents[i % len(documents)]
                samples[side].setdefault(doc.kind, []).append(call(doc.png)["latency_ms"])
                i += 1
    target = run.OCRTarget(task_override="text")
    requests = [run.Request(run.Job(doc.kind, "text"), doc, upload_body(doc.png, "image/png")) for doc in documents]
    step = asyncio.run(run.run_closed(url, target, requests, 2, block_s * rounds + min(5.0, block_s / 4),
                                      warmup_s=min(5.0, block_s / 4), label="embedded-api-c2", min_answers=2))
    api_c2 = step.summary(None)
    kinds = sorted(samples["direct"])
    # an equal mix of the kinds, so that blocks ending at different points of the cycle do not bias the ratio
    mean_ms = {side: sum(statistics.fmean(samples[side][k]) for k in kinds) / len(kinds) for side in samples}
    return {"rounds": rounds, "block_s": block_s,
            "direct_docs_per_s": round(1000 / mean_ms["direct"], 3), "api_docs_per_s": round(1000 / mean_ms["api"], 3),
            "api_over_direct": round(mean_ms["direct"] / mean_ms["api"], 3),
            "api_c2_docs_per_s": api_c2["docs_per_s"],
            "api_c2_over_direct": round((api_c2["docs_per_s"] or 0) * mean_ms["direct"] / 1000, 3),
            "api_c2_errors": api_c2["errors"],
            "mean_ms": {side: {k: round(statistics.fmean(v), 1) for k, v in rows.items()}
                        for side, rows in samples.items()}}


# --- the serving stack alone: mock engine -----------------------------------------------------------------------------

PAYLOADS = {"tiny_64x32": lambda: GeneratedDocument("id_card", 64, 32, encode(Image.new("RGB", (64, 32), "white")), ""),
            "id_card_1000x630": lambda: make_documents("id_card", 1)[0],
            "a4_1240x1754": lambda: make_documents("a4", 1)[0]}


def bench_overhead(out: Path, requests: int, rounds: int, variants: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The mock service started once per setting per round (settings alternating, the order reversed every other
    round); per payload `requests` sequential requests after 3 unmeasured ones."""
    documents = {name: make() for name, make in PAYLOADS.items()}
    modes = {"default": {}, **variants}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {m: {d: [] for d in documents} for m in modes}
    listeners: dict[str, list[str | None]] = {m: [] for m in modes}  # what held the HTTP port (a variant took?)
    target = run.OCRTarget(task_override="text")
    bodies = {name: target.body(run.Job(doc.kind, "text"), doc) for name, doc in documents.items()}
    for r in range(rounds):
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            proc, url = start_service({**SERVICE, "engine": "mock"}, extra_env=modes[mode],
                                      log_path=out / "logs" / f"service-mock-{mode}-{r}.log")
            with proc:
                listeners[mode].append(port_holder(proc, int(url.rsplit(":", 1)[1])))
                for name, body in bodies.items():
                    post_sequential(url, body, 3)
                    samples[mode][name] += post_sequential(url, body, requests)
    result: dict[str, Any] = {"requests_per_payload": requests * rounds, "rounds": rounds, "variants": variants,
                              "http_listener": listeners, "payloads": {}}
    for name, doc in documents.items():
        row = {"body_kib": len(bodies[name]) // 1024}
        for mode in modes:
            rows = samples[mode][name]
            rows_p50 = p50([s["latency_ms"] for s in rows])
            row[mode] = {"client_p50_ms": rows_p50,
                         "client_p95_ms": round(run.percentile([s["latency_ms"] for s in rows], 95), 2),
                         "ingress_p50_ms": p50([s["server_total_ms"] for s in rows]),
                         "ingress_decode_p50_ms": p50([s["server_decode_ms"] for s in rows]),
                         "outside_ingress_p50_ms": p50([s["latency_ms"] - s["server_total_ms"] for s in rows])}
            if mode != "default":
                row[mode]["client_p50_saved_ms"] = round(row["default"]["client_p50_ms"] - rows_p50, 2)
            print(f"  overhead {name:<18} {mode:<10} client p50 {row[mode]['client_p50_ms']:7.1f} ms, ingress p50 "
                  f"{row[mode]['ingress_p50_ms']:.1f} ms", flush=True)
        result["payloads"][name] = row
    return result


# --- report -----------------------------------------------------------------------------------------------------------

def report(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = report_head(results, "bench cpu", f"{env.get('cpu_model')} ({env.get('cpu_count')} CPUs; load average "
                        f"{results['load_average']} at the start, {results.get('load_average_end')} at the end); "
                        f"commit {env.get('commit')}; rapidocr {env.get('rapidocr')}, onnxruntime "
                        f"{env.get('onnxruntime')}, ray {env.get('ray')}")
    if e := results.get("embedded"):
        lines += [f"## Embedded engine through the service against rapidocr called directly ({e['documents']})", "",
                  *md_table(["upload", "pairs", "direct p50 ms", "API p50 ms", "API ÷ direct (p50s)",
                             "API ÷ direct per pair, median (95 %)", "engine inside the service p50 ms",
                             "ingress decode p50 ms"], "lrrrrlrr",
                            [[kind, u["pairs"], u["direct_p50_ms"], u["api_p50_ms"], f"**{u['p50_ratio']}**",
                              run.interval_text(u["pair_ratio"]["median"], u["pair_ratio"]["ci95"]),
                              u["api_engine_p50_ms"], u["api_decode_p50_ms"]] for kind, u in e["per_request"].items()])]
        lines += ["", f"Goal, API ÷ direct p50 ≤ {GOAL_RATIO:g}: " + ", ".join(
            f"{kind} **{'met' if u['p50_ratio'] <= GOAL_RATIO else 'not met'}**"
            for kind, u in e["per_request"].items()), ""]
        t = e["throughput"]
        lines += [f"Throughput ({t['rounds']} rounds of {t['block_s']:g} s blocks, PNG uploads): direct "
                  f"{t['direct_docs_per_s']} docs/s, API at one client {t['api_docs_per_s']} "
                  f"(**{t['api_over_direct']}×**), API at two clients {t['api_c2_docs_per_s']} "
                  f"(**{t['api_c2_over_direct']}×** direct one at a time; errors {t['api_c2_errors']})", ""]
    if o := results.get("overhead"):
        lines += [f"## The serving stack alone (mock engine), {o['requests_per_payload']} requests per payload and "
                  "setting", "", *md_table(
                      ["payload", "body KiB", "setting", "client p50 ms", "client p95 ms", "ingress p50 ms",
                       "of which decode", "outside the ingress p50 ms", "client p50 saved ms"], "lrlrrrrrr",
                      [[name, row["body_kib"], mode, *(row[mode].get(k, "-") for k in (
                          "client_p50_ms", "client_p95_ms", "ingress_p50_ms", "ingress_decode_p50_ms",
                          "outside_ingress_p50_ms", "client_p50_saved_ms"))]
                       for name, row in o["payloads"].items() for mode in ["default", *o["variants"]]])]
        lines += ["", "HTTP port held by: " + "; ".join(f"{mode}: {', '.join(map(str, held))}"
                                                      for mode, held in o["http_listener"].items())]
        lines += ["Variants: " + "; ".join(f"{k}: {v}" for k, v in o["variants"].items())] if o["variants"] else []
        lines.append("")
    if results["errors"]:
        lines += ["Errors: " + "; ".join(results["errors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest bench cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--docs", type=int, default=6, help="A4 pages and as many ID cards (embedded)")
    parser.add_argument("--pair-rounds", type=int, default=3, help="times each upload is paired (embedded)")
    parser.add_argument("--rounds", type=int, default=2, help="direct/API block pairs (embedded); service starts "
                        "per setting (overhead)")
    parser.add_argument("--block-s", type=float, default=30.0, help="seconds of each throughput block (embedded)")
    parser.add_argument("--requests", type=int, default=40, help="sequential requests per payload (overhead)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL[:NAME=VALUE,...]",
                        help=f"overhead: also with these environment variables; presets {', '.join(PRESETS)}")
    parser.add_argument("--out", type=Path, default=Path("results/cpu"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    try:
        variants = parse_variants(args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    if set(parts) - set(PARTS) or min(args.docs, args.pair_rounds, args.rounds, args.requests) < 1:
        parser.error(f"--parts: a subset of {','.join(PARTS)}; --docs, --pair-rounds, --rounds, --requests ≥ 1")
    runners = {"embedded": lambda: bench_embedded(args.out, args.docs, args.pair_rounds, args.rounds, args.block_s),
               "overhead": lambda: bench_overhead(args.out, args.requests, args.rounds, variants)}
    results = new_results("bench cpu", argv, load_average=load_average(), errors=[])
    return run_parts(results, args.out, {part: runners[part] for part in parts}, report)


if __name__ == "__main__":
    raise SystemExit(main())
