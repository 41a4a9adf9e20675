"""Confidence from token logprobs (HunyuanOCR emits none of its own).

Formula (docs/API.md, "Confidence"): for a piece of output produced by tokens t_1..t_n with natural-log
probabilities lp_i of the sampled tokens,

    confidence = exp( (1/n) · Σ lp_i )        — the geometric mean of the token probabilities, in (0, 1]

* a line / layout element: the tokens whose characters overlap the item's span in the raw output (its markup,
  text and coordinates — everything the model wrote for that line);
* a field: the tokens overlapping the field's value in the raw JSON;
* the document: every output token the engine returned (the vLLM engine leaves out special tokens such as the
  end-of-sequence token, so the tokens concatenate to the text).
A token belongs to a span when its characters overlap it; tokens that produced no characters (special tokens) belong
to no line. No tokens → no confidence (None).

Token ↔ character alignment: tokens are the engine's decoded pieces, in order. Normally they concatenate to the raw
text exactly; pieces that do not (special tokens removed from the text, a multi-byte character split over tokens and
decoded as U+FFFD) are re-synchronised on the next piece that matches, and the unmatched pieces share the
characters in between.
"""

from __future__ import annotations

import math
from typing import Sequence

from service.engine.protocol import TokenLogprob

_RESYNC_WINDOW = 16  # characters searched ahead for a piece that did not match in place


def token_spans(text: str, tokens: Sequence[TokenLogprob]) -> list[tuple[int, int]]:
    """Character span [start, end) of each token in `text` (empty spans for tokens that produced no text)."""
    spans: list[tuple[int, int]] = []
    pending: list[int] = []  # tokens not yet placed (no in-place match)
    pos = 0

    def settle(upto: int) -> None:
        for index in pending:
            spans[index] = (pos, upto)
        pending.clear()

    for index, token in enumerate(tokens):
        piece = token.token
        spans.append((pos, pos))
        if not piece:
            continue
        if text.startswith(piece, pos):
            settle(pos)
            spans[index] = (pos, pos + len(piece))
            pos += len(piece)
            continue
        found = -1 if "\ufffd" in piece else text.find(piece, pos, pos + _RESYNC_WINDOW + len(piece))
        if found >= 0:
            settle(found)
            spans[index] = (found, found + len(piece))
            pos = found + len(piece)
        else:
            pending.append(index)
    if pending:
        # unplaced pieces at the end: they share what is left (partial character), else they produced nothing
        settle(len(text)) if pos < len(text) else settle(pos)
    return spans


def geometric_mean_probability(logprobs: Sequence[float]) -> float | None:
    """exp(mean(logprob)); None for no tokens. -inf/NaN logprobs count as probability 0."""
    if not logprobs:
        return None
    total = 0.0
    for lp in logprobs:
        if lp != lp or lp == -math.inf:  # NaN or -inf
            return 0.0
        total += min(lp, 0.0)
    return math.exp(total / len(logprobs))


def span_logprobs(spans: Sequence[tuple[int, int]], tokens: Sequence[TokenLogprob], start: int,
                  end: int) -> list[float]:
    """Logprobs of the tokens whose non-empty character span overlaps [start, end)."""
    return [tok.logprob for (a, b), tok in zip(spans, tokens) if a < b and a < end and b > start]


def span_confidence(spans: Sequence[tuple[int, int]], tokens: Sequence[TokenLogprob], start: int,
                    end: int) -> float | None:
    return _rounded(geometric_mean_probability(span_logprobs(spans, tokens, start, end)))


def document_confidence(tokens: Sequence[TokenLogprob] | None) -> float | None:
    if not tokens:
        return None
    return _rounded(geometric_mean_probability([t.logprob for t in tokens]))


def _rounded(value: float | None) -> float | None:
    # 6 significant digits keep the response compact and a tiny probability above 0
    return None if value is None else float(f"{value:.6g}")
