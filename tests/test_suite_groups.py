"""The suite's own grouping for pytest-xdist (tests/conftest.py): the tests that hold vLLM-CPU engines share one
group, so one worker runs them one at a time; every other test stays with its module."""

from __future__ import annotations

import pytest


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


def test_under_loadgroup_the_engine_group_goes_to_a_worker_first(request):
    """xdist hands out the largest groups first; the scheduler of tests/conftest.py hands out the engine group (the
    critical path) before any other, so it never waits for a worker. Driven here with two groups larger than it."""
    import types

    scheduler = request.config.hook.pytest_xdist_make_scheduler(
        config=types.SimpleNamespace(getvalue=lambda name: {"dist": "loadgroup", "tx": ["2*popen"]}[name],
                                     option=request.config.option), log=None)
    sent: list[list[int]] = []

    class Worker:  # a worker node as the scheduler sees it: it sends test indexes to it
        send_runtest_some = staticmethod(sent.append)

    node = Worker()
    collection = [f"tests/test_{name}.py::t{i}" for name, size in (("big", 3), ("bigger", 4), ("engine", 2))
                  for i in range(size)]
    scheduler.registered_collections[node] = collection
    for group, size in (("tests/test_bigger.py", 4), ("tests/test_big.py", 3), ("vllm-engines", 2)):
        scheduler.workqueue[group] = {nodeid: False for nodeid in collection
                                      if nodeid.startswith(group if group != "vllm-engines" else "tests/test_engine")}
    scheduler._assign_work_unit(node)
    assert sent == [[7, 8]] and list(scheduler.workqueue) == ["tests/test_bigger.py", "tests/test_big.py"]


def test_under_loadgroup_the_groups_reach_xdists_test_ids(request):
    """xdist reads the groups into the test ids in its own collection hook; ours has to run before it (tryfirst),
    else every test is handed out on its own and two workers each start a vLLM engine."""
    config = request.config
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist's loadgroup (tests/run.sh runs the suite so)")
    for item in request.session.items:
        assert item.nodeid.endswith("@" + _groups(item)[0]), item.nodeid
