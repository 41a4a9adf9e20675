"""`--variant LABEL:mps`: the GPU bench runs a labelled part inside its own CUDA MPS control daemon. The daemon
ships with the NVIDIA driver and needs a GPU, so these tests put a stand-in `nvidia-cuda-mps-control` on PATH that
speaks the same stdin protocol (`-d` forks a daemon into its own session; `get_server_list`, `get_client_list PID`,
`quit`); the real daemon runs in the H200 benchmark (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import stat
import textwrap
import time

import pytest

from loadtest import bench_gpu, mps

FAKE_CONTROL = textwrap.dedent('''\
    #!/usr/bin/env python3
    import os, sys, time
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    state, clients = os.path.join(pipe, "control"), os.path.join(pipe, "clients")
    journal = os.environ["FAKE_MPS_JOURNAL"]
    if sys.argv[1:] == ["-d"]:
        if os.environ.get("FAKE_MPS_NO_DAEMON"):  # a daemon that dies at once (no GPU, no permission)
            sys.exit(0)
        if os.fork() == 0:  # the daemon: its own session, alive while its control file exists
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # a daemon lets go of its caller's streams
                os.dup2(null, fd)
            time.sleep(0.3)  # a real daemon answers a moment after -d returned
            open(state, "w").write(str(os.getpid()))
            open(journal, "a").write("up\\n")
            while os.path.exists(state):
                time.sleep(0.05)
            open(journal, "a").write("down\\n")
            os._exit(0)
        sys.exit(0)
    if not os.path.exists(state):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    command = sys.stdin.read().split()
    if command == ["get_server_list"]:
        if os.path.exists(clients):  # an MPS server starts with its first client
            print(4242)
    elif command == ["get_client_list", "4242"]:
        print(open(clients).read().strip())
    elif command == ["quit"]:
        os.remove(state)
    else:
        print("unknown command", file=sys.stderr)
        sys.exit(1)
''')


@pytest.fixture()
def fake_mps(tmp_path, monkeypatch):
    """A stand-in MPS control binary first on PATH; its journal says when its daemon came up and went down."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(FAKE_CONTROL)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    journal = tmp_path / "journal"
    journal.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_JOURNAL", str(journal))
    return journal


def _lines(journal, want: int) -> list[str]:
    deadline = time.monotonic() + 10
    while len(journal.read_text().split()) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return journal.read_text().split()


def test_the_daemon_runs_for_the_block_and_counts_its_clients(fake_mps, tmp_path):
    daemon = mps.MpsDaemon(root=tmp_path, poll_s=0.1)
    with daemon:
        pipe = daemon.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert _lines(fake_mps, 1) == ["up"]
        daemon.sample()  # no engine yet: no MPS server
        assert daemon.summary()["max_clients"] == 0
        (tmp_path / pipe / "clients").write_text("101\n102\n")  # two engine processes connect
        deadline = time.monotonic() + 10
        while daemon.max_clients < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the watcher thread samples on its own
    summary = daemon.summary()
    assert summary["servers"] == ["4242"] and summary["max_clients"] == 2 and summary["samples"] >= 2
    assert "errors" not in summary
    assert _lines(fake_mps, 2) == ["up", "down"]  # quit, and waited until it stopped answering
    assert not daemon.root.exists()


def test_without_the_binary_there_is_no_daemon(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert mps.find_control() is None
    with pytest.raises(FileNotFoundError):
        mps.MpsDaemon()


def test_an_mps_labelled_part_runs_inside_the_daemon_and_reports_its_clients(fake_mps, tmp_path, monkeypatch):
    """`--variant mps:mps --parts service_x2,service_x2@mps`: only the labelled server starts with the daemon's
    pipe directory in its environment, its sweep runs while the daemon is up, the daemon is gone before the next
    part, and results and report say how many MPS clients it saw."""
    assert bench_gpu._variant_arg("mps:mps") == ("mps", "mps", "", True)
    for bad in ("lean:mps", "MPS:mps", "x:mps:1"):
        with pytest.raises(Exception):
            bench_gpu._variant_arg(bad)
    from tests.test_bench_gpu import _bench

    bench = _bench(tmp_path, variant=[bench_gpu._variant_arg("mps:mps"),
                                      bench_gpu._variant_arg("mps:env:OCR_SERVE_TOPOLOGY=colocated")])
    assert bench.args.variant_mps == {"mps"} and bench.args.variant_env == {"mps": {"OCR_SERVE_TOPOLOGY": "colocated"}}
    envs, during = [], []

    class Proc:
        pid = os.getpid()

        def stop(self, timeout_s):
            pass

    def fake_service(settings, *args, extra_env=None, **kwargs):
        envs.append(extra_env)
        pipe = extra_env.get("CUDA_MPS_PIPE_DIRECTORY")
        if pipe:  # the engines become MPS clients
            with open(os.path.join(pipe, "clients"), "w") as f:
                f.write("201\n202\n203\n")
        return Proc(), "http://127.0.0.1:1"

    async def fake_sweep(part, url, target, reserve_s, scrape=None, docs=None):
        if bench.mps is not None:
            bench.mps.sample()
        during.append((part, _lines(fake_mps, 0)))

    monkeypatch.setattr(bench_gpu, "start_service", fake_service)
    monkeypatch.setattr(bench, "_sweep_server", fake_sweep)
    parts = ["service_x2", "service_x2@mps"]
    for part in parts:
        bench.run_part(part, parts)

    assert "CUDA_MPS_PIPE_DIRECTORY" not in envs[0]
    assert envs[1]["OCR_SERVE_TOPOLOGY"] == "colocated" and envs[1]["CUDA_MPS_LOG_DIRECTORY"]
    assert during == [("service_x2", []), ("service_x2@mps", ["up"])]
    assert _lines(fake_mps, 2) == ["up", "down"] and bench.mps is None
    recorded = bench.results["parts"]["service_x2@mps"]["mps"]
    assert recorded["servers"] == ["4242"] and recorded["max_clients"] == 3 and recorded["samples"] >= 1
    assert "mps" not in bench.results["parts"]["service_x2"]
    bench.results["environment"] = {}
    assert "service_x2@mps ran under CUDA MPS: server 4242, at most 3 client processes" in bench.report()
    bench.results["parts"]["service_x2@mps"]["mps"]["max_clients"] = 0
    assert "**service_x2@mps had no MPS client**" in bench.report()


def test_mps_parts_are_checked_before_anything_starts(monkeypatch, tmp_path, capsys):
    """Without the binary an MPS part is skipped with the reason; a pair's servers cannot take an MPS label;
    a plan names the labelled parts."""
    monkeypatch.setenv("PATH", os.path.dirname(os.sys.executable))
    assert bench_gpu.preflight(["service_x2@mps", "service_x2"], mps_labels={"mps"}) == {
        "service_x2@mps": f"no {mps.CONTROL} on PATH for its MPS label"}
    with pytest.raises(SystemExit):
        bench_gpu.main(["--parts", "pair", "--pair-servers", "raw,service@m", "--variant", "m:mps", "--plan-only",
                        "--out", str(tmp_path)])
    assert bench_gpu.main(["--parts", "service,service@m", "--service-engines", "2", "--variant", "m:mps",
                           "--plan-only", "--out", str(tmp_path)]) == 0
    assert "['service_x2', 'service_x2@m']" in capsys.readouterr().out


def test_the_check_command_says_whether_a_gpu_process_became_a_client(fake_mps, capsys):
    """`python -m loadtest mps`: ok only when the probe ran and the daemon counted it as a client."""
    assert mps.main(["--probe", 'echo 301 > "$CUDA_MPS_PIPE_DIRECTORY/clients"; sleep 1']) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True and result["max_clients"] == 1 and result["probe_exit"] == 0
    from loadtest.__main__ import main as loadtest_main

    assert loadtest_main(["mps", "--probe", "true"]) == 1  # ran, but never an MPS client
    assert json.loads(capsys.readouterr().out)["max_clients"] == 0
    assert mps.main(["--probe", "exit 3"]) == 1
    assert json.loads(capsys.readouterr().out)["probe_exit"] == 3


def test_the_check_command_reports_a_daemon_that_never_answers(fake_mps, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_MPS_NO_DAEMON", "1")
    assert mps.main(["--probe", "true"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and "did not answer within 10 s" in result["error"]
