"""Deterministic engine for tests of the layers above the seam (and autoscaling tests via `delay_s`).

It behaves like a VLM engine: it decodes PNG pages as the real engines do (a corrupt one is `invalid_image`), and
answers every task with raw HunyuanOCR-style text and token logprobs, so the parsing layer sees the same shapes as
with vLLM. A `responder` callable can script outputs per request.

With a `StepModel` (setting `mock_time_scale`) its time is that of one vLLM engine on one GPU: requests share
engine steps as vLLM's continuous batching does (`BatchScheduler`), each step taking the time the model fitted to
the H200's measured steps gives it (docs/design/scaling-model.md). Scaling, placement and autoscaling tests then see
a replica's throughput grow with its batch and saturate as a GPU's does, without a GPU.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from service.admission.budget import image_tokens_for, prompt_token_bound

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


@dataclass(frozen=True)
class StepModel:
    """Wall time of one engine step: `step_ms + prefill_ms_per_token × prompt tokens prefilled in the step +
    context_ms_per_token × context tokens of the sequences decoding in it` (each decoding sequence reads its whole
    KV cache); before its first step a page spends `render_ms_per_image_token × image tokens` in the engine's
    render pool, beside the steps. Defaults: fitted to HunyuanOCR on vLLM 0.26 on one H200
    (docs/design/scaling-model.md)."""

    step_ms: float = 2.36
    prefill_ms_per_token: float = 0.0216
    context_ms_per_token: float = 0.0000086
    render_ms_per_image_token: float = 0.046
    max_num_seqs: int = 256  # vLLM's: sequences in one step
    max_batched_tokens: int = 8192  # vLLM's chunked-prefill budget: tokens in one step

    def step_time_ms(self, prefill_tokens: int, context_tokens: int) -> float:
        return self.step_ms + self.prefill_ms_per_token * prefill_tokens + self.context_ms_per_token * context_tokens


@dataclass
class Sequence:
    prompt_tokens: int
    output_tokens: int
    prefilled: int = 0  # prompt tokens through prefill so far
    generated: int = 0
    done: asyncio.Future | None = field(default=None, repr=False)

    @property
    def context(self) -> int:
        return self.prefilled + self.generated


class BatchScheduler:
    """vLLM's continuous batching in miniature: every step decodes one token of each running sequence and spends the
    rest of the token budget on prompts waiting for prefill (chunked, oldest first, at most `max_num_seqs` running);
    a sequence's first token comes with the step that ends its prefill. `step()` plans and applies one step and
    returns its time in ms; `run()` drives it on the event loop, `time_scale` × real time."""

    def __init__(self, model: StepModel, time_scale: float = 1.0):
        self.model, self.time_scale = model, time_scale
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def step(self) -> tuple[float, list[Sequence]]:
        """One engine step: (its time in ms, the sequences it finished)."""
        decoding = [s for s in self.running if s.prefilled == s.prompt_tokens]
        budget = self.model.max_batched_tokens - len(decoding)
        while self.waiting and len(self.running) < self.model.max_num_seqs:
            self.running.append(self.waiting.popleft())
        prefill = 0
        for seq in self.running:
            if seq.prefilled < seq.prompt_tokens and budget > 0:
                chunk = min(budget, seq.prompt_tokens - seq.prefilled)
                seq.prefilled += chunk
                budget -= chunk
                prefill += chunk
                if seq.prefilled == seq.prompt_tokens:
                    seq.generated += 1  # the first token comes with the end of the prefill
        context = sum(s.context for s in decoding)
        for seq in decoding:
            seq.generated += 1
        finished = [s for s in self.running if s.generated >= s.output_tokens]
        self.running = [s for s in self.running if s.generated < s.output_tokens]
        return self.model.step_time_ms(prefill, context), finished

    async def generate(self, prompt_tokens: int, output_tokens: int, image_tokens: int = 0) -> None:
        """Wait until a sequence of this size has been rendered and gone through the engine's steps."""
        render_s = self.model.render_ms_per_image_token * image_tokens * self.time_scale / 1000
        if render_s:
            await asyncio.sleep(render_s)
        seq = Sequence(max(1, prompt_tokens), max(1, output_tokens), done=asyncio.get_running_loop().create_future())
        self.add(seq)
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run())
        self._wake.set()
        await seq.done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()
            step_ms, finished = self.step()
            # a clock of planned step ends, so that the loop's late wake-ups do not add up over steps
            clock += step_ms * self.time_scale / 1000
            await asyncio.sleep(max(0.0, clock - loop.time()))
            for seq in finished:
                if not seq.done.done():
                    seq.done.set_result(None)


def simulate_closed_loop(model: StepModel, clients: int, prompt_tokens: int, output_tokens: int,
                         image_tokens: int = 0, requests: int = 400) -> tuple[float, float]:
    """(mean latency ms, docs/s) of `clients` closed-loop clients on one engine, each sending its next request as its
    last one finishes: the model's prediction of a measured closed-loop step (no time outside the engine)."""
    scheduler = BatchScheduler(model)
    render_ms = model.render_ms_per_image_token * image_tokens
    now, latencies = 0.0, []
    rendering: list[tuple[float, float]] = [(render_ms, 0.0)] * clients  # (ready at, sent at)
    started: dict[int, float] = {}
    while len(latencies) < requests:
        for ready, sent in [r for r in rendering if r[0] <= now]:
            seq = Sequence(prompt_tokens, output_tokens)
            started[id(seq)] = sent
            scheduler.add(seq)
        rendering = [r for r in rendering if r[0] > now]
        if not scheduler.running and not scheduler.waiting:
            now = min(ready for ready, _ in rendering)
            continue
        step_ms, finished = scheduler.step()
        now += step_ms
        for seq in finished:
            latencies.append(now - started.pop(id(seq)))
            rendering.append((now + render_ms, now))
    measured = latencies[len(latencies) // 4:]  # past the start, where every client began at once
    mean = sum(measured) / len(measured)
    return mean, clients / mean * 1000


class MockEngine:
    name = "mock"

    def __init__(self, *, delay_s: float = 0.0, responder: Responder | None = None, adapters: list[str] | None = None,
                 model_name: str = "mock-ocr", start_delay_s: float = 0.0, step_model: StepModel | None = None,
                 time_scale: float = 1.0, min_pixels: int = 512 * 512, max_pixels: int = 2048 * 2048):
        self.delay_s = delay_s
        # the time of a GPU engine's steps (None: `delay_s` per request)
        self.scheduler = BatchScheduler(step_model, time_scale) if step_model is not None else None
        self.pixels = (min_pixels, max_pixels)
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
        if self.scheduler is None:  # a load test's requests are not kept (their pixels would pile up)
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
        image_tokens, prompt_tokens, output_tokens = 0, 32, len(pieces)
        if self.scheduler is not None:
            image_tokens = image_tokens_for(request.height, request.width, *self.pixels)
            prompt_tokens = image_tokens + prompt_token_bound(request.prompt)
            # exactly max_tokens where a benchmark fixes output lengths, as vLLM does with ignore_eos
            output_tokens = request.max_tokens if request.ignore_eos else max(1, len(pieces))
            await self.scheduler.generate(prompt_tokens, output_tokens, image_tokens)
        tokens = [TokenLogprob(token=p, logprob=math.log(0.80 + 0.19 * ((i * 7919) % 100) / 100))
                  for i, p in enumerate(pieces)]
        for token in tokens:
            yield EngineDelta(text=token.token, tokens=[token] if request.logprobs else None, token_count=1)
        finish = "length" if len(pieces) * 4 < len(text) else "stop"
        yield EngineDelta(final=EngineResult(
            text="".join(pieces), tokens=tokens if request.logprobs else None, finish_reason=finish,
            prompt_tokens=prompt_tokens, image_tokens=image_tokens,
            output_tokens=output_tokens, engine_ms=(time.perf_counter() - started) * 1000,
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
