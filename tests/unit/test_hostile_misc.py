"""The low-severity hostile cases in-process (mock engine, fakes): repeated credential headers, what the service tells
callers without a key (adapter names, the OpenAPI document, webhook host resolution), event streams that outlive a
revoked key, and a Redis restart that resets buckets and loses running jobs (the state watch over a fake Redis; the
runner of a job whose state vanished). The same cases through the real service and a real redis-server restarted under
it: tests/integration/test_hostile_misc.py."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from pathlib import Path

import httpx
import pytest

from service.admission.auth import KeyFileAuthenticator, key_from_headers
from service.cli.keys import add_key, revoke_key
from service.admission.redis_state import RedisStateWatch
from service.http.app import create_app
from service.pipeline.context import AppContext
from service.engine.mock import MockEngine
from service.errors import OCRError
from service.jobs import runner as runner_module
from service.jobs.webhook import validate_webhook
from service.observability.metrics import IngressMetrics
from service.config import Settings
from tests.fixtures.jobs import image_parts

WAIT_S = 60.0
SECRET_ADAPTER = "acme-private-invoices"


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
        assert public.json()["features"] == {"adapters": True}  # the mock engine serves adapters: the field shows
        keyed = (await client.get("/ui/config.json", headers=bearer(keys["acme"]))).json()
        assert keyed["adapters"] == [SECRET_ADAPTER] and keyed["authenticated"] is True
        assert (await client.get("/ui/config.json", headers=bearer("not-a-key"))).status_code == 401

        for probe in ("/healthz", "/readyz", "/openapi.json", "/docs"):
            assert (await client.get(probe)).status_code == 200, probe
        assert SECRET_ADAPTER not in (await client.get("/openapi.json")).text


async def test_the_openapi_document_shows_no_deployment_details(key_file):
    """Nothing of the engine, adapters, hosts, secrets or sizes is in it: only the request limits a client must keep to
    (field counts and lengths, pages per job: tests/unit/test_openapi_document.py)."""
    path, _, _ = key_file
    plain, _ = keyed_app(path, MockEngine())
    other, _ = keyed_app(path, MockEngine(adapters=["tenant-x"], model_name="custom-model"),
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


async def test_a_revoked_key_ends_its_event_stream(key_file):
    path, keys, ids = key_file
    pages = 30
    app, _ = keyed_app(path, MockEngine(delay_s=0.2), job_page_concurrency=1)
    async with client_of(app) as client:
        created = await client.post("/v1/jobs", files=image_parts(pages, size=(64, 32)), data={"task": "text"},
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


async def test_a_job_whose_state_vanished_is_failed_as_lost(key_file, monkeypatch):
    """What Redis losing the job's keys looks like to the runner (here the in-process store forgets the job)."""
    monkeypatch.setattr(runner_module, "HEARTBEAT_S", 0.2)
    path, keys, _ = key_file
    recorder = Recorder()
    pages = 20
    engine = MockEngine(delay_s=0.1)
    app, ctx = keyed_app(path, engine, metrics=IngressMetrics(recorder), job_page_concurrency=1)
    async with client_of(app) as client:
        created = await client.post("/v1/jobs", files=image_parts(pages, size=(64, 32)), data={"task": "text"},
                                    headers=bearer(keys["acme"]))
        job_id = created.json()["id"]
        while (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]))).json()["pages_done"] < 2:
            await asyncio.sleep(0.05)
        store = app.state.jobs.store
        pages_when_failed: list[int] = []
        update = store.update

        async def update_seen(job_id_: str, **fields):
            if fields.get("status") == "failed":  # what a reader polling for the end would see at that moment
                pages_when_failed.append(len(await store.pages(job_id_)))
            await update(job_id_, **fields)

        monkeypatch.setattr(store, "update", update_seen)
        for state in (store._jobs, store._pages, store._expires):
            state.pop(job_id)
        assert (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]))).status_code == 404
        await asyncio.wait_for(app.state.jobs.wait_all(), WAIT_S)
        view = (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["acme"]))).json()
        events = sse_events((await client.get(f"/v1/jobs/{job_id}/events", headers=bearer(keys["acme"]))).text)
    assert view["status"] == "failed" and view["error"]["code"] == "job_lost", view
    assert view["pages_done"] == pages and len(view["pages"]) == pages  # every page accounted for
    assert pages_when_failed == [pages]  # ...before the job turns failed
    assert {p["error"]["code"] for p in view["pages"] if p["status"] == "failed"} == {"job_lost"}
    assert len(engine.requests) < pages  # the runner stopped instead of finishing pages nobody can read
    assert events[-1][0] == "done" and events[-1][1]["error"]["code"] == "job_lost"
    assert recorder.count("ocr_jobs_lost") == 1
