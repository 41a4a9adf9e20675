"""Repetition guard: notice when greedy decoding is stuck repeating its tail, so the generation can be aborted.

HunyuanOCR (1.0 and 1.5) can loop under greedy decoding; its 1.5 clients stop a stream once the output passed 4000
characters and its tail is one unit repeated ≥ 8 times (`has_tail_repetition`, inference/utils/output_utils.py).
This guard does the same, with thresholds from settings (`repetition_min_chars`, `repetition_min_repeats`,
`repetition_max_unit_chars`, `repetition_check_every_chars`; `repetition_min_chars` 0 disables it).

Use while streaming (the vLLM engine's generation loop, and the ingress SSE path):

    guard = RepetitionGuard.from_settings(settings)
    async for piece in generation:          # text deltas, in order
        if guard.feed(piece):                # True once the tail loops (and from then on)
            abort the generation
            text = guard.kept_text           # the output with the loop cut: one copy of the unit kept
            finish_reason = "repetition"     # + a warning in the response; count it in metrics
            break

`feed` is cheap: it checks at most every `check_every_chars` new characters, and a check costs
`max_unit_chars` slice comparisons. `kept_chars` is the length of the good prefix (token logprobs past it are
dropped with `keep_tokens`). For an output that is already complete, `trim_repetition(text, …)` applies the same
test once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from service.engine.protocol import EngineResult, TokenLogprob

REPETITION_WARNING = "the model started repeating itself; output was cut where the repetition began"


@dataclass
class Loop:
    unit: str  # the repeating unit
    repeats: int  # how many times it repeats at the tail
    kept_chars: int  # length of the text to keep (up to and including the first copy of the unit)


def find_tail_loop(text: str, *, min_repeats: int, max_unit_chars: int) -> Loop | None:
    """The shortest unit that the tail of `text` repeats ≥ min_repeats times (whitespace-only units ignored)."""
    n = len(text)
    upper = min(max_unit_chars, n // min_repeats)
    for length in range(1, upper + 1):
        window = length * min_repeats
        # a tail of `min_repeats` copies of a unit of `length` is a string with period `length`
        if text[n - window:n - length] != text[n - window + length:n]:
            continue
        unit = text[n - length:]
        if not unit.strip():
            continue
        repeats = min_repeats
        start = n - window
        while start >= length and text[start - length:start] == unit:
            repeats += 1
            start -= length
        return Loop(unit, repeats, n - length * (repeats - 1))
    return None


def _extend_backwards(full: str, tail_start: int, loop: Loop) -> Loop:
    """The loop may go back further than the checked tail: keep only its first copy."""
    length = len(loop.unit)
    start = tail_start + loop.kept_chars - length  # first copy found inside the tail
    while start >= length and full[start - length:start] == full[start:start + length]:
        start -= length
    while start > 0 and full[start - 1] == full[start - 1 + length]:
        start -= 1  # the periodic run may begin mid-unit: keep one whole period from its true start
    return Loop(full[start:start + length], (len(full) - start) // length, start + length)


class RepetitionGuard:
    """Incremental tail-loop detector; see the module docstring for the calling pattern."""

    def __init__(self, *, min_chars: int = 4000, min_repeats: int = 8, max_unit_chars: int = 200,
                 check_every_chars: int = 64):
        self.min_chars = min_chars
        self.min_repeats = min_repeats
        self.max_unit_chars = max_unit_chars
        self.check_every_chars = check_every_chars
        self._parts: list[str] = []
        self._length = 0
        self._next_check = min_chars
        self.loop: Loop | None = None

    @classmethod
    def from_settings(cls, settings) -> "RepetitionGuard":
        return cls(min_chars=settings.parsing.repetition_min_chars, min_repeats=settings.parsing.repetition_min_repeats,
                   max_unit_chars=settings.parsing.repetition_max_unit_chars,
                   check_every_chars=settings.parsing.repetition_check_every_chars)

    @property
    def looping(self) -> bool:
        return self.loop is not None

    @property
    def text(self) -> str:
        """Everything fed so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def kept_chars(self) -> int:
        return self.loop.kept_chars if self.loop else self._length

    @property
    def kept_text(self) -> str:
        return self.text[:self.kept_chars]

    def feed(self, delta_text: str) -> bool:
        """Add streamed text; True when the output is looping (stays True)."""
        if self.loop is not None or not delta_text or self.min_chars <= 0:
            return self.loop is not None
        self._parts.append(delta_text)
        self._length += len(delta_text)
        if self._length >= self._next_check:
            self._next_check = self._length + self.check_every_chars
            # only the tail can hold the loop: min_repeats + 1 units of the longest size, plus the new text
            tail_chars = self.max_unit_chars * (self.min_repeats + 1) + len(delta_text)
            full = self.text
            tail_start = max(0, len(full) - tail_chars)
            loop = find_tail_loop(full[tail_start:], min_repeats=self.min_repeats,
                                  max_unit_chars=self.max_unit_chars)
            if loop is not None:
                loop = _extend_backwards(full, tail_start, loop)
                self.loop = loop
        return self.loop is not None


def keep_tokens(tokens: Sequence[TokenLogprob] | None, kept_chars: int) -> list[TokenLogprob] | None:
    """The tokens that wrote the first `kept_chars` characters (their pieces concatenate to the text)."""
    if tokens is None:
        return None
    kept: list[TokenLogprob] = []
    used = 0
    for token in tokens:
        if used >= kept_chars:
            break
        kept.append(token)
        used += len(token.token)
    return kept


def trim_repetition(text: str, settings) -> Loop | None:
    """One check of a complete output (engines that could not guard while generating)."""
    if settings.parsing.repetition_min_chars <= 0 or len(text) < settings.parsing.repetition_min_chars:
        return None  # 0 disables the guard
    tail_start = max(0, len(text) - settings.parsing.repetition_max_unit_chars * (settings.parsing.repetition_min_repeats + 1))
    loop = find_tail_loop(text[tail_start:], min_repeats=settings.parsing.repetition_min_repeats,
                          max_unit_chars=settings.parsing.repetition_max_unit_chars)
    return None if loop is None else _extend_backwards(text, tail_start, loop)


def guard_result(result: EngineResult, settings) -> EngineResult:
    """Cut a finished result whose tail loops (no-op if the engine already cut it or it does not loop)."""
    if result.finish_reason == "repetition" or result.lines is not None:
        return result
    loop = trim_repetition(result.text, settings)
    if loop is None:
        return result
    tokens = keep_tokens(result.tokens, loop.kept_chars)
    return result.model_copy(update={
        "text": result.text[:loop.kept_chars], "tokens": tokens, "finish_reason": "repetition",
        "output_tokens": len(tokens) if tokens is not None else result.output_tokens,
    })
