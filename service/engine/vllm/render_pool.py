"""Pages rendered for vLLM in worker processes (settings.engine.vllm.preprocess_processes).

vLLM's renderer (tokenizer + HF image processor) runs in threads of the engine replica's process, under the one GIL
that also turns the engine's outputs into tokens, logprobs and responses. This pool runs the same renderer, built
from the engine's own VllmConfig, in N spawned processes: each decodes the page, renders the prompt and returns
vLLM's engine input (token ids, processed patches), which the replica hands to `AsyncLLM.generate` as before. The
replica then only unpickles the patches. It pays for small pages and loses for A4 pages (a worker renders one page
at a time), so it is off by default (docs/design/engines-per-gpu.md).

Two things make a worker's output safe to mix with other workers':
- vLLM names each image `renderer{rank}-mm-{n}` when its caches are off, and keys the encoder's output by that name.
  Every worker counts n from 1, so each takes its own rank (its pid, unique among live processes); two workers
  with the same rank would give two pages one embedding.
- Tensors travel as raw bytes (`_dumps`): pickling a torch tensor writes a zip archive, 3x slower to load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copyreg
import io
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import time
import warnings
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from service.engine.protocol import EngineRequest
from service.errors import OCRError

log = logging.getLogger(__name__)

PROCESS_TITLE = "OCR::RenderWorker"
PARENT_POLL_S = 1.0  # how often a worker checks that its engine process is still there

# The worker process's renderer, built once by _init_worker. Module state only inside pool workers: a
# ProcessPoolExecutor hands work to plain functions, so this is where a worker keeps what it built.
_worker_renderer = None


def _rebuild_tensor(raw, dtype: str, shape: tuple[int, ...]):
    import torch

    with warnings.catch_warnings():  # the buffer is the unpickled bytes, read-only; vLLM only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


def _reduce_tensor(tensor):
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return _rebuild_tensor, (flat.view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."),
                             tuple(tensor.shape))


def _dumps(obj: Any) -> bytes:
    """Pickle with torch tensors as raw bytes (numpy), not torch's zip archive: 2.4-2.9 against 7 ms to load an ID
    card's 7.6 MB of patches on a 2-CPU VM."""
    import torch

    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = copyreg.dispatch_table.copy()
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dump(obj)
    return buffer.getvalue()


def _exit_with_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """End this worker once `parent_pid` is no longer its parent. A pool worker does not notice its engine process's
    death by SIGKILL (the OOM killer, a replica killed by Ray) and would keep its renderer's memory for good."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _init_worker(parent_pid: int, vllm_config: Any, warm_inputs: dict[str, Any], ready) -> None:
    """Build vLLM's renderer for this engine in this worker, with a rank of its own, render one page, and say so on
    `ready` (a multiprocessing queue) with this worker's pid. The worker ends with its parent, `parent_pid`."""
    global _worker_renderer
    _exit_with_parent(parent_pid)
    import torch
    from vllm.renderers.registry import renderer_from_config

    try:  # `ps`, `top` and the bench's CPU table name it (vLLM names its own processes the same way)
        import setproctitle

        setproctitle.setproctitle(PROCESS_TITLE)
    except ImportError:
        pass
    torch.set_num_threads(1)  # one page per worker at a time; more threads per worker only contend
    vllm_config.parallel_config._api_process_rank = os.getpid()
    vllm_config.model_config.renderer_num_workers = 1
    _worker_renderer = renderer_from_config(vllm_config)
    _worker_renderer.render_cmpl([warm_inputs])
    ready.put((os.getpid(), time.time()))


def _render(prompt: str, request: EngineRequest, mm_processor_kwargs: dict[str, Any]) -> tuple[str, Any]:
    """One page in a worker: ("ok", pickled engine input), or a known error as data (their exception classes do not
    survive pickling with their fields)."""
    from vllm.exceptions import VLLMValidationError

    try:
        image = request.rgb_array()
        (engine_input,) = _worker_renderer.render_cmpl([{
            "prompt": prompt, "multi_modal_data": {"image": image}, "mm_processor_kwargs": mm_processor_kwargs}])
    except OCRError as exc:
        return "ocr_error", (exc.code, exc.message)
    except VLLMValidationError as exc:
        return "validation", (exc.parameter, str(exc))
    return "ok", _dumps(engine_input)


def _nothing() -> None:
    return None


class RenderError(Exception):
    """vLLM's renderer refused the prompt in a worker (VLLMValidationError there): which parameter, and why."""

    def __init__(self, parameter: str | None, message: str):
        super().__init__(message)
        self.parameter = parameter


class RenderPool:
    """N worker processes that render pages for one vLLM engine (see module docstring)."""

    def __init__(self, vllm_config: Any, processes: int, warm_inputs: dict[str, Any]):
        self.processes = processes
        self._vllm_config = vllm_config
        self._warm_inputs = warm_inputs
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._generation = 0  # bumped each time a broken pool is replaced, so concurrent failures replace it once
        self._restart_lock = asyncio.Lock()
        self.worker_pids: list[int] = []
        self._starting: list[asyncio.Future] = []  # launch(): one task per worker, done once it is ready
        self._ready: Any = None  # launch(): the queue the workers put their pids on
        self._launched_at = 0.0
        self.ready_at = 0.0  # wall clock (time.time) when the last worker of the latest launch was ready

    async def start(self, timeout_s: float = 600.0) -> None:
        self.launch()
        await self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Spawn the workers and return: each builds and warms its renderer in its own process while the caller goes
        on (the engine starts its EngineCore meanwhile). wait_ready() then waits for them."""
        self._launched_at = self.ready_at = time.time()
        context = multiprocessing.get_context("spawn")
        self._ready = context.Queue()
        self._pool = pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=self.processes, mp_context=context, initializer=_init_worker,
            initargs=(os.getpid(), self._vllm_config, self._warm_inputs, self._ready))
        # a spawn pool starts a worker for each task that finds none idle: N tasks at once start all N now, instead
        # of making the first users wait for a process start. Each worker reports once its initializer has built
        # and warmed its renderer; a worker that fails there breaks the pool and with it these tasks. The tasks are
        # handed to the pool here, so the workers start even if the caller then blocks its event loop.
        loop = asyncio.get_running_loop()
        self._starting = [loop.run_in_executor(pool, _nothing) for _ in range(self.processes)]

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until every worker launched by launch() has warmed its renderer; raise if one failed or the
        workers are not all ready within timeout_s (counted from here)."""
        tasks, ready = self._starting, self._ready
        pids: list[int] = []
        deadline = time.monotonic() + timeout_s
        while len(pids) < self.processes:
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise RuntimeError(f"a render process failed to start: {failed[0].exception()!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.processes - len(pids)} render processes not ready after {timeout_s:.0f} s")
            try:
                pid, ready_at = await asyncio.to_thread(ready.get, True, 1.0)
            except queue.Empty:
                continue
            pids.append(pid)
            self.ready_at = max(self.ready_at, ready_at)
        await asyncio.gather(*tasks)
        ready.close()
        self.worker_pids = sorted(pids)
        log.info("%d render processes ready %.1f s after their launch", len(pids), self.ready_at - self._launched_at)

    async def render(self, prompt: str, request: EngineRequest, mm_processor_kwargs: dict[str, Any]) -> dict:
        """vLLM's engine input for one page. A worker that dies (killed, out of memory) breaks the pool: it is
        replaced and the page rendered once more; a second break is the engine's fault, a 503."""
        for attempt in (1, 2):
            generation, pool = self._generation, self._pool
            if pool is None:
                raise OCRError("engine_unavailable", "the engine is stopping", headers={"Retry-After": "1"})
            try:
                status, value = await asyncio.get_running_loop().run_in_executor(
                    pool, _render, prompt, request, mm_processor_kwargs)
                break
            except BrokenProcessPool:
                log.error("a render process died (page %s, attempt %d): starting new ones", request.request_id,
                          attempt)
                if attempt == 2:
                    raise OCRError("engine_unavailable", "the engine's image processing failed twice; retry",
                                   headers={"Retry-After": "1"}) from None
                await self._replace(generation)
        if status == "ocr_error":
            raise OCRError(*value)
        if status == "validation":
            raise RenderError(*value)
        return pickle.loads(value)

    async def _replace(self, broken_generation: int) -> None:
        async with self._restart_lock:
            if self._generation != broken_generation or self._pool is None:
                return  # another request replaced it already, or the engine stopped
            broken = self._pool
            self._generation += 1
            # the new pool takes pages at once (they wait for its workers); the broken one only refuses them
            await self.start()
            broken.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for task in self._starting:  # a pool stopped before it was ready: its start tasks fail, and that is known
            try:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()
            except RuntimeError:  # their event loop is closed already: nothing left to tell
                pass
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # idle workers exit on the shutdown; a worker mid-page is not waited for
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
