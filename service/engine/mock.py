"""Deterministic engine for tests of the layers above the seam (and autoscaling tests via `delay_s`).

It behaves like a VLM engine: it decodes PNG pages as the real engines do (a corrupt one is `invalid_image`), and
answers every task with raw HunyuanOCR-style text and token logprobs, so the parsing layer sees the same shapes as
with vLLM. A `responder` callable can script outputs per request.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, AsyncIterator, Callable

from service.engine.protocol import EngineDelta, EngineInfo, EngineRequest, EngineResult, TokenLogprob
from service.errors import OCRError
from service.tasks import TASKS

Responder = Callable[[EngineRequest], str]


def default_responder(request: EngineRequest) -> str:
    if request.task in ("spotting", "layout"):
        return "<ref>MOCK LINE ONE</ref><quad>(100,100),(600,180)</quad><ref>mock line two</ref><quad>(100,300),(500,360)</quad>"
    if request.task == "extract":
        return '{"mock": "value"}'
    return "MOCK LINE ONE\nmock line two"


class MockEngine:
    name = "mock"

    def __init__(self, *, delay_s: float = 0.0, responder: Responder | None = None, adapters: list[str] | None = None,
                 model_name: str = "mock-ocr", start_delay_s: float = 0.0):
        self.delay_s = delay_s
        self.start_delay_s = start_delay_s  # × the Serve replica's rank: replicas come up one after another
        self.responder = responder or default_responder
        self.adapters = set(adapters or [])  # known (the vLLM engine's adapters_dir and registered ones)
        self.loaded = set(self.adapters)  # held in the LoRA cache
        self.model_name = model_name
        self.requests: list[EngineRequest] = []  # what reached the engine, for assertions
        self.fail_next = 0  # raise RuntimeError for the next N requests (retry tests)

    async def start(self) -> None:
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s * _replica_rank())

    async def generate(self, request: EngineRequest) -> EngineResult:
        final = None
        async for delta in self.stream(request):
            final = delta.final
        assert final is not None
        return final

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if request.task not in TASKS:
            raise OCRError("unsupported_task", f"task {request.task!r} is not supported by the mock engine")
        if request.adapter and request.adapter not in self.adapters:
            raise OCRError("unknown_adapter", f"adapter {request.adapter!r} does not exist")
        if request.image_png is not None:
            # as the real engines do (EngineRequest.pil_image): the ingress may leave a bare PNG's pixels to us
            await asyncio.to_thread(request.pil_image)
        self.requests.append(request)
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("injected engine failure")
        started = time.perf_counter()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.responder(request)
        # one "token" per 4 characters with a deterministic, varying probability
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)][: request.max_tokens]
        tokens = [TokenLogprob(token=p, logprob=math.log(0.80 + 0.19 * ((i * 7919) % 100) / 100))
                  for i, p in enumerate(pieces)]
        for token in tokens:
            yield EngineDelta(text=token.token, tokens=[token] if request.logprobs else None, token_count=1)
        finish = "length" if len(pieces) * 4 < len(text) else "stop"
        yield EngineDelta(final=EngineResult(
            text="".join(pieces), tokens=tokens if request.logprobs else None, finish_reason=finish, prompt_tokens=32,
            image_tokens=0, output_tokens=len(tokens), engine_ms=(time.perf_counter() - started) * 1000,
            rendered_prompt=request.prompt,
        ))

    async def check_health(self) -> None:
        return None

    async def info(self) -> EngineInfo:
        # both forms, like the vLLM engine, so tests of the layers above can use either transport
        return EngineInfo(name=self.name, model=self.model_name, supported_tasks=sorted(TASKS),
                          adapters=sorted(self.adapters), adapters_supported=True,
                          image_transports=["pixels", "png"])

    async def list_adapters(self) -> list[str]:
        return sorted(self.adapters)

    async def adapter_status(self) -> list[dict[str, Any]]:
        return [{"name": name, "loaded": name in self.loaded} for name in sorted(self.adapters)]

    async def load_adapter(self, name: str, path: str | None = None) -> None:
        if path is None and name not in self.adapters:
            raise OCRError("unknown_adapter", f"adapter {name!r} does not exist")
        self.adapters.add(name)
        self.loaded.add(name)

    async def unload_adapter(self, name: str) -> None:
        """As the vLLM engine: frees the slot; the adapter stays known (a later request loads it again)."""
        if name not in self.adapters:
            raise OCRError("unknown_adapter", f"adapter {name!r} does not exist")
        self.loaded.discard(name)

    async def shutdown(self) -> None:
        return None


def _replica_rank() -> int:
    """This Serve replica's rank in its deployment; 0 outside Serve."""
    try:
        from ray import serve

        rank = serve.get_replica_context().rank
    except Exception:  # not in a Serve replica
        return 0
    return int(getattr(rank, "rank", rank) or 0)
