"""Engines behind the seam in `service.engine.protocol`; `make_engine` picks one from settings."""

from __future__ import annotations

from service.engine.protocol import Engine
from service.config import Settings


def make_engine(settings: Settings) -> Engine:
    """The engine named by `settings.engine.kind`, not yet started (call `await engine.start()`)."""
    if settings.engine.kind == "embedded":
        from service.engine.embedded import EmbeddedEngine

        return EmbeddedEngine(det_limit_side_len=settings.engine.embedded.det_limit_side_len,
                              threads=settings.engine.embedded.threads)
    if settings.engine.kind == "mock":
        from service.engine.mock import MockEngine, StepModel

        scale = settings.testing.mock_time_scale
        return MockEngine(delay_s=settings.testing.mock_delay_s, start_delay_s=settings.testing.mock_start_delay_s,
                          step_model=StepModel() if scale else None, time_scale=scale or 1.0,
                          min_pixels=settings.engine.min_image_pixels,
                          max_pixels=settings.engine.max_engine_image_pixels)
    if settings.engine.kind == "vllm":
        from service.engine.vllm.engine import VLLMEngine

        return VLLMEngine.from_settings(settings)
    raise ValueError(f"unknown engine {settings.engine.kind!r}")
