"""Headless load runner: closed loop (N clients, each sending its next request as soon as the last answered) or open
loop (Poisson arrivals at R requests/s), a sweep over N or R, time-bounded steps.

    python -m loadtest run --url http://127.0.0.1:8000 --workload mixed --mode closed --levels 1,4,16 \
        --duration 30 --slo-ms 3000 --out results/load

Per step, answers arriving in the window [start + warmup, start + duration] count: throughput is the successful ones
÷ the window, latency is end to end (request sent → whole body read), goodput the share within the SLO; requests in
flight at the end are cancelled and reported as `cancelled`, not as errors. Closed loop also gives
`docs_per_s_little` (clients ÷ mean latency, Little's law), which does not depend on where the window's edges fall.
Writes OUT/summary.json, OUT/summary.csv (one row per step) and OUT/summary.png (throughput and p95 latency).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from loadtest.documents import ID_CARD_FIELDS, MEDIUM_CHARS, GeneratedDocument, make_documents

# --- workloads ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One kind of request in a workload."""

    kind: str  # document kind: id_card | a4
    task: str  # API task; "auto" = extract for ID cards / text for pages, or what the engine supports
    max_tokens: int | None = None  # output token limit sent with the request (None = the task's default)
    fields: tuple[str, ...] | None = None  # extraction fields
    weight: int = 1


WORKLOADS: dict[str, tuple[Job, ...]] = {
    "id_card": (Job("id_card", "extract", 64, ID_CARD_FIELDS),),
    "a4": (Job("a4", "text", 512),),
    "a4_document": (Job("a4", "document", 512),),
    "mixed": (Job("id_card", "extract", 64, ID_CARD_FIELDS), Job("a4", "text", 512)),
}


@dataclass
class Request:
    """A ready-to-send request: body bytes are built once, before the clock starts."""

    job: Job
    document: GeneratedDocument
    body: bytes


# --- targets ------------------------------------------------------------------------------------------------------

BREAKDOWN_STAGES = ("decode", "queue", "preprocess", "first_token", "generate", "delivery", "parse")


class Answer(NamedTuple):  # what one answer says (Sample's fields of the same names)
    ok: bool
    error: str | None = None
    output_tokens: int | None = None
    engine_ms: float | None = None
    stages_ms: dict[str, float] | None = None
    handler_ms: float | None = None


@dataclass
class OCRTarget:
    """Our API: `POST /v1/ocr` with the image as a data URL."""

    api_key: str | None = None
    task_override: str | None = None
    path: str = "/v1/ocr"
    confidence: bool = True  # False: `confidence: false`, the engine computes no token logprobs

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key
                                                       else {})}

    def body(self, job: Job, document: GeneratedDocument) -> bytes:
        task = self.task_override or job.task
        payload: dict[str, Any] = {"image": document.data_url(), "task": task}
        if task == "extract":
            payload["fields"] = list(job.fields or ID_CARD_FIELDS)
        if job.max_tokens is not None:
            payload["max_tokens"] = job.max_tokens
        if not self.confidence:
            payload["confidence"] = False
        return json.dumps(payload).encode()

    def check(self, status: int, payload: bytes) -> Answer:
        if (data := _json_object(payload)) is None:
            return Answer(False, f"http_{status}")
        if status == 200:
            timings = data.get("timings_ms") or {}
            return Answer(True, None, (data.get("usage") or {}).get("output_tokens"), timings.get("engine"),
                          {k: v for k, v in timings.items() if k in BREAKDOWN_STAGES}, timings.get("total"))
        return Answer(False, (data.get("error") or {}).get("code") or f"http_{status}")


@dataclass
class OpenAIChatTarget:
    """Raw vLLM OpenAI server: `/v1/chat/completions`, the image as an `image_url` data URL, then the prompt text
    (`prompts`: the exact text the service sends per task). `fixed_output`: exactly max_tokens tokens (`ignore_eos` +
    `min_tokens`, as `bench_fixed_output_tokens`); `logprobs`: the sampled tokens' (the service's confidences)."""

    model: str
    prompts: dict[str, str]
    fixed_output: bool = True
    logprobs: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. the image processor backend
    path: str = "/v1/chat/completions"

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json"}

    def body(self, job: Job, document: GeneratedDocument) -> bytes:
        max_tokens = job.max_tokens or 1024
        payload: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": document.data_url()}},
                                         {"type": "text", "text": self.prompts[job.task]}]}]}
        if self.fixed_output:
            payload.update(ignore_eos=True, min_tokens=max_tokens)
        if self.logprobs:
            payload.update(logprobs=True, top_logprobs=0)
        if self.mm_processor_kwargs:
            payload["mm_processor_kwargs"] = self.mm_processor_kwargs
        return json.dumps(payload).encode()

    def check(self, status: int, payload: bytes) -> Answer:
        if status == 200 and (data := _json_object(payload)) is not None:
            return Answer(True, None, (data.get("usage") or {}).get("completion_tokens"))
        return Answer(False, f"http_{status}")


Target = OCRTarget | OpenAIChatTarget  # what a request is sent to: path, headers(), body(job, document), check()


def _json_object(payload: bytes) -> dict[str, Any] | None:
    """A response body as a JSON object; None when it is not one (proxy error pages, truncated bodies)."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def build_requests(target: Target, jobs: Iterable[Job], docs_per_job: int = 4, chars: int = MEDIUM_CHARS,
                   documents: dict[str, list[GeneratedDocument]] | None = None) -> list[Request]:
    """Requests interleaved by job weight (mixed workloads alternate kinds); documents are generated once per kind."""
    documents = documents if documents is not None else {}
    per_job: list[list[Request]] = []
    for job in jobs:
        if job.kind not in documents:
            documents[job.kind] = make_documents(job.kind, docs_per_job, chars=chars)
        reqs = [Request(job, doc, target.body(job, doc)) for doc in documents[job.kind][:docs_per_job]]
        per_job += [reqs] * job.weight
    out: list[Request] = []
    for i in range(max(len(r) for r in per_job)):
        out += [reqs[i % len(reqs)] for reqs in per_job]
    return out


# --- measurement --------------------------------------------------------------------------------------------------

@dataclass
class Sample:
    start_s: float  # seconds after the step began
    latency_s: float
    status: int  # HTTP status; 0 = no HTTP answer (connection error, client timeout)
    ok: bool
    error: str | None = None  # stable error code (our API) or http_<status>
    output_tokens: int | None = None
    engine_ms: float | None = None  # our API: timings_ms.engine, the engine's time
    stages_ms: dict[str, float] | None = None  # our API: the rest of timings_ms (queue, preprocess, first_token…)
    handler_ms: float | None = None  # our API: timings_ms.total, the API handler's own time, engine call included

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s


@dataclass
class StepResult:
    """One step of a sweep: its samples and their summary."""

    label: str  # target / workload
    mode: str  # closed | open
    level: float  # concurrency (closed) or offered requests/s (open)
    duration_s: float
    warmup_s: float
    samples: list[Sample] = field(default_factory=list, repr=False)
    cancelled: int = 0
    client_dropped: int = 0  # open loop: arrivals not sent because max_in_flight was reached

    def summary(self, slo_ms: float | None) -> dict[str, Any]:
        return summarise(self, slo_ms)


async def _send(session, url: str, target: Target, request: Request, t0: float, timeout_s: float) -> Sample:
    import aiohttp

    start = time.perf_counter()
    try:
        async with session.post(url, data=request.body, headers=target.headers(),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            payload = await resp.read()
        return Sample(start - t0, time.perf_counter() - start, resp.status, *target.check(resp.status, payload))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # connection refused/reset, client timeout: an error of this request
        return Sample(start - t0, time.perf_counter() - start, 0, False, f"client_{type(exc).__name__}")


def _session():
    import aiohttp

    # one keep-alive connection per in-flight request, as a client pool keeps them (no client-side queueing)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, enable_cleanup_closed=True))


async def run_closed(base_url: str, target: Target, requests: list[Request], concurrency: int, duration_s: float,
                     warmup_s: float, timeout_s: float = 600.0, label: str = "", min_answers: int = 0) -> StepResult:
    """`concurrency` clients send back to back until `duration_s`; in-flight requests are then cancelled.

    `min_answers`: the step goes on past `duration_s` (by at most `timeout_s`) until that many answers arrived
    after the warm-up, so slow servers still yield numbers; the summary's window is the real one."""
    url = base_url.rstrip("/") + target.path
    result = StepResult(label, "closed", concurrency, duration_s, warmup_s)
    counter = iter(range(10**12))
    async with _session() as session:
        t0 = time.perf_counter()

        def answered() -> int:
            return sum(1 for s in result.samples if s.end_s >= warmup_s)

        def more_wanted() -> bool:
            """Before `duration_s`; after it, while answers are missing (at most `timeout_s` more). Each client asks
            this itself, so none stops between the step's end and the check for missing answers."""
            elapsed = time.perf_counter() - t0
            return elapsed < duration_s or (answered() < min_answers and elapsed < duration_s + timeout_s)

        async def client() -> None:
            while more_wanted():
                request = requests[next(counter) % len(requests)]
                result.samples.append(await _send(session, url, target, request, t0, timeout_s))

        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=duration_s)
        while pending and more_wanted():
            _, pending = await asyncio.wait(pending, timeout=0.5)
        result.duration_s = round(time.perf_counter() - t0, 3)
        await _cancel(result, pending)
    return result


async def _cancel(result: StepResult, pending) -> None:
    """Cancel the requests still in flight at a step's end (the server aborts them); counted, not errors."""
    result.cancelled = len(pending)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def run_open(base_url: str, target: Target, requests: list[Request], rate: float, duration_s: float,
                   warmup_s: float, timeout_s: float = 600.0, max_in_flight: int = 2048, seed: int = 0,
                   label: str = "") -> StepResult:
    """Poisson arrivals at `rate`/s until `duration_s` (each sent whatever the others' latency); then cancel."""
    url = base_url.rstrip("/") + target.path
    result = StepResult(label, "open", rate, duration_s, warmup_s)
    rng = random.Random(seed)
    in_flight: set[asyncio.Task] = set()

    async def one(request: Request, t0: float) -> None:
        result.samples.append(await _send(session, url, target, request, t0, timeout_s))

    async with _session() as session:
        t0 = time.perf_counter()
        deadline, next_at, i = t0 + duration_s, t0 + rng.expovariate(rate), 0
        while next_at < deadline:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            if len(in_flight) >= max_in_flight:
                result.client_dropped += 1
            else:
                task = asyncio.create_task(one(requests[i % len(requests)], t0))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            i += 1
            next_at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
        await _cancel(result, [t for t in in_flight if not t.done()])
    return result


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None or math.isnan(value) else round(float(value), digits)


def summarise(step: StepResult, slo_ms: float | None) -> dict[str, Any]:
    """Numbers of one step over its measurement window (see the module docstring)."""
    window = max(1e-9, step.duration_s - step.warmup_s)
    counted = [s for s in step.samples if step.warmup_s <= s.end_s <= step.duration_s]
    ok = [s for s in counted if s.ok]
    latencies_ms = [s.latency_s * 1000 for s in ok]
    limited = sum(1 for s in counted if s.status == 429)
    errors = len(counted) - len(ok)
    out_tokens = sum(s.output_tokens or 0 for s in ok)
    engine_ms = [s.engine_ms for s in ok if s.engine_ms is not None]
    handled = [s for s in ok if s.handler_ms is not None]
    within_slo = sum(1 for ms in latencies_ms if slo_ms is None or ms <= slo_ms)
    # closed loop: clients ÷ mean latency × the share that succeeded (Little's law). Clients that start together
    # finish in waves, so a window a few latencies long counts whole waves or misses one; this does not
    mean_s = sum(s.latency_s for s in counted) / len(counted) if counted else 0.0
    little = step.level / mean_s * len(ok) / len(counted) if step.mode == "closed" and mean_s > 0 else None

    def share(n: int) -> float | None:
        return _round(n / len(counted), 4) if counted else None

    return {
        "label": step.label, "mode": step.mode, "level": step.level, "duration_s": step.duration_s,
        "window_s": round(window, 3), "answers": len(counted), "ok": len(ok), "errors": errors,
        "rate_limited": limited, "cancelled": step.cancelled, "client_dropped": step.client_dropped,
        "docs_per_s": _round(len(ok) / window, 3), "docs_per_s_little": _round(little, 3),
        "output_tokens_per_s": _round(out_tokens / window, 1),
        "output_tokens_mean": _round(out_tokens / len(ok), 1) if ok else None,
        "latency_ms_mean": _round(float(np.mean(latencies_ms)) if latencies_ms else None),
        **{f"latency_ms_p{q}": _round(percentile(latencies_ms, q)) for q in (50, 95, 99)},
        "latency_ms_max": _round(max(latencies_ms) if latencies_ms else None),
        # our API only: the engine's share of each answer, and where that time went (p50 per stage: queue before the
        # engine, preprocess and first token inside it)
        "engine_ms_p50": _round(percentile(engine_ms, 50)),
        "stages_ms_p50": per_stage(ok, lambda values: _round(percentile(values, 50))),
        # the API handler's whole time and what lay outside it (the HTTP front end: proxy, connection, waiting there)
        "handler_ms_p50": _round(percentile([s.handler_ms for s in handled], 50)),
        "outside_handler_ms_p50": _round(percentile([s.latency_s * 1000 - s.handler_ms for s in handled], 50)),
        "error_rate": share(errors), "rate_429": share(limited), "slo_ms": slo_ms, "goodput": share(within_slo),
        "error_codes": dict(Counter(s.error or "unknown" for s in counted if not s.ok)),
    }


async def warm_up(base_url: str, target: Target, requests: list[Request], count: int, concurrency: int = 1,
                  timeout_s: float = 900.0) -> list[Sample]:
    """Unmeasured requests (first-request compilation, caches), `concurrency` at a time; raises if none succeeded."""
    url = base_url.rstrip("/") + target.path
    async with _session() as session:
        t0 = time.perf_counter()
        samples: list[Sample] = []
        for start in range(0, count, concurrency):
            batch = [requests[i % len(requests)] for i in range(start, min(count, start + concurrency))]
            samples += await asyncio.gather(*(_send(session, url, target, r, t0, timeout_s) for r in batch))
    if count and not any(s.ok for s in samples):
        raise RuntimeError(f"warm-up failed at {url}: {[(s.status, s.error) for s in samples[:3]]}")
    return samples


def per_stage(samples: list[Sample], stat: Callable[[list[float]], Any]) -> dict[str, Any]:
    """`stat` of each breakdown stage's times over the samples that report it (our API's timings_ms)."""
    return {stage: stat(values) for stage in BREAKDOWN_STAGES
            if (values := [s.stages_ms[stage] for s in samples if s.stages_ms and stage in s.stages_ms])}


# --- paired comparisons: the same work sent to several servers (arms) in alternation -------------------------------
# A drift of the machine (another tenant, clocks, caches) hits every arm alike, so each round's difference keeps what
# the servers themselves cost; medians with bootstrap 95 % intervals over the rounds.

RESAMPLES = 2000


@dataclass
class Arm:
    """One side of a paired comparison: a server's URL, its client and its requests (the same documents in the same
    order as every other arm's)."""

    name: str
    base_url: str
    target: Target
    requests: list[Request]


async def run_paired(arms: list[Arm], duration_s: float, timeout_s: float = 900.0, seed: int = 0,
                     max_rounds: int | None = None) -> list[dict[str, Sample]]:
    """Rounds until `duration_s` (or `max_rounds`), each {arm name: sample}; a keep-alive connection per arm."""
    rng = random.Random(seed)
    sessions = {arm.name: _session() for arm in arms}
    order = list(arms)
    rounds: list[dict[str, Sample]] = []
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration_s and (max_rounds is None or len(rounds) < max_rounds):
            rng.shuffle(order)
            answers = {}
            for arm in order:
                request = arm.requests[len(rounds) % len(arm.requests)]
                answers[arm.name] = await _send(sessions[arm.name], arm.base_url.rstrip("/") + arm.target.path,
                                                arm.target, request, t0, timeout_s)
            rounds.append(answers)
    finally:
        for session in sessions.values():
            await session.close()
    return rounds




def _picks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n))


def _ci(resampled: np.ndarray, digits: int) -> list[float | None]:
    low, high = np.percentile(resampled, [2.5, 97.5])
    return [_round(low, digits), _round(high, digits)]


def ratio_summary(ratios: Sequence[float], seed: int = 0, digits: int = 3) -> dict[str, Any]:
    """Per-round ratios (e.g. docs/s of alternating blocks): their median, mean and the bootstrap 95 % interval of
    the median."""
    values = np.asarray([r for r in ratios if r is not None and np.isfinite(r)], dtype=float)
    if not len(values):
        return {"n": 0, "median": None, "mean": None, "ci95": [None, None], "rounds": []}
    medians = np.median(values[_picks(len(values), seed)], axis=1)
    return {"n": len(values), "median": _round(np.median(values), digits), "mean": _round(values.mean(), digits),
            "ci95": _ci(medians, digits), "rounds": [_round(v, digits) for v in values]}


def paired_summary(rounds: list[dict[str, Sample]], names: list[str], seed: int = 0) -> dict[str, Any]:
    """Rounds of `run_paired` over `names` (the first is the reference). Per arm over the rounds every arm answered:
    latency p50/mean/p95 and the p50s of the server's own timings where it reports them (engine, API handler, what
    lay outside the handler). Per arm after the first: its per-round latency minus the reference's (median and mean
    with intervals) and its docs/s at one client against the reference's (mean latency ÷ mean latency)."""
    complete = [r for r in rounds if all(r[name].ok for name in names)]
    ms = {name: np.asarray([r[name].latency_s * 1000 for r in complete]) for name in names}
    out: dict[str, Any] = {"rounds": len(rounds), "complete_rounds": len(complete), "reference": names[0],
                           "arms": {}, "against_reference": {},
                           "rounds_ms": {name: [_round(v, 2) for v in ms[name]] for name in names}}
    for name in names:
        samples = [r[name] for r in complete]
        handled = [s for s in samples if s.handler_ms is not None]
        out["arms"][name] = {
            "errors": sum(not r[name].ok for r in rounds),
            "p50_ms": _round(percentile(list(ms[name]), 50)), "mean_ms": _round(ms[name].mean() if len(ms[name])
                                                                                 else None),
            "p95_ms": _round(percentile(list(ms[name]), 95)),
            "engine_p50_ms": _round(percentile([s.engine_ms for s in samples if s.engine_ms is not None], 50)),
            "handler_p50_ms": _round(percentile([s.handler_ms for s in handled], 50)),
            "outside_handler_p50_ms": _round(percentile([s.latency_s * 1000 - s.handler_ms for s in handled], 50)),
            "stages_ms_mean": per_stage(samples, lambda values: _round(np.mean(values))),
            "output_tokens_mean": _round(np.mean(t) if (t := [s.output_tokens for s in samples
                                                               if s.output_tokens]) else None),
        }
    if len(complete) < 2:
        return out
    picks = _picks(len(complete), seed)
    reference = ms[names[0]]
    for name in names[1:]:
        deltas = ms[name] - reference
        out["against_reference"][name] = {
            "median_ms": _round(np.median(deltas)), "ci95_ms": _ci(np.median(deltas[picks], axis=1), 1),
            "mean_ms": _round(deltas.mean()), "mean_ci95_ms": _ci(deltas[picks].mean(axis=1), 1),
            "docs_per_s_ratio": _round(reference.mean() / ms[name].mean(), 3),
            "docs_per_s_ratio_ci95": _ci(reference[picks].mean(axis=1) / ms[name][picks].mean(axis=1), 3),
        }
    return out


def interval_text(value: Any, ci: Sequence[Any], unit: str = "", sign: bool = False) -> str:
    """`+6.2 ms (+4.1 … +8.0)`: a value with its interval, for reports."""
    if value is None:
        return "-"
    fmt = (lambda v: f"{v:+g}") if sign else (lambda v: f"{v:g}")
    return f"{fmt(value)}{unit} ({fmt(ci[0])} … {fmt(ci[1])})" if None not in ci else f"{fmt(value)}{unit}"


# --- output -------------------------------------------------------------------------------------------------------

CSV_COLUMNS = ["label", "mode", "level", "window_s", "answers", "ok", "errors", "rate_limited", "cancelled",
               "docs_per_s", "docs_per_s_little", "output_tokens_per_s", "latency_ms_mean", "latency_ms_p50",
               "latency_ms_p95", "latency_ms_p99", "error_rate", "rate_429", "slo_ms", "goodput"]


def write_outputs(out_dir: Path, steps: list[dict[str, Any]], meta: dict[str, Any], *, plot: bool = True) -> dict:
    """summary.json + summary.csv (+ summary.png); returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "summary.json", "csv": out_dir / "summary.csv"}
    paths["json"].write_text(json.dumps({**meta, "steps": steps}, indent=2, default=str))
    with paths["csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(steps)
    if plot:
        try:
            plot_steps(steps, out_dir / "summary.png", title=meta.get("title", "load test"))
            paths["png"] = out_dir / "summary.png"
        except ImportError:  # matplotlib missing (e.g. the GPU machine): the JSON and CSV hold the numbers
            print("summary.png skipped: matplotlib is not installed", flush=True)
    return paths


def plot_steps(steps: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Throughput (solid, left axis) and p95 latency (dashed, right axis) against the sweep level, one colour per
    target/workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(s["label"] for s in steps))
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    ax2 = ax.twinx()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, label in enumerate(labels):
        rows = sorted((s for s in steps if s["label"] == label), key=lambda s: s["level"])
        xs = [s["level"] for s in rows]
        colour = colours[i % len(colours)]
        ax.plot(xs, [s["docs_per_s"] or 0 for s in rows], "o-", color=colour, label=f"{label} docs/s")
        ax2.plot(xs, [s["latency_ms_p95"] if s["latency_ms_p95"] is not None else float("nan") for s in rows],
                 "s--", color=colour, alpha=0.7, label=f"{label} p95 ms")
    modes = {s["mode"] for s in steps}
    ax.set(xlabel="concurrency (clients)" if modes == {"closed"} else "offered load (requests/s)"
           if modes == {"open"} else "concurrency / offered load", ylabel="throughput (docs/s)", ylim=(0, None))
    ax2.set(ylabel="p95 latency (ms)", ylim=(0, None))
    if steps and max(s["level"] for s in steps) / max(1e-9, min(s["level"] for s in steps)) >= 16:
        ax.set_xscale("log", base=2)
    (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_step(summary: dict[str, Any]) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    print(f"  {summary['label']:<28} {summary['mode']:<6} {summary['level']:>7g}  {summary['docs_per_s']:>8.2f} docs/s"
          f"  p50 {fmt(summary['latency_ms_p50']):>6} p95 {fmt(summary['latency_ms_p95']):>6} "
          f"p99 {fmt(summary['latency_ms_p99']):>6} ms  ok {summary['ok']:>5}  err {summary['errors']}"
          f"  429 {summary['rate_limited']}  goodput {summary['goodput']}", flush=True)


# --- CLI ----------------------------------------------------------------------------------------------------------


def resolve_task(base_url: str, task: str | None) -> str | None:
    """`--task auto`: keep each job's task on a VLM engine; on the embedded engine (spotting/text only) use `text`."""
    if task not in (None, "auto"):
        return task
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/readyz", timeout=10) as resp:
            ready = json.loads(resp.read())
    except Exception:  # not our service or not ready: keep the workload's tasks
        return None
    return "text" if ready.get("engine") == "embedded" else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the service")
    p.add_argument("--api-key", help="API key (Authorization: Bearer ...); default: none (open mode)")
    p.add_argument("--no-confidence", action="store_true", help="send `confidence: false` (no token logprobs)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    p.add_argument("--task", default="auto", help="task for every request; `auto` = the workload's (extract for ID "
                   "cards, text for A4) or `text` on the embedded engine")
    p.add_argument("--mode", choices=["closed", "open"], default="closed")
    p.add_argument("--levels", default="1,2,4,8", help="comma-separated concurrencies (closed) or requests/s (open)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per step")
    p.add_argument("--warmup", type=float, default=None, help="unmeasured seconds at each step's start (default "
                   "20%% of --duration)")
    p.add_argument("--warmup-requests", type=int, default=2, help="unmeasured requests before the first step")
    p.add_argument("--min-answers", type=int, default=0, help="closed loop: extend a step past --duration until "
                   "this many answers arrived after its warm-up (slow servers; bounded by --timeout)")
    p.add_argument("--slo-ms", type=float, default=3000.0, help="end-to-end latency objective for goodput")
    p.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, seconds")
    p.add_argument("--chars", type=int, default=MEDIUM_CHARS, help="characters of text per A4 page")
    p.add_argument("--docs", type=int, default=4, help="different documents per document kind")
    p.add_argument("--max-tokens", type=int, default=None, help="override the output token limit of every job")
    p.add_argument("--out", type=Path, default=Path("results/load"), help="output directory")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return asyncio.run(_main(p.parse_args(argv)))


async def _main(args: argparse.Namespace) -> int:
    from loadtest.common import environment_facts

    jobs = WORKLOADS[args.workload]
    if args.max_tokens is not None:
        jobs = tuple(Job(j.kind, j.task, args.max_tokens, j.fields, j.weight) for j in jobs)
    target = OCRTarget(api_key=args.api_key, task_override=resolve_task(args.url, args.task),
                       confidence=not args.no_confidence)
    requests = build_requests(target, jobs, docs_per_job=args.docs, chars=args.chars)
    warmup_s = args.warmup if args.warmup is not None else 0.2 * args.duration
    label = f"{args.workload}/{target.task_override or '+'.join(sorted({j.task for j in jobs}))}"
    print(f"load test: {args.url} {label} {args.mode} levels {args.levels} ({args.duration:g}s steps, "
          f"{warmup_s:g}s warm-up)", flush=True)
    await warm_up(args.url, target, requests, args.warmup_requests)
    steps: list[dict[str, Any]] = []
    meta = {"title": f"{label} — {args.mode} loop", "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "url": args.url,
            "workload": args.workload, "jobs": [asdict(j) for j in jobs], "task_override": target.task_override,
            "chars_per_page": args.chars, "environment": environment_facts(),
            "args": {k: str(v) for k, v in vars(args).items() if k != "api_key"}}
    for level in (float(x) for x in args.levels.split(",") if x.strip()):
        if args.mode == "closed":
            step = await run_closed(args.url, target, requests, int(level), args.duration, warmup_s, args.timeout,
                                    label, args.min_answers)
        else:
            step = await run_open(args.url, target, requests, level, args.duration, warmup_s, args.timeout,
                                  label=label)
        steps.append(step.summary(args.slo_ms))
        print_step(steps[-1])
        write_outputs(args.out, steps, meta, plot=False)  # partial results survive an interrupted run
        await asyncio.sleep(1.0)  # cancelled requests are aborted server-side before the next step
    paths = write_outputs(args.out, steps, meta, plot=not args.no_plot)
    print("wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    return 0 if all(s.get("ok", 0) > 0 for s in steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
