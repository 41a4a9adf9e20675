"""The low-severity hostile cases through the real service (Ray Serve over real HTTP, mock engine, API keys, a real
redis-server restarted under it, the metrics read back from the Ray metrics agent): repeated credential headers,
adapter names only to keys, one message for every refused webhook, an event stream that ends when its key is revoked,
and a Redis restart counted, with its running jobs failed as lost. The state watch against a real Redis restart."""

from __future__ import annotations

import base64
import json
import re
import time

import httpx
import pytest

from service.cli.keys import add_key, revoke_key
from service.admission.ratelimit import make_redis_client
from service.admission.redis_state import MARKER_KEY, RedisStateWatch
from tests.fixtures.jobs import image_parts, png

WAIT_S = 60.0
SECRET_ADAPTER = "acme-private-invoices"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


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
    return httpx.post(url + "/v1/jobs", files=image_parts(pages, size=(64, 32)), data={"task": "text", **fields},
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
    ocr = {"image": base64.b64encode(png(size=(64, 32))).decode(), "task": "text"}
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

    deadline = time.monotonic() + WAIT_S  # state checks every 5 s; metrics reach the agent every METRICS_REPORT_S
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
