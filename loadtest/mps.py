"""CUDA MPS (Multi-Process Service) around one bench part: `--variant LABEL:mps` starts NVIDIA's MPS control daemon
before that part's server starts and quits it after the server stopped, so the engines of `service_xN@LABEL` (N vLLM
processes on one GPU) have their kernels run side by side instead of taking turns in time slices.

The daemon gets its own pipe and log directories (the defaults, /tmp/nvidia-mps and /var/log/nvidia-mps, may belong
to another user); the part's server processes get them through CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY,
which Ray passes on to its workers. While the part runs, a thread asks the daemon every few seconds which MPS server
runs and how many client processes it has: a part whose engines never became clients ran without MPS, and its
report says so instead of crediting MPS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CONTROL = "nvidia-cuda-mps-control"


def find_control() -> str | None:
    """The MPS control binary on PATH (it ships with the NVIDIA driver's utilities), or None."""
    return shutil.which(CONTROL)


class MpsDaemon:
    """One MPS control daemon for the lifetime of a `with` block; `env` is what its clients need."""

    def __init__(self, root: Path | None = None, poll_s: float = 3.0):
        self.control = find_control()
        if self.control is None:
            raise FileNotFoundError(f"no {CONTROL} on PATH")
        self.root = Path(tempfile.mkdtemp(prefix="ocr-bench-mps-", dir=root))
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}
        self.poll_s = poll_s
        self.servers: set[str] = set()
        self.max_clients = 0
        self.samples = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ask(self, command: str, timeout_s: float = 10.0) -> str:
        """One command to the daemon (`get_server_list`, `quit`, …) → its answer; raises when it does not answer."""
        done = subprocess.run([self.control], input=command + "\n", capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, **self.env})
        if done.returncode != 0:
            raise RuntimeError(f"{CONTROL} {command!r}: exit {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[:300]}")
        return done.stdout

    def __enter__(self) -> "MpsDaemon":
        for sub in ("pipe", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # -d forks the daemon into its own session and returns at once; its output goes to a file, since a pipe
        # would stay open as long as the daemon held it
        with open(self.root / "log" / "start.txt", "w") as start_log:
            subprocess.run([self.control, "-d"], check=True, timeout=30, env={**os.environ, **self.env},
                           stdin=subprocess.DEVNULL, stdout=start_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:  # it answers once its control pipe exists
            try:
                self.ask("get_server_list")
                break
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                if time.monotonic() > deadline:
                    shutil.rmtree(self.root, ignore_errors=True)  # no __exit__ follows a failed __enter__
                    raise RuntimeError(f"the MPS control daemon did not answer within 10 s: {exc}") from None
                time.sleep(0.2)
        self._thread = threading.Thread(target=self._watch, name="mps-watch", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.sample()

    def sample(self) -> None:
        """Record the MPS servers the daemon runs and the most client processes one of them had so far."""
        try:
            servers = self.ask("get_server_list").split()
            for server in servers:
                clients = self.ask(f"get_client_list {server}").split()
                self.max_clients = max(self.max_clients, len(clients))
            self.servers.update(servers)
            self.samples += 1
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            if len(self.errors) < 5:
                self.errors.append(str(exc)[:300])

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.ask("quit")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.errors.append(f"quit: {exc}"[:300])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # gone once it stops answering; the next part must not find it
            try:
                self.ask("get_server_list", timeout_s=2.0)
            except (RuntimeError, subprocess.TimeoutExpired):
                break
            time.sleep(0.2)
        else:
            self.errors.append("quit: the daemon still answered 15 s later")
        shutil.rmtree(self.root, ignore_errors=True)

    def summary(self) -> dict[str, Any]:
        """What the results record: did the engines run under MPS at all, and with how many clients at most."""
        return {"servers": sorted(self.servers), "max_clients": self.max_clients, "samples": self.samples,
                **({"errors": self.errors} if self.errors else {})}


PROBE = ("import time, torch; x = torch.ones(1 << 20, device='cuda'); time.sleep(3); "
         "print(f'cuda probe: sum {x.sum().item():.0f}')")


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest mps`: does MPS work on this machine? Starts a daemon, runs one CUDA process as its client
    (or `--probe CMD`), and prints what the daemon saw; exit 0 only when the probe became an MPS client."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m loadtest mps", description=main.__doc__)
    parser.add_argument("--probe", default=None, help="shell command that uses the GPU (default: a torch tensor)")
    args = parser.parse_args(argv)
    if find_control() is None:
        print(json.dumps({"ok": False, "error": f"no {CONTROL} on PATH"}))
        return 1
    daemon = MpsDaemon(poll_s=0.5)
    try:
        with daemon:
            command = args.probe or f"{sys.executable} -c \"{PROBE}\""
            probe = subprocess.run(command, shell=True, env={**os.environ, **daemon.env}, capture_output=True,
                                   text=True, timeout=120)
            daemon.sample()
    except (RuntimeError, subprocess.SubprocessError) as exc:  # the daemon did not start, or the probe hung
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], **daemon.summary()}))
        return 1
    result = {"ok": probe.returncode == 0 and daemon.max_clients >= 1, "probe_exit": probe.returncode,
              "probe_output": (probe.stdout + probe.stderr).strip()[-500:], **daemon.summary()}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
