"""Shared test set-up. Fixture modules live in tests/fixtures/*.py and are loaded as pytest plugins, one per concern
(documents, ray/serve apps, redis, prometheus, vllm, ...), so features add fixtures without touching this file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Run the vLLM-engine tests last and together: they share one vLLM deployment per session, and every other
    module's app redeploy in between would cost an engine restart (stable sort: file order is kept otherwise).

    Under pytest-xdist (`tests/run.sh` runs two workers with `--dist loadgroup`) one worker runs the vLLM tests and
    the tests that start vLLM engines of their own (marker `own_engines`), one at a time as without xdist: two of
    them at once would not fit a 24 GB machine. Every other module is a group of its own, so its module-scoped
    servers (redis, prometheus, chromium) start once. The engine group goes to a worker first
    (pytest_xdist_make_scheduler below), and the other worker runs the rest meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)
    for item in items:
        uses_engines = item.get_closest_marker("vllm") or item.get_closest_marker("own_engines")
        group = ENGINE_GROUP if uses_engines else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


ENGINE_GROUP = "vllm-engines"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the engine group handed out first, whatever its size: it is the run's critical path,
    and xdist would otherwise hand out the larger groups first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class EngineGroupFirst(LoadGroupScheduling):
        def _assign_work_unit(self, node) -> None:
            if ENGINE_GROUP in self.workqueue:
                self.workqueue.move_to_end(ENGINE_GROUP, last=False)
            super()._assign_work_unit(node)

    return EngineGroupFirst(config, log)
