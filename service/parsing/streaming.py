"""Streaming output on the ingress (`stream: true`): SSE events while the model writes, and the repetition guard.

Events, in order (each `event: NAME` + `data: JSON`):
* `delta`  {"text": "…"}                      — every piece of raw output as it arrives (markdown, HTML, … grow here);
* `line`   {"index": i, "line": Line}         — spotting/layout: a line as soon as it is complete, in pixels of the
                                                uploaded image, with its confidence;
* `result` OCRResponse                        — the final, authoritative result (same as the non-streaming response);
* `error`  {"error": {"code", "message"}}      — instead of `result` when the request failed midway.

The repetition guard (service.engine.repetition) watches the deltas. When the tail loops, no more events are sent;
an engine that guards itself (vLLM) ends its stream with its own cut result right after the same delta, which is
used as is. An engine that does not is given `GRACE_DELTAS` more deltas, then the ingress stops reading (closing the
stream aborts the generation) and builds the result itself: output up to the loop, `finish_reason: "repetition"`.
"""

from __future__ import annotations

import time

from service.schema import Line
from service.engine.protocol import EngineDelta, EngineResult, TokenLogprob
from service.parsing.confidence import token_spans
from service.engine.repetition import RepetitionGuard, keep_tokens
from service.parsing.page import PageGeometry
from service.parsing.spotting import IncrementalSpotting
from service.parsing.vlm import lines_from_items
from service.tasks import TASKS

GRACE_DELTAS = 4  # deltas to wait for the engine's own repetition cut (it comes right after the looping delta)


class OutputStream:
    """Turns engine deltas into SSE event payloads; knows when the output loops."""

    def __init__(self, task: str, geom: PageGeometry, settings, *, generative: bool = True):
        self.geom = geom
        # only generative engines loop; a detector+recogniser (embedded) may legitimately repeat lines
        self.guard = RepetitionGuard.from_settings(settings) if generative else RepetitionGuard(min_chars=0)
        self.spotter = IncrementalSpotting() if task in TASKS and TASKS[task].output == "lines" else None
        self.tokens: list[TokenLogprob] = []
        self.generated = 0  # output tokens the engine reported (EngineDelta.token_count), past the loop too
        self.lines_sent = 0
        self.started = time.perf_counter()
        self._grace = GRACE_DELTAS

    @property
    def looping(self) -> bool:
        return self.guard.looping

    @property
    def stop_reading(self) -> bool:
        """Looping, and the engine had its chance to end the stream with its own cut."""
        return self.guard.looping and self._grace <= 0

    def feed(self, delta: EngineDelta) -> list[tuple[str, dict]]:
        """Events for one delta (the final delta gives none: the caller builds the `result`)."""
        events: list[tuple[str, dict]] = []
        self.generated += delta.token_count
        if self.guard.looping:  # nothing past the loop is sent
            self._grace -= 1
            return events
        if delta.tokens:
            self.tokens.extend(delta.tokens)
        if not delta.text:
            return events
        events.append(("delta", {"text": delta.text}))
        self.guard.feed(delta.text)
        if self.spotter is not None:
            items = self.spotter.feed(delta.text)
            if items:
                spans = token_spans(self.spotter.text, self.tokens) if self.tokens else None
                lines, _ = lines_from_items(items, self.geom, self.tokens or None, spans)
                for line in lines:
                    events.append(("line", {"index": self.lines_sent, "line": _dump(line)}))
                    self.lines_sent += 1
        return events

    def cut_result(self) -> EngineResult:
        """The result after the guard stopped the stream: output up to the loop, finish_reason `repetition`. Its
        output_tokens are the kept tokens when logprobs came with the deltas, else what the engine generated (as
        for a finished result cut by `guard_result`)."""
        kept = self.guard.kept_chars
        tokens = keep_tokens(self.tokens, kept) if self.tokens else None
        return EngineResult(
            text=self.guard.kept_text, tokens=tokens, finish_reason="repetition",
            output_tokens=len(tokens) if tokens is not None else self.generated,
            engine_ms=(time.perf_counter() - self.started) * 1000,
        )


def _dump(line: Line) -> dict:
    return line.model_dump(mode="json")
