"""Entry point for every load test and benchmark (run from the repository root):

    python -m loadtest run ...            headless load test against a running service (loadtest/run.py)
    python -m loadtest locust ...         Locust with loadtest/locustfile.py (UI on :8089, or --headless)
    python -m loadtest documents OUT ...  write sample test documents as PNG
    python -m loadtest mps                does NVIDIA MPS work on this GPU machine (`bench gpu --variant LABEL:mps`)
    python -m loadtest bench cpu ...      CPU benchmarks: embedded engine vs rapidocr, ingress overhead, vLLM-CPU
    python -m loadtest bench gpu ...      H200 benchmark: raw vLLM vs our service vs HF generate (--tiny: CPU dry run)
    python -m loadtest bench limiter ...  rate-limiter decisions/s (loadtest/bench_limiter.py)
    python -m loadtest bench preprocess   image preprocessing images/s per backend and thread count (no GPU)
    python -m loadtest bench encoder ...  the vision tower alone on the GPU: ms per image, kernels (vLLM + CUDA)
    python -m loadtest bench engine-start how long an engine replica takes to start, with and without render processes
    python -m loadtest bench pool A B     pool the rounds of several `bench gpu --parts pair` runs (no GPU)
    python -m loadtest bench lora-kernels tune vLLM's Triton LoRA kernels for the model's layers on this GPU

`python -m loadtest CMD --help` lists each command's options; docs/BENCHMARKS.md has the exact commands behind
the published numbers.
"""

from __future__ import annotations

import importlib
import inspect
import signal
import sys
from pathlib import Path

COMMANDS = {
    "run": "loadtest.run",
    "documents": "loadtest.documents",
    "mps": "loadtest.mps",
}
BENCHMARKS = {
    "cpu": "loadtest.bench_cpu",
    "gpu": "loadtest.bench_gpu",
    "limiter": "loadtest.bench_limiter",
    "preprocess": "loadtest.bench_preprocess",
    "encoder": "loadtest.profile_encoder",
    "engine-start": "loadtest.engine_start",
    "pool": "loadtest.pool_pairs",
    "lora-kernels": "loadtest.lora_kernels",
}


def _exit_on_sigterm(signum, frame) -> None:
    # unwinds the `with` and `finally` blocks, so the servers a benchmark started (each in its own process group,
    # out of reach of a signal to this one) are stopped too: `timeout` or a Ctrl-C'd wrapper must not leave a vLLM
    # engine holding memory behind
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "locust":
        from locust.main import main as locust_main

        sys.argv = ["locust", "-f", str(Path(__file__).with_name("locustfile.py")), *rest]
        return locust_main()
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"usage: python -m loadtest bench {{{'|'.join(BENCHMARKS)}}} [options]", file=sys.stderr)
            return 2
        module, rest = BENCHMARKS[rest[0]], rest[1:]
    elif command in COMMANDS:
        module = COMMANDS[command]
    else:
        print(f"unknown command {command!r}\n{__doc__}", file=sys.stderr)
        return 2
    entry = importlib.import_module(module).main
    if inspect.signature(entry).parameters:
        return entry(rest) or 0
    sys.argv = [f"python -m loadtest {' '.join(argv[: len(argv) - len(rest)])}", *rest]  # main() reads sys.argv
    return entry() or 0


if __name__ == "__main__":
    raise SystemExit(main())
