"""Job webhooks through the real API in-process (mock engine), delivered to REAL HTTP(S) receivers on loopback
addresses: signing, retries, redirects never followed, SSRF refusals at POST (before any connection), DNS pinning
(one lookup; a rebound name still reaches the first address), SNI and certificate verification for the name while
connecting to the pinned IP, and a slow receiver that never holds up the job. No traffic leaves 127.0.0.0/8."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import io
import json
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from PIL import Image

from service.http.app import create_app
from service.jobs.runner import JobRunner
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.jobs import webhook as webhook_module
from service.observability.metrics import IngressMetrics, MetricSpec
from service.config import Settings

WAIT_S = 60.0
SECRET = "s3cret-webhook-key"
LOOPBACK_ONLY = {"webhook_allowed_hosts": ["127.0.0.1"]}


# --- a real receiver ----------------------------------------------------------------------------------------------


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


class Receiver:
    """A threaded HTTP(S) server on a loopback address: records every request, answers with the next scripted
    status (the last one repeats), optionally holds each answer until `release` is set."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, statuses=(200,), location: str | None = None,
                 tls: ssl.SSLContext | None = None, hold: bool = False):
        self.requests: list[Received] = []
        self.statuses = list(statuses)
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.sni_names: list[str | None] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.requests.append(Received(self.command, self.path,
                                                  {k.lower(): v for k, v in self.headers.items()}, body))
                receiver.release.wait(WAIT_S)
                status = receiver.statuses.pop(0) if len(receiver.statuses) > 1 else receiver.statuses[0]
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_POST = do_GET = _handle

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.sni_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        # shutdown() waits for the loop to poll its flag: 0.05 s, not the default 0.5 s per receiver
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, path: str = "/hook", host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers():
    started: list[Receiver] = []

    def start(**kwargs) -> Receiver:
        receiver = Receiver(**kwargs)
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.close()


class FakeDNS:
    """socket.getaddrinfo for a few names (answers change per lookup: DNS rebinding); every other name or IP
    literal goes to the real resolver."""

    def __init__(self, monkeypatch, answers: dict[str, list[list[str]]]):
        self.answers = answers
        self.lookups: Counter[str] = Counter()
        self.real = socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", self)

    def __call__(self, host, port, *args, **kwargs):
        if host not in self.answers:
            return self.real(host, port, *args, **kwargs)
        self.lookups[host] += 1
        rounds = self.answers[host]
        addresses = rounds[min(self.lookups[host], len(rounds)) - 1]
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, int(port), 0, 0)) if ":" in a
                else (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, int(port)))
                for a in addresses]


# --- the app --------------------------------------------------------------------------------------------------------


class Recorder:
    """Instrument factory keeping every counter increment: (metric, value, tags)."""

    def __init__(self):
        self.calls: list[tuple[str, float, dict]] = []

    def __call__(self, spec: MetricSpec):
        recorder = self

        class Instrument:
            def inc(self, value=1.0, tags=None):
                recorder.calls.append((spec.name, value, tags or {}))

            def set(self, value, tags=None):
                return None

            def observe(self, value, tags=None):
                return None

        return Instrument()

    def outcomes(self) -> list[str]:
        return [tags["outcome"] for name, _, tags in self.calls if name == "ocr_webhook_deliveries"]


def make_app(engine=None, **settings) -> tuple[httpx.AsyncClient, JobRunner, Recorder]:
    """A client of the app, the app's job runner, and what its metrics recorded."""
    recorder = Recorder()
    ctx = AppContext(settings=Settings(**settings), engine=engine or MockEngine(), metrics=IngressMetrics(recorder))
    app = create_app(ctx)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=WAIT_S)
    return client, app.state.jobs, recorder


def png(size=(160, 100)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "white").save(buf, format="PNG")
    return buf.getvalue()


def image_parts(count: int) -> list:
    return [("file", (f"p{i}.png", png(), "image/png")) for i in range(count)]


async def post_job(client: httpx.AsyncClient, webhook: str, pages: int = 2, **fields) -> httpx.Response:
    return await client.post("/v1/jobs", files=image_parts(pages), data={"task": "text", "webhook": webhook, **fields})


async def finish(runner: JobRunner) -> None:
    """Until the jobs and then their webhook deliveries have ended."""
    await asyncio.wait_for(runner.wait_all(), WAIT_S)
    await asyncio.wait_for(runner.webhooks.wait_all(), WAIT_S)


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(webhook_module, "BACKOFF_S", 0.05)


def valid_signature(received: Received, secret: str = SECRET) -> bool:
    timestamp = received.headers["x-ocr-timestamp"]
    expected = "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + received.body,
                                    hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, received.headers["x-ocr-signature"])


# --- delivery -------------------------------------------------------------------------------------------------------


async def test_a_finished_job_sends_one_signed_webhook_with_its_final_state(receivers, caplog):
    caplog.set_level(logging.INFO, logger="service.jobs.webhook")
    receiver = receivers()
    client, runner, recorder = make_app(webhook_secret=SECRET, **LOOPBACK_ONLY)
    async with client:
        resp = await post_job(client, receiver.url("/hook?token=query-secret"), pages=2, return_page_images="true")
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["id"]
        await finish(runner)
        view = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert len(receiver.requests) == 1
    got = receiver.requests[0]
    assert got.method == "POST" and got.path == "/hook?token=query-secret"
    assert got.headers["host"] == f"127.0.0.1:{receiver.port}"
    assert got.headers["content-type"] == "application/json" and got.headers["x-ocr-event"] == "job.finished"
    assert valid_signature(got)
    assert not valid_signature(got, secret="another-secret")
    assert abs(int(got.headers["x-ocr-timestamp"]) - time.time()) < 3600
    body = json.loads(got.body)
    assert body["id"] == job_id and body["status"] == "succeeded"
    assert body["pages_done"] == body["pages_total"] == 2 and body["pages_failed"] == 0
    assert [p["status"] for p in body["pages"]] == ["ok", "ok"] and body["pages"][0]["result"]["text"]
    # the GET body, without the page previews (no document bytes leave through the webhook)
    assert all(p["image"].startswith("data:image/jpeg") for p in view["pages"])
    assert body == {**view, "pages": [{**p, "image": None} for p in view["pages"]]}
    assert recorder.outcomes() == ["delivered"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"webhook of job {job_id} to http://127.0.0.1:{receiver.port}: delivered" in logged
    assert "query-secret" not in logged and "/hook" not in logged


async def test_a_cancelled_job_reports_cancelled(receivers):
    receiver = receivers()
    client, runner, recorder = make_app(MockEngine(delay_s=0.3), job_page_concurrency=1, **LOOPBACK_ONLY)
    async with client:
        job_id = (await post_job(client, receiver.url(), pages=10)).json()["id"]
        deadline = time.monotonic() + WAIT_S
        while (await client.get(f"/v1/jobs/{job_id}")).json()["pages_done"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await client.delete(f"/v1/jobs/{job_id}")
        await finish(runner)
    assert len(receiver.requests) == 1
    body = json.loads(receiver.requests[0].body)
    assert body["id"] == job_id and body["status"] == "cancelled" and 1 <= body["pages_done"] < 10
    assert "x-ocr-signature" not in receiver.requests[0].headers  # no secret configured: unsigned
    assert recorder.outcomes() == ["delivered"]


async def test_a_receiver_error_is_retried_until_delivered(receivers, fast_backoff):
    receiver = receivers(statuses=(500, 200))
    client, runner, recorder = make_app(webhook_secret=SECRET, webhook_max_attempts=3, **LOOPBACK_ONLY)
    async with client:
        job_id = (await post_job(client, receiver.url())).json()["id"]
        await finish(runner)
    assert len(receiver.requests) == 2
    first, second = receiver.requests
    assert first.body == second.body and json.loads(second.body)["id"] == job_id
    assert first.headers["x-ocr-delivery"] == second.headers["x-ocr-delivery"]  # receivers de-duplicate on it
    assert valid_signature(first) and valid_signature(second)
    assert recorder.outcomes() == ["delivered"]


async def test_attempts_are_bounded(receivers, fast_backoff):
    receiver = receivers(statuses=(503,))
    client, runner, recorder = make_app(webhook_max_attempts=3, **LOOPBACK_ONLY)
    async with client:
        resp = await post_job(client, receiver.url())
        await finish(runner)
        job = (await client.get(f"/v1/jobs/{resp.json()['id']}")).json()
    assert len(receiver.requests) == 3
    assert recorder.outcomes() == ["http_error"]
    assert job["status"] == "succeeded"  # the webhook never fails the job


@pytest.mark.parametrize("status", [302, 307])
async def test_redirects_are_never_followed(receivers, status):
    target = receivers()
    redirecting = receivers(statuses=(status,), location=target.url("/stolen"))
    client, runner, recorder = make_app(webhook_max_attempts=3, **LOOPBACK_ONLY)
    async with client:
        assert (await post_job(client, redirecting.url())).status_code == 202
        await finish(runner)
    assert len(redirecting.requests) == 1  # a redirect is a failed delivery, not retried
    assert target.requests == []
    assert recorder.outcomes() == ["redirect"]


async def test_a_slow_receiver_never_holds_up_the_job(receivers, fast_backoff):
    receiver = receivers(hold=True)  # accepts the request, never answers (until the test ends)
    client, runner, recorder = make_app(webhook_timeout_s=0.5, webhook_max_attempts=2, **LOOPBACK_ONLY)
    async with client:
        job_id = (await post_job(client, receiver.url())).json()["id"]
        await asyncio.wait_for(runner.wait_all(), WAIT_S)
        assert (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "succeeded"
        await asyncio.wait_for(runner.webhooks.wait_all(), WAIT_S)
    assert len(receiver.requests) == 2
    assert recorder.outcomes() == ["timeout"]


# --- SSRF: refused at POST, before any connection --------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:{port}/hook",
    "http://10.0.0.1/hook",
    "http://192.168.1.10/",
    "http://172.16.0.1/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]:{port}/hook",
    "http://[fd00:ec2::254]/latest",
    "http://[::ffff:127.0.0.1]:{port}/",
    "http://[::ffff:169.254.169.254]/",
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64 of the metadata address
    "http://[2002:a9fe:a9fe::1]/",  # 6to4 of the metadata address
    "http://[fe80::1]/",
    "http://localhost:{port}/hook",
    "http://127.1:{port}/",
    "http://2130706433:{port}/",  # 127.0.0.1 as one decimal number
    "http://0x7f.0.0.1:{port}/",
    "http://0.0.0.0:{port}/",
    "http://[::]:{port}/",
    "http://224.0.0.1/",
    "http://100.64.0.1/",
    "http://240.0.0.1/",
    "file:///etc/passwd",
    "ftp://example.com/hook",
    "gopher://127.0.0.1:6379/_INFO",
    "http://user:pw@example.com/",
    "http://example.com@127.0.0.1:{port}/",
    "http://example.com\\@127.0.0.1/",
    "http:///nohost",
    "http://127.0.0.1:99999/",
    "http://example.com/" + "a" * 2100,
    "not a url",
])
async def test_non_public_webhooks_are_refused_at_post(receivers, url):
    receiver = receivers()  # the loopback URLs point at it: it must never be called
    client, runner, recorder = make_app()  # no allow-list
    sent = []
    async with client:
        # the runner exists once the app is built; a webhook that got through would be recorded, not sent
        runner.webhooks.send = lambda *args: sent.append(args)
        resp = await post_job(client, url.format(port=receiver.port))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_webhook"
        assert runner.running() == []  # refused before the job was created
        await finish(runner)
    assert sent == [] and receiver.requests == []


async def test_a_name_with_any_non_public_address_is_refused(monkeypatch):
    dns = FakeDNS(monkeypatch, {"mixed.example.test": [["93.184.215.14", "10.1.2.3"]]})
    client, runner, _ = make_app(**LOOPBACK_ONLY)
    sent = []
    async with client:
        runner.webhooks.send = lambda *args: sent.append(args)
        resp = await post_job(client, "https://mixed.example.test/hook")
        await finish(runner)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_webhook"
    assert "10.1.2.3" not in resp.text  # the answer is no oracle for internal DNS
    assert dns.lookups["mixed.example.test"] == 1 and sent == []


async def test_dns_is_resolved_once_and_delivery_goes_to_the_pinned_address(receivers, monkeypatch):
    pinned = receivers(host="127.0.0.1")
    rebound = receivers(host="127.0.0.2", port=pinned.port)  # where a second lookup would now lead
    # the name first resolves to an allowed address, then (rebinding) to a denied one
    dns = FakeDNS(monkeypatch, {"hooks.example.test": [["127.0.0.1"], ["127.0.0.2"]]})
    client, runner, recorder = make_app(webhook_secret=SECRET, **LOOPBACK_ONLY)
    async with client:
        resp = await post_job(client, f"http://hooks.example.test:{pinned.port}/cb?x=1")
        assert resp.status_code == 202, resp.text
        await finish(runner)
    assert dns.lookups["hooks.example.test"] == 1
    assert rebound.requests == []
    assert len(pinned.requests) == 1
    assert pinned.requests[0].headers["host"] == f"hooks.example.test:{pinned.port}"
    assert pinned.requests[0].path == "/cb?x=1" and valid_signature(pinned.requests[0])
    assert recorder.outcomes() == ["delivered"]


async def test_an_allow_listed_name_may_resolve_to_a_private_address(receivers, monkeypatch):
    receiver = receivers()
    dns = FakeDNS(monkeypatch, {"hooks.internal": [["127.0.0.1"]]})
    client, runner, recorder = make_app(webhook_allowed_hosts=["Hooks.Internal."])
    async with client:
        assert (await post_job(client, f"http://hooks.internal:{receiver.port}/")).status_code == 202
        resp = await post_job(client, f"http://127.0.0.1:{receiver.port}/")  # the IP itself is not allowed
        await finish(runner)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_webhook"
    assert dns.lookups["hooks.internal"] == 1 and len(receiver.requests) == 1
    assert recorder.outcomes() == ["delivered"]


# --- https: connect to the pinned IP, SNI and certificate checked for the name ---------------------------------------


def tls_material(tmp_path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context with a certificate for `name`, client context trusting only the test CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "webhook test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "server.pem", tmp_path / "server.key"
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_file, key_file)
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    return server, client


async def test_https_webhook_uses_sni_and_verifies_the_certificate_for_the_name(receivers, monkeypatch, tmp_path):
    server_tls, client_tls = tls_material(tmp_path, "hooks.example.test")
    receiver = receivers(tls=server_tls)
    dns = FakeDNS(monkeypatch, {"hooks.example.test": [["127.0.0.1"]], "other.example.test": [["127.0.0.1"]]})
    client, runner, recorder = make_app(webhook_max_attempts=1, **LOOPBACK_ONLY)
    async with client:
        runner.webhooks.verify = client_tls
        good = await post_job(client, f"https://hooks.example.test:{receiver.port}/secure")
        await finish(runner)
        # same pinned IP, but the certificate is not valid for this name: the handshake is refused, nothing sent
        bad = await post_job(client, f"https://other.example.test:{receiver.port}/secure")
        await finish(runner)
    assert good.status_code == bad.status_code == 202
    assert dns.lookups == {"hooks.example.test": 1, "other.example.test": 1}
    assert len(receiver.requests) == 1
    assert receiver.requests[0].headers["host"] == f"hooks.example.test:{receiver.port}"
    assert receiver.sni_names[0] == "hooks.example.test"
    assert recorder.outcomes() == ["delivered", "unreachable"]


async def test_delivery_retries_wait_jittered_exponential_steps(receivers, monkeypatch):
    from tests.unit.test_retry_backoff import recording

    calls = recording(monkeypatch, webhook_module)
    receiver = receivers(statuses=(503,))
    client, runner, _ = make_app(webhook_max_attempts=3, **LOOPBACK_ONLY)
    async with client:
        await post_job(client, receiver.url())
        await finish(runner)
    assert len(receiver.requests) == 3 and [retry for retry, _, _ in calls] == [0, 1]
    assert all(step / 2 <= wait <= step for _, wait, step in calls)
    assert [step for _, _, step in calls] == [webhook_module.BACKOFF_S, 2 * webhook_module.BACKOFF_S]
