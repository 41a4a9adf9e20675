"""Confidence arithmetic and token ↔ character alignment (the real-engine check is in tests/engine/test_tasks_e2e.py)."""

from __future__ import annotations

import math

import pytest

from service.engine.protocol import EngineResult, TokenLogprob
from service.parsing.confidence import (document_confidence, geometric_mean_probability, span_confidence,
                                        token_spans)
from service.parsing.page import PageGeometry
from service.parsing.vlm import parse_vlm_output


def toks(*pairs):
    return [TokenLogprob(token=t, logprob=lp) for t, lp in pairs]


def test_geometric_mean():
    assert geometric_mean_probability([]) is None
    assert geometric_mean_probability([0.0, 0.0]) == 1.0
    assert geometric_mean_probability([math.log(0.5), math.log(0.125)]) == pytest.approx(0.25)
    assert geometric_mean_probability([-math.inf, 0.0]) == 0.0
    assert document_confidence(toks(("a", -1e-9))) <= 1.0
    assert 0 < document_confidence(toks(("a", -200.0))) < 1e-80  # tiny, but not rounded to 0


def test_alignment_exact_split_and_special_tokens():
    text = "ab发票c"
    tokens = toks(("a", -1), ("b", -1), ("\ufffd", -1), ("\ufffd", -1), ("票", -1), ("c", -1), ("</s>", -1))
    assert token_spans(text, tokens) == [(0, 1), (1, 2), (2, 3), (2, 3), (3, 4), (4, 5), (5, 5)]
    # a removed special token in the middle produces no characters
    assert token_spans("abc", toks(("a", 0), ("<｜x｜>", 0), ("bc", 0))) == [(0, 1), (1, 1), (1, 3)]


def test_span_confidence_uses_overlapping_tokens_only():
    tokens = toks(("<ref>", -0.1), ("Hel", -0.5), ("lo", -1.0), ("</ref>", -0.1), ("X", -3.0))
    text = "".join(t.token for t in tokens)
    spans = token_spans(text, tokens)
    assert span_confidence(spans, tokens, 5, 10) == pytest.approx(math.exp(-0.75), rel=1e-5)  # "Hello"
    assert span_confidence(spans, tokens, 0, 0) is None


def test_line_confidences_follow_their_tokens():
    pieces = [("<ref>", -0.01), ("sure", -0.02), ("</ref><quad>", -0.01), ("(1,2),(300,40)", -0.03), ("</quad>", -0.01),
              ("<ref>", -0.01), ("unsure", -2.5), ("</ref><quad>", -0.01), ("(1,50),(300,90)", -0.2),
              ("</quad>", -0.4)]
    tokens = toks(*pieces)
    raw = "".join(t for t, _ in pieces)
    parsed = parse_vlm_output("spotting", EngineResult(text=raw, tokens=tokens), PageGeometry(1000, 1000, 500, 500))
    first, second = parsed.lines
    assert first.confidence == pytest.approx(math.exp(sum(lp for _, lp in pieces[:5]) / 5), rel=1e-5)
    assert second.confidence == pytest.approx(math.exp(sum(lp for _, lp in pieces[5:]) / 5), rel=1e-5)
    assert first.confidence > second.confidence
    assert parsed.confidence == pytest.approx(math.exp(sum(lp for _, lp in pieces) / len(pieces)), rel=1e-5)
