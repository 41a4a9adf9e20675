"""Where a benchmark step's limit was: GPU busy time and the CPU of each server process.

- `GpuUtilisation` keeps `nvidia-smi` sampling the GPU's utilisation (the share of time a kernel was running) for the
  whole run; `mean(t0, t1)` is a step's average.
- `cpu_snapshot(pids)` reads the CPU time of these processes and all their descendants from /proc;
  `cpu_percent(before, after)` turns two snapshots into CPU % per process kind (100 = one core busy). A frontend
  process near 100 % is bound by its one Python thread; the GPU below ~90 % busy then waits for it.

Linux only (/proc); without nvidia-smi the GPU figure is simply absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class GpuUtilisation:
    """`nvidia-smi --query-gpu=utilization.gpu -lms` in the background: (monotonic time, % of the busiest GPU)."""

    def __init__(self, interval_ms: int = 250):
        self.times: list[float] = []
        self.values: list[float] = []
        self._proc: subprocess.Popen | None = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        self._proc = subprocess.Popen(
            [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"-lms={interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, name="gpu-util", daemon=True).start()

    @property
    def available(self) -> bool:
        return self._proc is not None

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        pending: list[float] = []  # one line per GPU per sample; the samples of one tick arrive together
        for line in self._proc.stdout:
            try:
                pending.append(float(line.strip()))
            except ValueError:
                continue
            now = time.monotonic()
            if not self.times or now - self.times[-1] > 0.05:
                self.times.append(now)
                self.values.append(max(pending))
                pending = []

    def mean(self, t0: float, t1: float) -> float | None:
        """Mean utilisation % of the samples between two monotonic times (None: no samples)."""
        lo, hi = bisect_left(self.times, t0), bisect_right(self.times, t1)
        window = self.values[lo:hi]
        return round(sum(window) / len(window), 1) if window else None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()


@dataclass(frozen=True)
class CpuSnapshot:
    taken: float  # monotonic
    ticks: dict[int, tuple[str, int]]  # pid -> (kind, utime + stime in clock ticks)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = data.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[11]) + int(fields[12])


def process_kind(pid: int) -> str:
    """A short name for what a process is: its process title (vLLM and Ray set one, e.g. `VLLM::EngineCore`,
    `ray::ServeReplica:ocr:engine`) or its command without paths and arguments."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if len(argv) == 1 and " " in argv[0]:  # a process title written over argv ("vllm serve")
        return re.sub(r"\s+", " ", argv[0]).strip()[:60]
    first = os.path.basename(argv[0])
    if first.startswith(("python", "pypy")) and len(argv) > 1:
        rest = argv[2] if argv[1] == "-m" and len(argv) > 2 else os.path.basename(argv[1])
        first = f"{first} {rest}"
    first = re.sub(r"\s+", " ", first)
    return first[:60]


def niceness(pid: int) -> int | None:
    """The process's nice value; None once it is gone."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


def cpu_snapshot(roots: list[int]) -> CpuSnapshot:
    """CPU time of the root processes and all their descendants, now."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _stat(int(name))
        if stat is not None:
            parents[int(name)], ticks[int(name)] = stat
    wanted = {pid for pid in roots if pid in ticks}
    grew = True
    while grew:  # descendants: a fixed point over the parent links (process trees here are shallow)
        added = {pid for pid, parent in parents.items() if parent in wanted and pid not in wanted}
        wanted |= added
        grew = bool(added)
    return CpuSnapshot(time.monotonic(), {pid: (process_kind(pid), ticks[pid]) for pid in wanted})


def cpu_percent(before: CpuSnapshot, after: CpuSnapshot, top: int = 8) -> dict[str, float]:
    """CPU % per process kind between two snapshots (kinds with several processes are summed and named `kind ×N`),
    the busiest `top` kinds, busiest first."""
    seconds = after.taken - before.taken
    if seconds <= 0:
        return {}
    per_kind: dict[str, float] = {}
    count: dict[str, int] = {}
    for pid, (kind, ticks) in after.ticks.items():
        used = ticks - before.ticks.get(pid, (kind, 0))[1]  # a process born during the step counts from zero
        per_kind[kind] = per_kind.get(kind, 0.0) + used / _CLOCK_TICKS / seconds * 100
        count[kind] = count.get(kind, 0) + 1
    ranked = sorted(per_kind.items(), key=lambda kv: -kv[1])[:top]
    return {(f"{kind} ×{count[kind]}" if count[kind] > 1 else kind): round(pct, 1) for kind, pct in ranked}


def busiest_pids(before: CpuSnapshot, after: CpuSnapshot, count: int, exclude: set[int]) -> list[tuple[int, str]]:
    """The `count` processes that used the most CPU between two snapshots: (pid, kind), busiest first."""
    used = {pid: ticks - before.ticks.get(pid, (kind, 0))[1] for pid, (kind, ticks) in after.ticks.items()
            if pid not in exclude}
    ranked = sorted(used, key=lambda pid: -used[pid])[:count]
    return [(pid, after.ticks[pid][0]) for pid in ranked if used[pid] > 0]


# --- where a Python process spends its time: py-spy -----------------------------------------------------------------

def find_py_spy() -> str | None:
    """The py-spy binary: on PATH, in the `bin/` of a `pip install --target` dir on sys.path, or inside an unpacked
    py_spy wheel there. (Wheels installed one by one with `--target DIR --upgrade` each replace DIR/bin, so on the
    GPU machine py-spy goes into a target dir of its own: docs/BENCHMARKS.md, "How the lead runs it".)"""
    import glob
    import sys

    exe = shutil.which("py-spy")
    if exe:
        return exe
    for entry in sys.path:
        candidates = [os.path.join(entry or ".", "bin", "py-spy"),
                      *glob.glob(os.path.join(entry or ".", "py_spy-*.data", "scripts", "py-spy"))]
        for found in candidates:
            if os.path.isfile(found):
                os.chmod(found, 0o755)
                return found
    return None


def record_stacks(pid: int, seconds: float, out_path: str, rate: int = 100,
                  native: bool = False) -> subprocess.Popen | None:
    """Start sampling one process's Python stacks for `seconds` into a collapsed-stacks file; None without py-spy.
    Non-blocking (the process is not paused), unless `native`: then C/C++ frames too (e.g. which CUDA runtime
    call a busy Python line is in), which py-spy can only read from a paused process."""
    exe = find_py_spy()
    if exe is None:
        return None
    mode = ["--native"] if native else ["--nonblocking"]
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", str(rate), "--format", "raw", *mode, "--output", out_path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _frame_name(frame: str) -> str:
    """`fn (path/to/module.py:123)` → `fn (to/module.py)`: one name per function, whatever the line."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame.strip())
    if not match:
        return frame.strip()
    fn, path = match.groups()
    if re.fullmatch(r"0x[0-9a-f]+", fn):  # a native frame without symbols: one name per library, not per address
        fn = "?"
    return f"{fn} ({'/'.join(path.split('/')[-2:])})"


def summarise_stacks(path: str, top: int = 20) -> dict:
    """Share of samples per function in a collapsed-stacks file: `self` (the innermost frame: where the time was
    spent) and `inclusive` (anywhere on the stack: which call paths held it)."""
    self_counts: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError:
        return {"samples": 0}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += n
        self_counts[frames[-1]] = self_counts.get(frames[-1], 0) + n
        for name in set(frames):
            inclusive[name] = inclusive.get(name, 0) + n

    def ranked(counts: dict[str, int]) -> list[list]:
        return [[name, round(100 * n / total, 1)] for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]

    return {"samples": total, "self": ranked(self_counts) if total else [],
            "inclusive": ranked(inclusive) if total else []}
