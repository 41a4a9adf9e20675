"""Where our loggers write inside a Serve replica.

Serve gives only its own logger (`ray.serve`) handlers: the replica's log file (`logs/serve/replica_<app>_<deployment>_
<id>.log` under the Ray session directory) and, with `RAY_SERVE_LOG_TO_STDERR=1`, stderr. Our `service.*` loggers had
none, so their INFO records (engine ready, LoRA warm-up, adapter loads, API key reloads) were dropped, and warnings
reached the file only through Serve's capture of stderr, logged as INFO without their logger or level.
"""

from __future__ import annotations

import logging
import logging.handlers

SERVE_LOGGER = "ray.serve"
OUR_LOGGER = "service"


class Unbuffered(logging.Handler):
    """What a Serve MemoryHandler does to a record (its filters add the request id and, for JSON logs, the
    replica's name), then straight to its target file, not into its buffer."""

    def __init__(self, buffered: logging.handlers.MemoryHandler):
        super().__init__()
        self.filters = list(buffered.filters)
        self.target = buffered.target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.handle(record)


def route_to_replica_log(level: str | int) -> None:
    """Give our loggers the handlers of Serve's logger in this replica, at `level`.

    In throughput-optimized mode Serve buffers its log file 1,000 records deep (written when the buffer is full
    or at an ERROR). Our records are few and are what on-call reads during an incident, so they are written at
    once."""
    handlers = [Unbuffered(h) if isinstance(h, logging.handlers.MemoryHandler) and h.target is not None else h
                for h in logging.getLogger(SERVE_LOGGER).handlers]
    ours = logging.getLogger(OUR_LOGGER)
    ours.setLevel(level)
    if handlers:  # outside a replica (tests calling the deployment classes directly) Serve's logger has none
        ours.handlers = handlers
        ours.propagate = False
