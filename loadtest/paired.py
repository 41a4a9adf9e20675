"""Paired comparisons: the same work sent to several servers (arms) in alternation, so that a drift of the machine
(another tenant, clocks, caches) hits every arm alike and each round's difference keeps what the servers themselves
cost. `run_paired` sends each round's document to every arm, one request at a time, in a new random order;
`paired_summary` and `ratio_summary` give medians with bootstrap 95 % intervals over the rounds.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from loadtest.run import Request, Sample, Target, _send, _session, per_stage, percentile

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


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(float(value), digits)


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
