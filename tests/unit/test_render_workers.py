"""Render pool workers end with their engine process (service/engine/vllm/render_pool.py, `_exit_with_parent`): the
engine killed with SIGKILL leaves no worker holding its renderer's memory. A plain spawn pool with the same watch stands
in for the engine's, whose workers need vLLM (tests/engine/test_vllm_render_pool.py); beside it, a pool without the
watch shows what the watch is for: its worker outlives the killed parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.fixtures.reliability import alive

PARENT = r"""
import concurrent.futures, multiprocessing, os, sys, time
from service.engine.vllm import render_pool

if __name__ == "__main__":
    watched = sys.argv[1] == "watched"
    pool = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"),
        initializer=render_pool._exit_with_parent if watched else None, initargs=(os.getpid(), 0.1) if watched else ())
    print(pool.submit(os.getpid).result(), flush=True)
    time.sleep(600)
"""


def worker_of_killed_parent(tmp_path, mode: str) -> int:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    try:
        worker = int(parent.stdout.readline())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    return worker


def test_a_worker_ends_when_its_engine_process_is_killed(tmp_path):
    watched = worker_of_killed_parent(tmp_path, "watched")
    unwatched = worker_of_killed_parent(tmp_path, "unwatched")
    try:
        deadline = time.monotonic() + 10
        while alive(watched) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(watched), "the watched worker outlived its parent"
        assert alive(unwatched)  # a pool worker alone does not notice: the case the watch is for
    finally:
        for pid in (watched, unwatched):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
