"""The suite's own layout (tests/conftest.py): every test lives in a tier folder and carries that tier's marker; the
unit tier collects without torch or vLLM; and the grouping for pytest-xdist puts the tests that hold vLLM-CPU engines
in one group, so one worker runs them one at a time, while every other test stays with its module; and tests/run.sh
keeps each run's junit XML and slowest tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENGINE_GROUP, TIERS, tier_of, uses_engines

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
HEAVY = ("torch", "torchvision", "transformers", "vllm")  # what `pip install -e '.[dev]'` does not install


def _groups(item) -> list[str]:
    return [mark.args[0] for mark in item.iter_markers("xdist_group")]


def test_every_test_module_lives_in_a_tier():
    # tests/artifacts/ is the run's output (junit XML, screenshots, the venv of openapi-python-client), not tests
    modules = sorted(str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")
                     if tier_of(path) is None and "artifacts" not in path.relative_to(TESTS).parts[:1])
    assert modules == [], f"test modules outside tests/{{{','.join(TIERS)}}}/: {modules}"


def test_every_test_has_its_tier_marker_and_one_group_and_the_engine_tests_share_one(request):
    items = request.session.items
    assert len(items) > 1
    engine_modules = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        tier = tier_of(item.path)
        assert tier is not None and item.get_closest_marker(tier), item.nodeid
        assert not [t for t in TIERS if t != tier and item.get_closest_marker(t)], item.nodeid
        assert _groups(item) == [ENGINE_GROUP if uses_engines(item) else path], item.nodeid
        # a test that deploys the session's vLLM app must say so (marker vllm), else it lands on another worker and
        # a second engine starts next to the first
        if {"vllm_url", "vllm_settings"} & set(getattr(item, "fixturenames", ())):
            assert item.get_closest_marker("vllm"), f"{item.nodeid} uses the vLLM app without the vllm marker"
        if uses_engines(item):
            assert tier == "engine", f"{item.nodeid} holds vLLM engines outside tests/engine/"
            engine_modules.add(path)
    if any(item.get_closest_marker("engine") for item in items) and len(items) > 100:  # the whole engine tier
        assert {"tests/engine/test_vllm_engine.py", "tests/engine/test_loadtest_smoke.py"} <= engine_modules


def test_collecting_the_unit_tier_imports_no_torch_vllm_or_transformers():
    """`pip install -e '.[dev]'` has none of them: a unit test module (or a fixture it loads) that imported one would
    fail there, and nowhere else, since the full suite's machine has them all. Where none of them is installed, this
    session's own collection of the tier was that check already."""
    import importlib.util

    if not any(importlib.util.find_spec(name) for name in HEAVY):
        pytest.skip(f"none of {', '.join(HEAVY)} is installed: collecting this tier here imported none of them")
    code = ("import sys, pytest\n"
            "rc = pytest.main(['--collect-only', '-q', '-n', '0', '-p', 'no:cacheprovider', 'tests/unit'])\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
            "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "HEAVY []", done.stdout[-3000:]


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
    collection = [f"tests/integration/test_{name}.py::t{i}" for name, size in (("big", 3), ("bigger", 4))
                  for i in range(size)] + [f"tests/engine/test_vllm.py::t{i}" for i in range(2)]
    scheduler.registered_collections[node] = collection
    for group, prefix in (("tests/integration/test_bigger.py", "tests/integration/test_bigger.py"),
                          ("tests/integration/test_big.py", "tests/integration/test_big.py"),
                          (ENGINE_GROUP, "tests/engine/")):
        scheduler.workqueue[group] = {nodeid: False for nodeid in collection if nodeid.startswith(prefix)}
    scheduler._assign_work_unit(node)
    assert sent == [[7, 8]]
    assert list(scheduler.workqueue) == ["tests/integration/test_bigger.py", "tests/integration/test_big.py"]


def test_under_loadgroup_the_groups_reach_xdists_test_ids(request):
    """xdist reads the groups into the test ids in its own collection hook; ours has to run before it (tryfirst),
    else every test is handed out on its own and two workers each start a vLLM engine."""
    config = request.config
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist's loadgroup (tests/run.sh runs the suite so)")
    for item in request.session.items:
        assert item.nodeid.endswith("@" + _groups(item)[0]), item.nodeid


def test_run_sh_keeps_the_junit_xml_and_the_slowest_tests_of_each_run(tmp_path):
    """tests/run.sh asks pytest for its junit XML and slowest tests in tests/artifacts/, and cuts the slowest-tests
    table out of the run's log into durations.txt: run here on a log of pytest's shape (the summary after the table
    stays out of it)."""
    script = (REPO / "tests" / "run.sh").read_text()
    assert "--junitxml=\"$ARTIFACTS/junit.xml\"" in script and "--durations=50" in script
    assert "ARTIFACTS=tests/artifacts" in script
    (extract,) = [line for line in script.splitlines() if line.startswith("sed -n '/slowest")]
    assert extract.endswith('> "$ARTIFACTS/durations.txt"')
    (tmp_path / "pytest.log").write_text(
        "tests/unit/test_a.py ....\n"
        "============================= slowest 50 durations =============================\n"
        "12.50s call     tests/engine/test_x.py::test_slow@vllm-engines\n"
        "3.10s setup    tests/integration/test_y.py::test_z@tests/integration/test_y.py\n"
        "=========================== short test summary info ============================\n"
        "FAILED tests/unit/test_a.py::test_b - AssertionError\n"
        "========== 1 failed, 3 passed in 20.00s ==========\n")
    done = subprocess.run(["bash", "-c", extract], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env={"ARTIFACTS": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "durations.txt").read_text().splitlines() == [
        "============================= slowest 50 durations =============================",
        "12.50s call     tests/engine/test_x.py::test_slow@vllm-engines",
        "3.10s setup    tests/integration/test_y.py::test_z@tests/integration/test_y.py"]
