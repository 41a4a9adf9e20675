"""Repetition guard: a fake looping token stream is cut and flagged, a normal one is untouched (defaults of
HunyuanOCR 1.5: ≥ 8 repeats after 4000 characters)."""

from __future__ import annotations

import random

import pytest

from service.engine.protocol import EngineResult, TokenLogprob
from service.engine.repetition import RepetitionGuard, find_tail_loop, guard_result, keep_tokens
from service.config import Settings


def token_stream(text: str, rng: random.Random) -> list[str]:
    """Split text into token-like pieces of 1-6 characters."""
    pieces, pos = [], 0
    while pos < len(text):
        step = rng.randint(1, 6)
        pieces.append(text[pos:pos + step])
        pos += step
    return pieces


def normal_document(rng: random.Random, chars: int) -> str:
    words = ["invoice", "total", "发票", "金额", "<td>", "</td>", "| --- |", "1,234.56", "\n", "  "]
    out = []
    while sum(map(len, out)) < chars:
        out.append(rng.choice(words) + rng.choice([" ", "", str(rng.randint(0, 99999))]))
    return "".join(out)


@pytest.mark.parametrize("unit", ["ab", "<td></td>", "重复的文字 ", "| 1 | 2 |\n", "x" * 150])
def test_looping_stream_is_cut_and_flagged(unit):
    rng = random.Random(len(unit))
    prefix = normal_document(rng, 4200)
    text = prefix + unit * 60
    guard = RepetitionGuard()  # defaults: 4000 chars, 8 repeats, units ≤ 200, check every 64 chars
    fed = 0
    for piece in token_stream(text, rng):
        fed += len(piece)
        if guard.feed(piece):
            break
    assert guard.looping
    # stopped soon after the 8th copy: within one check interval plus one token
    assert fed <= len(prefix) + len(unit) * 9 + 64 + 6
    kept = guard.kept_text
    assert kept.startswith(prefix) and len(kept) <= len(prefix) + len(unit)
    assert guard.loop.repeats >= 8
    assert guard.feed("more") is True  # sticky


def test_normal_streams_are_untouched():
    for seed in range(20):
        rng = random.Random(seed)
        text = normal_document(rng, 20_000)
        guard = RepetitionGuard()
        assert not any(guard.feed(piece) for piece in token_stream(text, rng))
        assert guard.kept_text == text and guard.text == text


def test_short_outputs_and_whitespace_runs_never_count():
    guard = RepetitionGuard()
    assert not guard.feed("ab" * 1000)  # 2000 chars < 4000: HunyuanOCR's own guard does not look yet
    guard = RepetitionGuard(min_chars=10)
    assert not guard.feed("text" + " " * 500 + "\n" * 500)


def test_seven_repeats_are_not_a_loop():
    prefix = "p" + "".join(chr(0x4e00 + i) for i in range(4100))
    assert find_tail_loop(prefix + "unit! " * 7, min_repeats=8, max_unit_chars=200) is None
    loop = find_tail_loop(prefix + "unit! " * 8, min_repeats=8, max_unit_chars=200)
    assert loop is not None and loop.unit == "unit! " and loop.repeats == 8


def test_guard_result_trims_a_finished_output_and_its_tokens():
    settings = Settings(repetition_min_chars=100)
    text = "Header line\n" * 3 + "Total: 12.00\n" + "again and " * 100
    tokens = [TokenLogprob(token=p, logprob=-0.1) for p in token_stream(text, random.Random(1))]
    result = guard_result(EngineResult(text=text, tokens=tokens, output_tokens=len(tokens)), settings)
    assert result.finish_reason == "repetition"
    assert result.text.startswith("Header line\n" * 3 + "Total: 12.00\n") and result.text.count("again") == 1
    assert "".join(t.token for t in result.tokens).startswith(result.text)
    assert result.output_tokens == len(result.tokens) < len(tokens)
    untouched = EngineResult(text="Header line\n" * 30)
    assert guard_result(untouched, Settings(repetition_min_chars=10_000)) is untouched
    assert keep_tokens(None, 5) is None
