"""Hostile suite, the low-severity findings: a Redis restart that silently resets buckets and loses running jobs,
event streams that outlive a revoked key, repeated credential headers, and what the service tells callers without
a key (adapter names, webhook host resolution).

Each is reproduced through the real service (Ray Serve over real HTTP, a real redis-server restarted under it, the
metric read back from the Ray metrics agent) and, where it is quicker to pin down, in-process (mock engine, fakes).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from service.admission.auth import KeyFileAuthenticator, key_from_headers
from service.cli.keys import add_key, revoke_key
from service.admission.ratelimit import make_redis_client
from service.admission.redis_state import MARKER_KEY, RedisStateWatch
from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.errors import OCRError
from service.jobs import runner as runner_module
from service.jobs.webhook import validate_webhook
from service.observability.metrics import IngressMetrics
from service.config import Settings

WAIT_S = 60.0
SECRET_ADAPTER = "acme-private-invoices"


def png(size=(64, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "white").save(buf, format="PNG")
    return buf.getvalue()


def image_parts(count: int) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("file", (f"p{i}.png", png(), "image/png")) for i in range(count)]


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event, data) of every event in an SSE body."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.partition(":")[::2] for line in block.splitlines() if not line.startswith(":"))
        if "event" in fields:
            events.append((fields["event"].strip(), json.loads(fields["data"])))
    return events


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Recorder:
    """Instrument factory keeping (metric, tags) of every increment."""

    def __init__(self):
        self.incs: list[tuple[str, dict]] = []

    def __call__(self, spec):
        recorder = self

        class Instrument:
            def inc(self, value=1.0, tags=None):
                recorder.incs.append((spec.name, tags or {}))

            def set(self, value, tags=None):
                pass

            def observe(self, value, tags=None):
                pass

        return Instrument()

    def count(self, name: str, **tags) -> int:
        return sum(1 for metric, got in self.incs if metric == name and all(got.get(k) == v for k, v in tags.items()))


# --- in-process: the app around the mock engine with a real key file ------------------------------------------------


@pytest.fixture
def key_file(tmp_path: Path) -> tuple[Path, dict[str, str], dict[str, str]]:
    """(path, keys by name, key ids by name): an admin, a user limited to the secret adapter, a user without it."""
    path = tmp_path / "keys.yaml"
    keys, ids = {}, {}
    for name, kwargs in {"admin": {"tenant": "ops", "role": "admin"},
                         "acme": {"tenant": "acme", "adapters": [SECRET_ADAPTER]},
                         "globex": {"tenant": "globex", "adapters": []}}.items():
        keys[name], record = add_key(path, **kwargs)
        ids[name] = record.id
    return path, keys, ids


def keyed_app(key_file_path: Path, engine=None, *, metrics: IngressMetrics | None = None, **settings):
    ctx = AppContext(settings=Settings(engine="mock", rate_limit_enabled=False, **settings),
                     engine=engine or MockEngine(adapters=[SECRET_ADAPTER, "globex-forms"]),
                     authenticator=KeyFileAuthenticator(key_file_path, reload_interval_s=0.1),
                     metrics=metrics or IngressMetrics())
    return create_app(ctx), ctx


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=WAIT_S)


# finding 14: one key per request


def test_repeated_or_conflicting_credential_headers_are_refused():
    for headers in ([("Authorization", "Bearer a"), ("Authorization", "Bearer b")],
                    [("Authorization", "Bearer a"), ("authorization", "Bearer a")],  # even the same key twice
                    [("X-API-Key", "a"), ("x-api-key", "b")],
                    [("Authorization", "Bearer a"), ("X-API-Key", "b")]):
        with pytest.raises(OCRError) as err:
            key_from_headers(httpx.Headers(headers))
        assert err.value.code == "ambiguous_credentials" and err.value.status == 400
    # plain mappings (no getlist) spell one header in several cases
    with pytest.raises(OCRError):
        key_from_headers({"Authorization": "Bearer a", "authorization": "Bearer b"})
    assert key_from_headers(httpx.Headers([("Authorization", "Bearer a"), ("X-API-Key", "a")])) == "a"
    assert key_from_headers(httpx.Headers([("Authorization", "Basic dXNlcjpwdw=="), ("X-API-Key", "k")])) == "k"
    assert key_from_headers(httpx.Headers([("X-API-Key", "k")])) == "k"
    assert key_from_headers({}) is None


async def test_repeated_credential_headers_get_400_on_every_keyed_endpoint(key_file):
    path, keys, _ = key_file
    app, _ = keyed_app(path)
    smuggled = [("Authorization", "Bearer not-a-key"), ("Authorization", f"Bearer {keys['admin']}")]
    async with client_of(app) as client:
        for method, url in (("GET", "/v1/models"), ("GET", "/v1/adapters"), ("POST", "/v1/adapters/x/unload"),
                            ("GET", "/v1/jobs/job-unknown"), ("POST", "/v1/ocr")):
            resp = await client.request(method, url, headers=smuggled)
            assert resp.status_code == 400, (url, resp.text)
            assert resp.json()["error"]["code"] == "ambiguous_credentials"
        # the same key in both headers is one key
        resp = await client.post("/v1/adapters/x/unload",
                                 headers=[("Authorization", f"Bearer {keys['admin']}"), ("X-API-Key", keys["admin"])])
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_adapter"


# finding 15: what answers without a key


async def test_adapter_names_need_a_key(key_file):
    path, keys, _ = key_file
    app, _ = keyed_app(path)
    async with client_of(app) as client:
        resp = await client.get("/v1/models")
        assert resp.status_code == 401 and SECRET_ADAPTER not in resp.text
        listed = {m["id"] for m in (await client.get("/v1/models", headers=bearer(keys["acme"]))).json()["data"]}
        assert listed == {"mock-ocr", SECRET_ADAPTER}  # the adapters this key may use, not the others'
        listed = {m["id"] for m in (await client.get("/v1/models", headers=bearer(keys["globex"]))).json()["data"]}
        assert listed == {"mock-ocr"}

        public = await client.get("/ui/config.json")  # the page loads before a key is typed
        assert public.status_code == 200 and SECRET_ADAPTER not in public.text
        assert public.json()["adapters"] == [] and public.json()["auth_required"] is True
        assert public.json()["authenticated"] is False and public.json()["tasks"]
        keyed = (await client.get("/ui/config.json", headers=bearer(keys["acme"]))).json()
        assert keyed["adapters"] == [SECRET_ADAPTER] and keyed["authenticated"] is True
        assert (await client.get("/ui/config.json", headers=bearer("not-a-key"))).status_code == 401

        for probe in ("/healthz", "/readyz", "/openapi.json", "/docs"):
            assert (await client.get(probe)).status_code == 200, probe
        assert SECRET_ADAPTER not in (await client.get("/openapi.json")).text


async def test_the_openapi_document_shows_no_deployment_details(key_file):
    """It is the same document for every deployment: nothing of the settings, engine or adapters is in it."""
    path, _, _ = key_file
    plain, _ = keyed_app(path, MockEngine())
    other, _ = keyed_app(path, MockEngine(adapters=["tenant-x"], model_name="custom-model"), max_pdf_pages=7,
                         max_body_bytes=123_456, webhook_allowed_hosts=["hooks.internal.example"],
                         redis_url="redis://:hunter2@redis.internal:6379/0")
    assert plain.openapi() == other.openapi()
    text = json.dumps(other.openapi())
    for detail in ("tenant-x", "custom-model", "hooks.internal", "hunter2", "redis.internal", "123456"):
        assert detail not in text


async def test_webhook_refusals_do_not_tell_unresolvable_from_private_hosts(monkeypatch, caplog):
    """Two different messages let a client probe which names exist inside the cluster; the log keeps the reason."""
    real = socket.getaddrinfo

    def fake_getaddrinfo(host, port, *args, **kwargs):
        if host == "billing.corp.example":  # an internal name: resolves, to a private address
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.20.30.40", port))]
        if host == "nothing.corp.example":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    settings = Settings(engine="mock")
    messages = {}
    with caplog.at_level(logging.INFO, logger="service.jobs.webhook"):
        for name in ("billing.corp.example", "nothing.corp.example", "127.0.0.1", "169.254.169.254"):
            with pytest.raises(OCRError) as err:
                await validate_webhook(f"http://{name}/hook?token=s3cret", settings)
            assert err.value.code == "invalid_webhook"
            messages[name] = err.value.message
    assert len(set(messages.values())) == 1, messages
    assert not any(name in next(iter(messages.values())) for name in messages)
    logged = caplog.text
    assert "billing.corp.example" in logged and "non-public address (private)" in logged
    assert "nothing.corp.example" in logged and "does not resolve" in logged
    assert "10.20.30.40" not in logged and "s3cret" not in logged


# finding 13: a revoked key's event stream ends


async def test_a_revoked_key_ends_its_event_stream(key_file):
    path, keys, ids = key_file
    pages = 30
    app, _ = keyed_app(path, MockEngine(delay_s=0.2), job_page_concurrency=1)
    async with client_of(app) as client:
        created = await client.post("/v1/jobs", files=image_parts(pages), data={"task": "text"},
                                    headers=bearer(keys["acme"]))
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]

        async def revoke_after_first_page() -> float:
            while (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["admin"]))).json()["pages_done"] < 1:
                await asyncio.sleep(0.05)
            revoke_key(path, ids["acme"])
            return time.monotonic()

        revoker = asyncio.create_task(revoke_after_first_page())
        stream = await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(keys["acme"]))  # returns at its end
        ended = time.monotonic()
        revoked = await revoker
        await client.delete(f"/v1/jobs/{job_id}", headers=bearer(keys["admin"]))
    events = sse_events(stream.text)
    assert events[-1][0] == "error" and events[-1][1]["error"]["code"] == "unauthorized", events[-3:]
    assert sum(kind == "page" for kind, _ in events) < pages
    assert ended - revoked < 0.2 * pages / 2  # well before the job would have finished


# finding 12: Redis restarts and lost state are seen


class FakeRedis:
    """What the state watch uses of a Redis client, over a dict shared by several watches (ingress replicas)."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.run_id = "run-1"

    def restart(self, *, keep_data: bool) -> None:
        self.run_id = self.run_id + "'"
        if not keep_data:
            self.data.clear()

    async def info(self, section):
        return {"run_id": self.run_id}

    async def get(self, key):
        return self.data.get(key)

    async def set(self, key, value, nx=False):
        if nx and key in self.data:
            return None
        self.data[key] = value
        return True

    async def aclose(self):
        return None


async def test_the_state_watch_counts_each_loss_once_per_replica():
    redis = FakeRedis()
    seen: dict[str, list[str]] = {"a": [], "b": []}
    watches = {name: RedisStateWatch(redis, interval_s=1, on_change=seen[name].append) for name in seen}
    assert [await w.check() for w in watches.values()] == [None, None]  # first look: learn the state
    assert await watches["a"].check() is None
    redis.restart(keep_data=False)
    assert await watches["a"].check() == "lost"  # finds the marker gone, writes a new one
    assert await watches["b"].check() == "lost"  # finds another replica's new marker
    assert [await w.check() for w in watches.values()] == [None, None]
    redis.restart(keep_data=True)
    assert [await w.check() for w in watches.values()] == ["kept", "kept"]
    redis.data.clear()  # FLUSHALL or eviction: same server
    assert [await w.check() for w in watches.values()] == ["lost", "lost"]
    assert seen == {"a": ["lost", "kept", "lost"], "b": ["lost", "kept", "lost"]}


async def test_the_state_watch_against_a_real_redis_restart(redis_server):
    watch = RedisStateWatch(make_redis_client(redis_server.url, 1.0), interval_s=1)
    try:
        assert await watch.check() is None
        redis_server.client().save()  # an RDB snapshot in the server's directory: the restart loads it
        redis_server.kill()
        redis_server.start()
        assert await watch.check() == "kept"
        redis_server.kill()  # no snapshot of this run: the marker is gone with everything else
        (redis_server.workdir / "dump.rdb").unlink()
        redis_server.start()
        assert await watch.check() == "lost"
        assert redis_server.client().exists(MARKER_KEY)
    finally:
        await watch.close()


async def test_a_job_whose_state_vanished_is_failed_as_lost(key_file, monkeypatch):
    """What Redis losing the job's keys looks like to the runner (here the in-process store forgets the job)."""
    monkeypatch.setattr(runner_module, "HEARTBEAT_S", 0.2)
    path, keys, _ = key_file
    recorder = Recorder()
    pages = 20
    engine = MockEngine(delay_s=0.1)
    app, ctx = keyed_app(path, engine, metrics=IngressMetrics(recorder), job_page_concurrency=1)
    async with client_of(app) as client:
        created = await client.post("/v1/jobs", files=image_parts(pages), data={"task": "text"},
                                    headers=bearer(keys["acme"]))
        job_id = created.json()["id"]
        while (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]))).json()["pages_done"] < 2:
            await asyncio.sleep(0.05)
        store = app.state.jobs.store
        for state in (store._jobs, store._pages, store._expires):
            state.pop(job_id)
        assert (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]))).status_code == 404
        await asyncio.wait_for(app.state.jobs.wait_all(), WAIT_S)
        view = (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]))).json()
        events = sse_events((await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(keys["acme"]))).text)
    assert view["status"] == "failed" and view["error"]["code"] == "job_lost", view
    assert view["pages_done"] == pages and len(view["pages"]) == pages  # every page accounted for
    assert {p["error"]["code"] for p in view["pages"] if p["status"] == "failed"} == {"job_lost"}
    assert len(engine.requests) < pages  # the runner stopped instead of finishing pages nobody can read
    assert events[-1][0] == "done" and events[-1][1]["error"]["code"] == "job_lost"
    assert recorder.count("ocr_jobs_lost") == 1


# --- through the real service: Ray Serve over HTTP, a real redis-server ----------------------------------------------

PAGE_DELAY_S = 0.5  # the mock engine's time per page: 40-page jobs run for 20 s


@pytest.fixture(scope="module")
def service(serve_app, redis_server_module, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys, ids = {}, {}
    for name, kwargs in {"admin": {"tenant": "ops", "role": "admin"},
                         "acme": {"tenant": "acme", "adapters": [SECRET_ADAPTER]},
                         "globex": {"tenant": "globex", "adapters": []},
                         "viewer": {"tenant": "viewer"},
                         "bursty": {"tenant": "bursty", "rate": 0.01, "burst": 3}}.items():
        keys[name], record = add_key(path, **kwargs)
        ids[name] = record.id
    url = serve_app(engine="mock", api_keys_file=str(path), redis_url=redis_server_module.url,
                    mock_delay_s=PAGE_DELAY_S, job_page_concurrency=1)
    return url, path, keys, ids, redis_server_module


def create_job(url: str, key: str, pages: int, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/jobs", files=image_parts(pages), data={"task": "text", **fields},
                      headers=bearer(key), timeout=WAIT_S)


def agent_counter(targets: list[str], name: str, **labels: str) -> float:
    """Sum of a counter's series as the Ray metrics agent exports it (`ray_<name>_total`)."""
    total = 0.0
    for target in targets:
        for line in httpx.get(f"http://{target}/metrics", timeout=10).text.splitlines():
            match = re.match(rf"ray_{name}_total\{{(.*)\}} (\S+)", line)
            if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
                total += float(match.group(2))
    return total


@pytest.mark.ray
def test_serve_refuses_repeated_credential_headers(service):
    """The admin endpoint tells which key won: 404 (unknown adapter) = the admin key, 403 = the user key,
    401 = the bad one. Whichever copy a layer picks, a second header must not slip a key past the first."""
    url, _, keys, _, _ = service
    admin, user = keys["admin"], keys["globex"]
    cases = {
        "two Authorization (bad, admin)": [("Authorization", "Bearer not-a-key"),
                                           ("Authorization", f"Bearer {admin}")],
        "two Authorization (user, admin)": [("Authorization", f"Bearer {user}"), ("Authorization", f"Bearer {admin}")],
        "two X-API-Key (user, admin)": [("X-API-Key", user), ("X-API-Key", admin)],
        "Authorization user, X-API-Key admin": [("Authorization", f"Bearer {user}"), ("X-API-Key", admin)],
    }
    for name, headers in cases.items():
        resp = httpx.post(url + "/v1/adapters/nonexistent/unload", headers=headers, timeout=WAIT_S)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "ambiguous_credentials", (name, resp.text)
    resp = httpx.post(url + "/v1/adapters/nonexistent/unload", timeout=WAIT_S,
                      headers=[("Authorization", f"Bearer {admin}"), ("X-API-Key", admin)])
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_adapter"


@pytest.mark.ray
def test_serve_lists_adapters_only_to_keys(service):
    url, _, keys, _, _ = service
    loaded = httpx.post(url + f"/v1/adapters/{SECRET_ADAPTER}/load", json={"path": "/adapters/acme"},
                        headers=bearer(keys["admin"]), timeout=WAIT_S)
    assert loaded.status_code == 200, loaded.text
    anonymous = httpx.get(url + "/v1/models", timeout=WAIT_S)
    assert anonymous.status_code == 401 and SECRET_ADAPTER not in anonymous.text

    def listed(key: str) -> set[str]:
        return {m["id"] for m in httpx.get(url + "/v1/models", headers=bearer(key), timeout=WAIT_S).json()["data"]}

    assert SECRET_ADAPTER in listed(keys["acme"]) and SECRET_ADAPTER not in listed(keys["globex"])
    config = httpx.get(url + "/ui/config.json", timeout=WAIT_S)
    assert config.status_code == 200 and config.json()["adapters"] == []
    for public in ("/healthz", "/readyz", "/openapi.json"):
        resp = httpx.get(url + public, timeout=WAIT_S)
        assert resp.status_code == 200 and SECRET_ADAPTER not in resp.text, public


@pytest.mark.ray
def test_serve_webhook_refusals_are_one_message(service):
    url, _, keys, _, _ = service
    messages = {}
    for hook in ("http://no-such-host.invalid/hook", "http://localhost/hook", "http://10.1.2.3/hook",
                 "http://169.254.169.254/latest/meta-data/"):
        resp = create_job(url, keys["viewer"], 1, webhook=hook)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_webhook", resp.text
        messages[hook] = resp.json()["error"]["message"]
    assert len(set(messages.values())) == 1, messages


@pytest.mark.ray
def test_serve_event_stream_ends_when_its_key_is_revoked(service):
    url, path, keys, ids, _ = service
    pages = 40
    created = create_job(url, keys["viewer"], pages)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    events: list[tuple[float, str]] = []
    revoked_at = None
    with httpx.stream("GET", url + f"/v1/jobs/{job_id}/events", headers=bearer(keys["viewer"]),
                      timeout=httpx.Timeout(WAIT_S)) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("event:"):
                events.append((time.monotonic(), line.partition(":")[2].strip()))
                if revoked_at is None and events[-1][1] == "page":
                    revoke_key(path, ids["viewer"])
                    revoked_at = time.monotonic()
            elif line.startswith("data:") and events[-1][1] == "error":
                error = json.loads(line.partition(":")[2])["error"]
    httpx.delete(url + f"/v1/jobs/{job_id}", headers=bearer(keys["admin"]), timeout=WAIT_S)
    assert events[-1][1] == "error" and error["code"] == "unauthorized", events[-3:]
    after = events[-1][0] - revoked_at
    # the key file is re-read every api_keys_reload_interval_s (1 s), the stream looks every 0.25 s
    assert after < 10, after
    assert sum(kind == "page" for _, kind in events) < pages / 2
    print(f"\nrevoked key: stream ended {after:.2f} s after the revocation "
          f"({sum(kind == 'page' for t, kind in events if t > revoked_at)} page events in between)")


@pytest.mark.ray
def test_serve_redis_restart_is_counted_and_fails_running_jobs_as_lost(service, ray_metrics_targets):
    """A restart without data: the running job must end `failed`/`job_lost` (not a 404 for good while its runner
    goes on) and the loss must be counted; the buckets refill (the documented consequence, shown here)."""
    url, _, keys, _, redis = service
    pages = 40
    created = create_job(url, keys["acme"], pages)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    deadline = time.monotonic() + WAIT_S
    while httpx.get(url + f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]), timeout=WAIT_S).json()["pages_done"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ocr = {"image": base64.b64encode(png()).decode(), "task": "text"}
    statuses = [httpx.post(url + "/v1/ocr", json=ocr, headers=bearer(keys["bursty"]), timeout=WAIT_S).status_code
                for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    lost_before = agent_counter(ray_metrics_targets, "ocr_redis_resets", data="lost")
    jobs_lost_before = agent_counter(ray_metrics_targets, "ocr_jobs_lost")

    redis.kill()
    redis.start()  # same port, no data: a restart without persistence, or a failover to an empty replica
    restarted = time.monotonic()
    assert httpx.get(url + "/readyz", timeout=WAIT_S).status_code == 200  # the service works on
    # the documented consequence: the emptied bucket is a full one again
    assert httpx.post(url + "/v1/ocr", json=ocr, headers=bearer(keys["bursty"]), timeout=WAIT_S).status_code == 200

    view = None
    while time.monotonic() - restarted < WAIT_S:
        resp = httpx.get(url + f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]), timeout=WAIT_S)
        if resp.status_code == 200 and resp.json()["status"] == "failed":
            view = resp.json()
            break
        time.sleep(0.25)
    assert view is not None, f"the job never turned failed: last {resp.status_code} {resp.text[:200]}"
    job_failed_after = time.monotonic() - restarted
    assert view["error"]["code"] == "job_lost" and view["pages_done"] == pages, view
    assert {p["error"]["code"] for p in view["pages"] if p["status"] == "failed"} == {"job_lost"}

    deadline = time.monotonic() + WAIT_S  # state checks every 5 s; the Ray metrics agent exports every ~10 s
    while True:
        lost = agent_counter(ray_metrics_targets, "ocr_redis_resets", data="lost") - lost_before
        jobs_lost = agent_counter(ray_metrics_targets, "ocr_jobs_lost") - jobs_lost_before
        if lost >= 1 and jobs_lost >= 1 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert lost >= 1 and jobs_lost == 1, (lost, jobs_lost)
    assert redis.client().exists(MARKER_KEY)  # written again by the replica that noticed the loss
    print(f"\nRedis restart: job failed `job_lost` {job_failed_after:.1f} s after it; ocr_redis_resets_total"
          f"{{data=lost}} +{lost:g}, ocr_jobs_lost_total +{jobs_lost:g} at the metrics agent "
          f"{time.monotonic() - restarted:.1f} s after it")
