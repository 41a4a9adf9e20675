"""Shared test set-up for every tier. The tests live in tiers by what they need (README.md, "Tests"):

- tests/unit/         `pip install -e '.[dev]'` alone: no torch, no vLLM, no Debian servers, no Ray cluster
- tests/integration/  real redis-server, prometheus, chromium, Ray Serve clusters (embedded and mock engines)
- tests/engine/       vLLM's CPU build and torch: the real engine on a tiny model
- tests/gpu/          a real GPU (manual, never in CI)

Each test gets its tier's marker from its folder (`-m unit`, `-m "not engine"`, ...). The light fixture modules below
serve every tier; each tier's conftest.py imports the heavy ones it needs (Ray clusters, servers, the vLLM
deployment), so collecting the unit tier imports neither Ray's cluster fixtures nor anything of torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback only
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's processes push their metrics to the node's agent every 2 s, not every 10 s (Ray's default): the tests that wait
# for a series in Prometheus wait for it that much less. Every Ray process of the tests' clusters reads it at start.
METRICS_REPORT_S = 2.0
os.environ.setdefault("RAY_metrics_report_interval_ms", str(int(METRICS_REPORT_S * 1000)))
# the product's Serve mode, before any test module imports ray.serve (every Ray process reads it at import)
from service.serve.local import SERVE_MODE_ENV  # noqa: E402  (imports no Ray)

for _name, _value in SERVE_MODE_ENV.items():
    os.environ.setdefault(_name, _value)

# The Ray cluster, the Serve deployer and the Prometheus that scrapes them are session fixtures shared by the
# integration and engine tiers: defined once here, so that a worker that runs tests of both tiers starts one cluster
# and deploys on one Serve port (two definitions would be two sessions' fixtures: a second cluster, and a second
# port that Serve, already started, ignores). Their modules import Ray only when a fixture runs.
pytest_plugins = [
    "tests.fixtures.api_inprocess",
    "tests.fixtures.documents",
    "tests.fixtures.helm",
    "tests.fixtures.listeners",
    "tests.fixtures.pdfs",
    "tests.fixtures.prometheus",
    "tests.fixtures.reliability",
    "tests.fixtures.serve_app",
]

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "engine", "gpu")
ENGINE_GROUP = "vllm-engines"


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder under tests/ it lives in."""
    try:
        top = Path(path).resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return top if top in TIERS else None


def uses_engines(item) -> bool:
    """Tests that deploy the session's vLLM app (marker `vllm`) or start vLLM engines of their own (`own_engines`)."""
    return bool(item.get_closest_marker("vllm") or item.get_closest_marker("own_engines"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """The tier marker from the folder; then the vLLM-engine tests last and together.

    They share one vLLM deployment per session, and every other module's app redeploy in between would cost an
    engine restart (stable sort: file order is kept otherwise). Under pytest-xdist (`tests/run.sh` runs the suite
    with `--dist loadgroup`) one worker runs the vLLM tests and the tests that start vLLM engines of their own, one at
    a time as without xdist: two of them at once would not fit the machine's memory. Every other module is a group of
    its own, so its module-scoped servers (redis, prometheus, chromium) start once. The engine group goes to a worker
    first (pytest_xdist_make_scheduler below), and the other workers run the rest meanwhile."""
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)
    for item in items:
        group = ENGINE_GROUP if uses_engines(item) else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


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
