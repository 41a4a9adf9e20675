"""Job webhooks: one signed POST of the job's final state to a client URL, without turning the service into an SSRF
tool that reaches metadata endpoints or internal services.

At `POST /v1/jobs` (`validate_webhook`), before the 202:
  - the URL: http or https only, no userinfo (`user:pw@`), a host, at most `MAX_URL_CHARS`, no whitespace/control
    characters or backslashes (parser confusion); any port;
  - the host is resolved ONCE (getaddrinfo, bounded by `webhook_timeout_s`) and EVERY address must be public
    unicast: loopback, private (RFC 1918, ULA), link-local (169.254.169.254, fd00:ec2::254 metadata), multicast,
    reserved, unspecified, CGNAT, documentation ranges and IPv6 forms that embed such an IPv4 address
    (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo) are refused — unless the host name, or the address
    (IP or CIDR entry), is in `webhook_allowed_hosts`;
  - the first address is pinned in the `WebhookTarget`.

After the job reaches a final state (`WebhookSender.send`, background task of the replica that ran the job): the
delivery connects to the PINNED address (no second DNS lookup, so DNS rebinding cannot redirect it), sends the
original `Host` header and, for https, SNI and certificate verification against the original host name. Redirects
are never followed (3xx = failed delivery), at most `MAX_RESPONSE_BYTES` of the answer are read (raw, never
decompressed), each attempt is bounded by `webhook_timeout_s`; 5xx, 408, 429, connection errors and timeouts are
retried up to `webhook_max_attempts` with bounded, jittered backoff. With `webhook_secret` the body is signed (HMAC-SHA256 of
`<timestamp>.<body>`). Outcomes are logged with the URL's origin only (paths and queries may hold tokens) and counted
in `ocr_webhook_deliveries_total{outcome}`. A delivery never blocks or fails the job.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal
from urllib.parse import urlsplit

import httpx

from service.errors import OCRError
from service.jobs.backoff import retry_wait_s

log = logging.getLogger(__name__)

MAX_URL_CHARS = 2048
MAX_RESPONSE_BYTES = 64 * 1024  # the answer is only read to finish the exchange; nothing of it is used
BACKOFF_S = 1.0  # doubled per attempt, capped at MAX_BACKOFF_S, jittered (service/jobs/backoff.py)
MAX_BACKOFF_S = 30.0
RETRY_STATUSES = frozenset({408, 429})  # plus every 5xx
SIGNATURE_HEADER = "X-OCR-Signature"
TIMESTAMP_HEADER = "X-OCR-Timestamp"
DELIVERY_HEADER = "X-OCR-Delivery"  # one id per delivery, the same on every attempt (receivers de-duplicate)
EVENT_HEADER = "X-OCR-Event"
EVENT = "job.finished"
USER_AGENT = "hunyuan-ocr-service-webhook/1"

Outcome = Literal["delivered", "redirect", "http_error", "timeout", "unreachable", "error"]
OUTCOMES: tuple[str, ...] = ("delivered", "redirect", "http_error", "timeout", "unreachable", "error")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_FORBIDDEN_CHARS = re.compile(r"[\x00-\x20\x7f\\]")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT: not ours to call into


@dataclass(frozen=True)
class WebhookTarget:
    """A validated webhook: the URL's parts and the address it resolved to at POST time (pinned)."""

    scheme: str
    host: str  # lower-case ASCII (IDNA) name or IP literal, without brackets
    port: int
    explicit_port: bool
    target: str  # request target: path (+ `?query`)
    address: str  # the resolved address every attempt connects to

    @property
    def origin(self) -> str:
        """What logs show: scheme, host and port — never the path or query (they may carry tokens)."""
        return f"{self.scheme}://{_bracket(self.host)}:{self.port}"

    @property
    def host_header(self) -> str:
        return _bracket(self.host) + (f":{self.port}" if self.explicit_port else "")

    @property
    def pinned_url(self) -> str:
        return f"{self.scheme}://{_bracket(self.address)}:{self.port}{self.target}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _invalid(message: str) -> OCRError:
    return OCRError("invalid_webhook", message)


# --- validation (at POST) -------------------------------------------------------------------------------------------


def parse_webhook_url(url: str) -> WebhookTarget:
    """Syntax checks only (no DNS): the returned target has no address yet."""
    if len(url) > MAX_URL_CHARS:
        raise _invalid(f"the webhook URL is longer than {MAX_URL_CHARS} characters")
    if _FORBIDDEN_CHARS.search(url):
        raise _invalid("the webhook URL contains whitespace, control characters or backslashes")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _invalid("the webhook URL is malformed (host or port)") from exc
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise _invalid("the webhook URL must be http:// or https://")
    if "@" in parts.netloc:
        raise _invalid("the webhook URL must not contain credentials (user:password@)")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise _invalid("the webhook URL has no host")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            host = host.encode("idna").decode("ascii").lower()
        except UnicodeError as exc:
            raise _invalid("the webhook URL's host name is not a valid (IDNA) name") from exc
        if not _HOST_NAME.match(host):
            raise _invalid("the webhook URL's host name is not a valid host name")
    if port == 0:
        raise _invalid("the webhook URL's port must be 1-65535")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return WebhookTarget(scheme=scheme, host=host, port=port or (443 if scheme == "https" else 80),
                         explicit_port=port is not None, target=target, address="")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (and may be translated to on the way), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or int(ip) >> 32 == 0:  # NAT64 well-known prefix, deprecated IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def address_denial(ip: IPAddress) -> str | None:
    """Why `ip` may not receive webhooks (loopback, private, ...), or None for a public unicast address."""
    for attr, reason in (("is_unspecified", "unspecified"), ("is_loopback", "loopback"),
                         ("is_link_local", "link-local"), ("is_multicast", "multicast"), ("is_private", "private"),
                         ("is_reserved", "reserved")):
        if getattr(ip, attr):
            return reason
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.is_site_local:
            return "site-local"
        embedded = _embedded_ipv4(ip)
        if embedded is not None and address_denial(embedded):
            return f"{address_denial(embedded)}, embedded IPv4"
    elif ip in _SHARED:
        return "shared (carrier-grade NAT)"
    if not ip.is_global:
        return "not globally routable"
    return None


def _allow_list(entries: list[str]) -> tuple[set[str], list[ipaddress.IPv4Network | ipaddress.IPv6Network]]:
    names, networks = set(), []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            names.add(entry)
    return names, networks


def _allowed_address(ip: IPAddress, networks) -> bool:
    candidates = [ip]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        candidates.append(ip.ipv4_mapped)
    return any(c.version == net.version and c in net for c in candidates for net in networks)


def _resolve(host: str, port: int) -> list[IPAddress]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if ip not in addresses:
            addresses.append(ip)
    return addresses


# One answer for "does not resolve" and "resolves to a non-public address": two would let a client map internal DNS
# (which names exist inside the cluster) through the error text. The operator's log keeps the distinction.
UNREACHABLE_HOST = ("the webhook host does not resolve to public addresses only; only public addresses (or hosts "
                    "in OCR_WEBHOOK_ALLOWED_HOSTS) may receive webhooks")


def _refused_host(target: WebhookTarget, why: str) -> OCRError:
    log.info("webhook refused at POST: host %r %s", target.host, why)  # the host only: paths may hold tokens
    return _invalid(UNREACHABLE_HOST)


async def validate_webhook(url: str, settings) -> WebhookTarget:
    """The checked, resolved and pinned webhook target, or 400 `invalid_webhook` (before any connection)."""
    target = parse_webhook_url(url)
    try:
        addresses = await asyncio.wait_for(asyncio.to_thread(_resolve, target.host, target.port),
                                           settings.jobs.webhook.timeout_s)
    except asyncio.TimeoutError as exc:
        raise _refused_host(target, f"did not resolve within {settings.jobs.webhook.timeout_s:g}s") from exc
    except (OSError, UnicodeError, ValueError) as exc:
        raise _refused_host(target, f"does not resolve ({type(exc).__name__})") from exc
    if not addresses:
        raise _refused_host(target, "resolves to no address")
    names, networks = _allow_list(settings.jobs.webhook.allowed_hosts)
    if target.host not in names:  # an allow-listed name may resolve anywhere; otherwise every address is checked
        for ip in addresses:
            reason = address_denial(ip)
            if reason and not _allowed_address(ip, networks):
                raise _refused_host(target, f"resolves to a non-public address ({reason})")
    return WebhookTarget(scheme=target.scheme, host=target.host, port=target.port,
                         explicit_port=target.explicit_port, target=target.target, address=str(addresses[0]))


# --- delivery (after the job) ---------------------------------------------------------------------------------------


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """`X-OCR-Signature` value: receivers recompute it over `<X-OCR-Timestamp>.<raw body>` and compare in constant
    time (and refuse old timestamps to stop replays)."""
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class WebhookSender:
    """Delivers job webhooks from background tasks of the replica that ran the job."""

    def __init__(self, settings, metrics=None, verify: ssl.SSLContext | bool = True):
        self.settings = settings
        self.metrics = metrics
        self.verify = verify  # https certificate verification (system CAs; tests pass a context with their CA)
        self._tasks: set[asyncio.Task] = set()  # strong references: the event loop keeps only weak ones

    def send(self, target: WebhookTarget, job_id: str, payload: Callable[[], Awaitable[dict[str, Any] | None]]
             ) -> None:
        """Start the delivery of `await payload()` (None: nothing to send) and return at once."""
        task = asyncio.create_task(self.deliver(target, job_id, payload), name=f"webhook-{job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_all(self) -> None:
        """Tests and shutdown: until every started delivery has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def deliver(self, target: WebhookTarget, job_id: str,
                      payload: Callable[[], Awaitable[dict[str, Any] | None]]) -> Outcome:
        attempts, status = 0, None
        try:
            data = await payload()
            if data is None:
                outcome: Outcome = "error"
            else:
                body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
                outcome, attempts, status = await self._post(target, body)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must never surface in the job; the traceback names no URL part
            log.exception("webhook of job %s: internal error", job_id)
            outcome = "error"
        level = logging.INFO if outcome == "delivered" else logging.WARNING
        log.log(level, "webhook of job %s to %s: %s (attempts=%d, status=%s)", job_id, target.origin, outcome,
                attempts, status)
        if self.metrics is not None:
            self.metrics.webhook_delivered(outcome)
        return outcome

    async def _post(self, target: WebhookTarget, body: bytes) -> tuple[Outcome, int, int | None]:
        settings = self.settings
        delivery_id = uuid.uuid4().hex
        # trust_env=False: no proxy from the environment (it would resolve the name itself); redirects off
        async with httpx.AsyncClient(trust_env=False, follow_redirects=False, verify=self.verify,
                                     timeout=httpx.Timeout(settings.jobs.webhook.timeout_s)) as client:
            attempt = 0
            while True:
                attempt += 1
                outcome, status = await self._attempt(client, target, body, delivery_id)
                retry = outcome in ("timeout", "unreachable") or (
                    outcome == "http_error" and status is not None and (status >= 500 or status in RETRY_STATUSES))
                if outcome == "delivered" or not retry or attempt >= settings.jobs.webhook.max_attempts:
                    return outcome, attempt, status
                await asyncio.sleep(retry_wait_s(attempt - 1, BACKOFF_S, MAX_BACKOFF_S))

    async def _attempt(self, client: httpx.AsyncClient, target: WebhookTarget, body: bytes,
                       delivery_id: str) -> tuple[Outcome, int | None]:
        headers = {"Host": target.host_header, "Content-Type": "application/json", "User-Agent": USER_AGENT,
                   EVENT_HEADER: EVENT, DELIVERY_HEADER: delivery_id}
        if self.settings.jobs.webhook.secret is not None:
            timestamp = str(int(time.time()))
            headers[TIMESTAMP_HEADER] = timestamp
            headers[SIGNATURE_HEADER] = sign(self.settings.jobs.webhook.secret.get_secret_value().encode(), timestamp,
                                             body)
        # the connection goes to the pinned IP; TLS still sends SNI and verifies the certificate for the name
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            async with asyncio.timeout(self.settings.jobs.webhook.timeout_s):
                async with client.stream("POST", target.pinned_url, content=body, headers=headers,
                                         extensions=extensions) as response:
                    read = 0
                    async for chunk in response.aiter_raw():  # raw: a gzip bomb is never inflated
                        read += len(chunk)
                        if read >= MAX_RESPONSE_BYTES:
                            break
                    status = response.status_code
        except (TimeoutError, httpx.TimeoutException):
            return "timeout", None
        except (httpx.HTTPError, OSError):
            return "unreachable", None
        if 200 <= status < 300:
            return "delivered", status
        if 300 <= status < 400:
            return "redirect", status
        return "http_error", status
