"""Our API and engine in one process, without Ray: the `direct` part of `bench gpu`.

The service puts a Ray Serve hop between the ingress and the engine replica, and runs the engine in a Ray worker
(Ray's worker environment: nice 15, its thread settings). This server runs the same FastAPI app (`create_app`,
`build_context`) around the same engine (`make_engine`) in one plain process, as `vllm serve` runs its API server
and engine client in one. So, side by side in one run, `direct` − raw is what our code costs, and `service` −
`direct` what Ray and the hop cost.

A measuring tool, not a way to serve: one process, no replicas, no drain, no metrics (they go through Ray).

    OCR_ENGINE=vllm OCR_MODEL=... python -m loadtest.direct_server --port 8123

Settings come from `OCR_*` variables, as for `ocr-serve serve`; it prints the CLI's ready line once the engine is
up, so `loadtest.common.start_direct` waits for it the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time


async def serve(host: str, port: int) -> None:
    import uvicorn

    from service.api.app import create_app
    from service.cli import READY_MARKER
    from service.engine import make_engine
    from service.serve.app import build_context
    from service.settings import load_settings

    settings = load_settings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    engine = make_engine(settings)
    await engine.start()
    server = uvicorn.Server(uvicorn.Config(create_app(build_context(settings, engine)), host=host, port=port,
                                           log_level="warning", lifespan="off", access_log=False))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"direct: {settings.engine} {READY_MARKER} http://{host}:{port} in {time.monotonic() - started:.1f}s",
              flush=True)
    try:
        await serving
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.direct_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
