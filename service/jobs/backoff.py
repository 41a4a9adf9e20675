"""Waits between retries (job pages, webhook deliveries): exponential, capped, with jitter.

Without jitter every page of a job that failed together (an engine replica that died under them), and every
webhook of jobs that ended together, would retry in lockstep and hit the recovering engine or receiver at the same
instant. Each wait is drawn uniformly from the upper half of the exponential step ("equal jitter"): retries spread
out, and a receiver that is down still gets at least half the step between two attempts.
"""

from __future__ import annotations

import random


def retry_wait_s(retry: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number `retry` (0 = the first retry): in [step/2, step] where
    step = min(cap_s, base_s * 2**retry)."""
    step = min(cap_s, base_s * 2 ** retry)
    return step / 2 + (rng or random).uniform(0, step / 2)
