"""The engine's image-processor resize, done in the ingress (settings.engine.presize).

HunyuanOCR's HF image processor resizes every page to sides in multiples of 32 (`smart_resize`) before it
normalises and patchifies it. In vLLM that runs in the engine replica's frontend process, one per GPU, next to
everything else the replica does (the resize alone was 10-16 % of its py-spy samples at 128 clients on the H200).
Both processor backends skip the resize when the page already has that size, so the ingress, which scales out,
can do it instead: with the same kernel (torchvision's antialiased bicubic on uint8, or PIL's bicubic) on the
same uint8 pixels the processor would get, the model sees exactly the same values
(`tests/test_presize.py` checks max |Δ| = 0 through the HF processor).
"""

from __future__ import annotations

from PIL import Image

from service.admission.budget import smart_resize
from service.engine.protocol import ImageProcessorInfo


def processor_size(width: int, height: int, processor: ImageProcessorInfo) -> tuple[int, int]:
    """(width, height) the engine's processor resizes a page of this size to."""
    h, w = smart_resize(height, width, processor.min_pixels, processor.max_pixels, factor=processor.factor)
    return w, h


def presize(image: Image.Image, processor: ImageProcessorInfo) -> Image.Image:
    """The RGB page resized as the engine's processor would resize it; the same image when it needs no resize."""
    width, height = processor_size(image.width, image.height, processor)
    if (width, height) == image.size:
        return image
    if image.mode != "RGB":
        image = image.convert("RGB")
    if processor.backend == "pil":
        # the PIL backend (and the reference HunyuanOCR processor) calls Image.resize with BICUBIC
        return image.resize((width, height), Image.Resampling.BICUBIC)
    return _torchvision_bicubic(image, width, height)


def _torchvision_bicubic(image: Image.Image, width: int, height: int) -> Image.Image:
    """transformers' torchvision backend: the numpy page becomes a contiguous uint8 (N, C, H, W) tensor, resized
    with antialiased bicubic interpolation, which torchvision runs natively on uint8 on CPU."""
    import numpy as np
    import torch
    from torchvision.transforms.v2 import functional as tvF

    chw = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous().unsqueeze(0)
    resized = tvF.resize(chw, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    return Image.fromarray(resized[0].permute(1, 2, 0).contiguous().numpy())


def check_available(processor_backend: str) -> None:
    """Raise ImportError at start-up, not per request, when presizing needs torchvision and it is missing."""
    if processor_backend == "torchvision":
        import torchvision.transforms.v2.functional  # noqa: F401
