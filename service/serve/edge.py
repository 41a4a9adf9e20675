"""The HTTP edge: what first parses a client's bytes, and what the service listens on.

In Ray Serve that is uvicorn (httptools) inside Serve's proxy actor and, in the throughput-optimized mode, inside
each ingress replica for its own port ("direct ingress"); with RAY_SERVE_ENABLE_HA_PROXY=1 it is HAProxy
(service/serve/haproxy.py). uvicorn has no limit on a request's headers (it holds a 64 MiB `Authorization` header
whole: +193 MiB in Serve's proxy) and no timeout for them (a client that sends a byte a second holds its connection
for ever). Serve offers no setting for either, but it calls a function of ours in every process that starts such a
server (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read by Serve's proxy and by replicas before their own HTTP
server starts): `proxy_callback` there makes uvicorn parse HTTP with `EdgeHttpProtocol`, which counts the request
line and headers while they arrive and answers 431 `headers_too_large` past `max_header_bytes`, or 408
`request_timeout` when they take longer than `header_timeout_s` — before the request reaches any replica.

The limits come from the environment (OCR_MAX_HEADER_BYTES, OCR_HEADER_TIMEOUT_S, validated like settings):
these processes are Ray's, started before any application, so they never see the app's settings. Ray's processes
inherit `ocr-serve serve`'s environment, where the app reads them too; the Helm chart sets them on every Ray
container from the same values as the app's.

Ray's replicas also start a gRPC server for calls between deployments on every interface (`[::]:0`, fixed in
ray.serve._private.replica); `bind_replica_grpc_to_node_ip` has a replica of a node that runs on loopback (the
local service) bind it to that address instead.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from dataclasses import dataclass
from typing import Annotated, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import ERROR_CODES, OCRError
from service.config import LimitsConfig

log = logging.getLogger(__name__)

# what Serve calls in its proxy and in replicas that serve HTTP themselves (set in the environment of every Ray
# process: service/serve/local.py, the Helm chart's ocr.rayEnv)
PROXY_CALLBACK_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "service.serve.edge:proxy_callback"}
EDGE_SETTINGS = ("max_header_bytes", "header_timeout_s")
# after a refusal the connection is read (and dropped) this long before it closes, so that a client still sending
# gets the answer instead of a reset
REFUSAL_LINGER_S = 2.0
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True)
class EdgeLimits:
    max_header_bytes: int
    header_timeout_s: float


def edge_limits(environ: dict[str, str] | None = None) -> EdgeLimits:
    """The edge's limits from OCR_* variables (validated with the constraints of their settings fields), defaults
    where unset. Only these fields: the rest of the settings may not validate in a process that is not the app."""
    from pydantic import TypeAdapter

    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in EDGE_SETTINGS:
        field = LimitsConfig.model_fields[name]
        raw = environ.get(f"OCR_{name.upper()}")
        values[name] = field.default if raw is None else \
            TypeAdapter(Annotated[field.annotation, *field.metadata]).validate_python(raw, strict=False)
    return EdgeLimits(**values)


class EdgeHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap on the request line and headers and a deadline for them.

    Bytes are counted as they arrive while a request's head is incomplete (one read, at most 256 KiB, past the cap
    is held before the refusal); the parsed head is measured again when it is complete. The deadline runs from the
    connection's opening (a client that sends nothing) and from the first byte of each later request on it."""

    max_head_bytes = 16 * 1024
    head_timeout_s = 20.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._reading_head = True
        self._refused = False
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the linger ends
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and not self._refused and self._head_bytes > self.max_head_bytes:
            self._refuse(431, "headers_too_large", f"request line and headers exceed {self.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._reading_head:  # the next request on a kept-alive connection
            self._reading_head = True
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_head_timer()
        if self._refused:
            return
        size = len(self.url) + 16 + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_head_bytes:
            self._refuse(431, "headers_too_large", f"request line and headers exceed {self.max_head_bytes} bytes")
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._reading_head and not self._refused:
            self._refuse(408, "request_timeout",
                         f"the request line and headers did not arrive within {self.head_timeout_s:g} s")

    def _stop_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer with the stable error and close; the request never reaches the application."""
        assert ERROR_CODES[code][0] == status
        self._refused = True
        self._reading_head = False
        self._stop_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            # an earlier (pipelined) request's response is still going out: it ends the connection, nothing more
            # of this one is read
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        body = json.dumps(OCRError(code, message).body()).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, REASONS[status], len(body), body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)
        else:
            self.transport.close()


def install_edge_protocol(limits: EdgeLimits) -> None:
    """Make this process's uvicorn servers (those built with `http="auto"`, as Serve builds them) parse HTTP with
    EdgeHttpProtocol and these limits."""
    from uvicorn.protocols.http import auto

    auto.AutoHTTPProtocol = type("EdgeHttpProtocol", (EdgeHttpProtocol,), {
        "max_head_bytes": limits.max_header_bytes, "head_timeout_s": limits.header_timeout_s})


def proxy_callback() -> list:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: Serve calls it in its proxy and in each replica that serves HTTP on
    its own port, before their server starts. Installs the edge's protocol; adds no middleware."""
    limits = edge_limits()
    install_edge_protocol(limits)
    log.info("HTTP edge: request line + headers at most %d bytes, within %g s", limits.max_header_bytes,
             limits.header_timeout_s)
    return []


def bind_replica_grpc_to_node_ip() -> None:
    """Called in a replica's constructor, before Serve starts the replica's gRPC server for calls from other
    deployments: on a node whose address is loopback (`ocr-serve serve`), that server binds the node's address
    instead of every interface. Peers reach it at the node's address either way. Other nodes are left as Ray has
    them (a pod's address is what other pods call)."""
    import ray
    from ray.serve._private import replica as serve_replica

    node_ip = ray.util.get_node_ip_address()
    add_port = getattr(serve_replica, "add_port_to_grpc_server", None)
    if not ipaddress.ip_address(node_ip).is_loopback or add_port is None or getattr(add_port, "binds", None):
        if add_port is None:
            log.warning("Ray's replica module has no add_port_to_grpc_server: its gRPC server binds as Ray chooses")
        return

    def add_port_on_node_ip(server, address: str) -> int:
        if address.startswith("[::]:"):
            address = f"{node_ip}:{address.removeprefix('[::]:')}"
        return add_port(server, address)

    add_port_on_node_ip.binds = node_ip  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port_on_node_ip
