"""Shared test set-up. Fixture modules live in tests/fixtures/*.py and are loaded as pytest plugins, one per concern
(documents, ray/serve apps, redis, prometheus, vllm, ...), so features add fixtures without touching this file."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback only
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the product's Serve mode, before any test module imports ray.serve (every Ray process reads it at import)
from service.serve.local import SERVE_MODE_ENV  # noqa: E402  (imports no Ray)

for _name, _value in SERVE_MODE_ENV.items():
    os.environ.setdefault(_name, _value)

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)


def pytest_collection_modifyitems(config, items):
    """Run the vLLM-engine tests last and together: they share one vLLM deployment per session, and every other
    module's app redeploy in between would cost an engine restart (stable sort: file order is kept otherwise)."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)
