"""Retry waits (job pages, webhook deliveries): exponential, capped, jittered, so that retries of work that failed
together do not arrive together."""

from __future__ import annotations

import random

import pytest

from service.jobs.backoff import retry_wait_s


@pytest.mark.parametrize("retry", range(8))
def test_each_wait_is_drawn_from_the_upper_half_of_its_capped_step(retry):
    rng = random.Random(retry)
    step = min(2.0, 0.25 * 2 ** retry)
    waits = [retry_wait_s(retry, 0.25, 2.0, rng) for _ in range(500)]
    assert all(step / 2 <= wait <= step for wait in waits)
    assert len(set(waits)) == len(waits)  # no two retries in lockstep
    # spread over the whole half-step, not bunched at one end
    assert min(waits) < step / 2 + step / 20 and max(waits) > step - step / 20


def recording(monkeypatch, module) -> list[tuple[int, float, float]]:
    """Replaces `module.retry_wait_s` with one that records (retry, wait, step) and waits a hundredth of it."""
    calls: list[tuple[int, float, float]] = []

    def wait(retry, base_s, cap_s, rng=None):
        drawn = retry_wait_s(retry, base_s, cap_s, rng)
        calls.append((retry, drawn, min(cap_s, base_s * 2 ** retry)))
        return drawn / 100

    monkeypatch.setattr(module, "retry_wait_s", wait)
    return calls
