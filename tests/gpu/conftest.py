"""The GPU tier: a real NVIDIA GPU (manual, never in CI: `python -m pytest tests/gpu -m gpu`)."""
