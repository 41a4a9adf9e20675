"""Server-Sent Events: the one frame format of every stream (OCR results, job pages, OpenAI chunks), and the wait
for a stream's first event before its 200 goes out."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from service.errors import OCRError

KEEPALIVE = ": keepalive\n\n"


def sse(data: Any, event: str | None = None, event_id: int | None = None) -> str:
    """One event: `id:` (a resumable stream's position), `event:` (absent for OpenAI's unnamed chunks), `data:` as
    JSON (a string is sent as it is: OpenAI's `[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = (f"id: {event_id}\n" if event_id is not None else "") + (f"event: {event}\n" if event else "")
    return f"{head}data: {payload}\n\n"


async def first_event_then_rest(events: AsyncIterator[str], timeout_s: float) -> AsyncIterator[str]:
    """Waits for a stream's first event before its 200 goes out, so that a request refused or failed before any
    output (a corrupt page, an unknown adapter, all replicas busy, no engine) gets its own 4xx/5xx, as without
    `stream`, instead of a 200 whose only event is the error. The wait is bounded like a whole unstreamed request."""
    try:
        first = await asyncio.wait_for(anext(events), timeout_s)
    except TimeoutError:
        await events.aclose()
        raise OCRError("timeout", f"no engine output within {timeout_s:g}s; retry later") from None
    except BaseException:
        await events.aclose()
        raise

    async def first_then_rest() -> AsyncIterator[str]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()  # a client that went away: the engine stops generating for it

    return first_then_rest()
