"""What a request costs, when it pays, and how memory and CPU stay bounded: hostile tenants against the real service.

Through Ray Serve over real HTTP (mock engine, two ingress replicas sharing Redis, API keys):
- a job of eight compressible 6300×6300 PNGs (0.4 MB on the wire, 317 MP decoded) holds a page or two of pixels in the
  ingress, and gives them back when it is cancelled;
- a 48 KB PDF whose 50 pages share one heavy content stream, from a tenant whose bucket is empty, gets its 429 before
  any PDFium work (no CPU spent on it), on /v1/jobs, /v1/ocr and the OpenAI endpoints;
- eight heavy PDFs at once per ingress replica from one tenant leave another tenant's small requests fast;
- a tenant's running jobs are capped (429 `too_many_jobs`), across both ingress replicas;
- one tenant's job backlog does not starve another tenant's interactive /v1/ocr.

Against a real redis-server: the Redis Lua bucket's adjust has the local bucket's rules, and the job slots are shared
by ingress replicas, leased and given back.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from service.cli.keys import add_key
from tests.fixtures.images import HUGE_SIDE, huge_compressible_png, small_png
from tests.fixtures.pdfs import heavy_content_pdf
from tests.fixtures.reliability import replica_processes


MiB = 2**20


HUGE_PAGES = 8
# the engine: four pages at once, half a second each (8 pages/s), so queues in front of it are visible; job pages
# may take half of its slots (job_pages_in_flight's default: 4 × 1 replica / 2, shared by 2 ingress replicas)
MOCK_DELAY_S = 0.5
ENGINE_SLOTS = 4
JOB_CAP = 3
HEAVY_AT_ONCE = 16  # eight per ingress replica


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process and of its reaped children (the PDF sandbox subprocesses of an ingress replica)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system + t.children_user + t.children_system


class RssSampler:
    """Peak RSS of some processes, sampled every 50 ms in a thread."""

    def __init__(self, pids: list[int]):
        import psutil

        self.procs = [psutil.Process(pid) for pid in pids]
        self.peak = {p.pid: p.memory_info().rss for p in self.procs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for proc in self.procs:
                self.peak[proc.pid] = max(self.peak[proc.pid], proc.memory_info().rss)
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def now(self) -> dict[int, int]:
        return {p.pid: p.memory_info().rss for p in self.procs}


def wait_job(client: httpx.Client, job_id: str, headers, predicate, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        body = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        if predicate(body) or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def cancel_all(client: httpx.Client, headers, job_ids) -> None:
    for job_id in job_ids:
        client.delete(f"/v1/jobs/{job_id}", headers=headers)
    for job_id in job_ids:
        wait_job(client, job_id, headers, lambda b: b["status"] in ("cancelled", "succeeded", "partial", "failed"),
                 timeout_s=60)


@pytest.fixture(scope="module")
def costly(serve_app, redis_server_module, tmp_path_factory):
    """Mock engine (4 pages at once, 0.5 s each), two ingress replicas sharing Redis, one key per tenant."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = {name: add_key(key_file, tenant=name, rate=100.0, burst=1000.0)[0]
            for name in ("memory", "heavy", "light", "backlog", "capped", "other")}
    keys["empty"] = add_key(key_file, tenant="empty", rate=0.001, burst=1.0)[0]  # one token, no refill to speak of
    url = serve_app(engine="mock", mock_delay_s=MOCK_DELAY_S, max_ongoing_requests=ENGINE_SLOTS, ingress_replicas=2,
                    api_keys_file=str(key_file), redis_url=redis_server_module.url,
                    max_running_jobs_per_tenant=JOB_CAP)
    return url, keys


@pytest.mark.ray
def test_a_job_of_huge_compressible_pngs_holds_a_page_or_two_and_frees_it_on_cancel(costly):
    """the job keeps the 1 MB of PNGs and decodes one page when it is dispatched; the ingress that runs it
    grows by a page or two (a decoded page: 6300² × 4 bytes in Pillow ≈ 151 MiB), not by the eight pages, and gives
    the memory back when the job is cancelled."""
    url, keys = costly
    png = huge_compressible_png()
    files = [("file", (f"p{i}.png", png, "image/png")) for i in range(HUGE_PAGES)]
    assert sum(len(f[1][1]) for f in files) < 2 * MiB
    pids = list(replica_processes("OCRIngress").values())
    assert len(pids) == 2
    headers = auth(keys["memory"])
    with httpx.Client(base_url=url, timeout=300) as client:
        client.post("/v1/ocr", json={"image": base64.b64encode(small_png()).decode(), "task": "text"},
                    headers=headers)  # both replicas warm
        time.sleep(1.0)
        with RssSampler(pids) as rss:
            before = rss.now()
            resp = client.post("/v1/jobs", files=files, data={"task": "text"}, headers=headers)
            assert resp.status_code == 202, resp.text
            job_id = resp.json()["id"]
            running = wait_job(client, job_id, headers, lambda b: b["pages_done"] >= 3 or b["status"] != "running")
            assert running["status"] == "running", running  # still running: the cancel below has work to stop
            cancelled = client.delete(f"/v1/jobs/{job_id}", headers=headers).json()
            assert cancelled["status"] == "cancelled"
            time.sleep(3.0)  # the runner stops, its in-flight pages are cancelled
            after = rss.now()
            peak = dict(rss.peak)
    growth_peak = max(peak[pid] - before[pid] for pid in pids)
    growth_after = max(after[pid] - before[pid] for pid in pids)
    print(f"\n8 x {HUGE_SIDE}² PNG job: ingress RSS {max(before.values()) / MiB:.0f} MiB before, peak +"
          f"{growth_peak / MiB:.0f} MiB, after cancel +{growth_after / MiB:.0f} MiB")
    page_bytes = HUGE_SIDE * HUGE_SIDE * 4
    assert growth_peak < 3 * page_bytes, f"peak +{growth_peak / MiB:.0f} MiB: more than a page or two"
    assert growth_after < page_bytes, f"+{growth_after / MiB:.0f} MiB still held after cancel"


@pytest.mark.ray
def test_a_heavy_pdf_from_an_empty_bucket_gets_its_429_before_any_pdf_work(costly):
    """the 50-page heavy PDF (≈ 70 s of PDFium CPU to load every page) from a tenant whose bucket is
    empty: 429 on every endpoint, at once, and the ingress replicas spend no CPU on it (no sandbox started)."""
    url, keys = costly
    heavy = heavy_content_pdf(50)
    one_heavy_page = heavy_content_pdf(1)
    image = base64.b64encode(small_png()).decode()
    headers = auth(keys["empty"])
    pids = list(replica_processes("OCRIngress").values())
    with httpx.Client(base_url=url, timeout=300) as client:
        first = client.post("/v1/ocr", json={"image": image, "task": "text"}, headers=headers)
        assert first.status_code == 200, first.text  # the one token
        cpu_before = sum(process_cpu_s(pid) for pid in pids)
        started = time.perf_counter()
        answers = {
            "jobs": client.post("/v1/jobs", files={"file": ("h.pdf", heavy, "application/pdf")},
                                data={"task": "text"}, headers=headers),
            "ocr 50 pages": client.post("/v1/ocr", files={"file": ("h.pdf", heavy, "application/pdf")},
                                        data={"task": "text"}, headers=headers),
            "ocr 1 page": client.post("/v1/ocr", files={"file": ("h.pdf", one_heavy_page, "application/pdf")},
                                      data={"task": "text"}, headers=headers),
            "ocr image": client.post("/v1/ocr", json={"image": image, "task": "text"}, headers=headers),
            "chat": client.post("/v1/chat/completions", headers=headers, json={"messages": [{
                "role": "user", "content": [{"type": "image_url",
                                             "image_url": {"url": "data:image/png;base64," + image}}]}]}),
            "completions": client.post("/v1/completions", headers=headers, json={"prompt": "", "image": image}),
        }
        elapsed = time.perf_counter() - started
        cpu = sum(process_cpu_s(pid) for pid in pids) - cpu_before
    statuses = {name: (r.status_code, r.json().get("error", {}).get("code")) for name, r in answers.items()}
    print(f"\nheavy PDF from an empty bucket: {statuses}, {elapsed:.2f}s, ingress CPU {cpu:.2f}s")
    assert all(s == (429, "rate_limited") for s in statuses.values()), statuses
    assert all(r.headers.get("Retry-After") for r in answers.values())
    assert cpu < 2.0, f"the ingress replicas spent {cpu:.1f} CPU seconds on refused requests"
    assert elapsed < 20.0


@pytest.mark.ray
def test_heavy_pdfs_at_once_leave_another_tenants_small_requests_fast(costly):
    """eight heavy PDFs at once per ingress replica from one tenant (jobs and single-page /v1/ocr) run on
    the bounded admission pool, a few at a time per tenant, under a per-document CPU budget; another tenant's small
    requests are not queued behind them (generous bound: the engine alone takes 0.5 s a request)."""
    url, keys = costly
    heavy_doc = heavy_content_pdf(50)
    heavy_page = heavy_content_pdf(1, strokes=3_000_000)
    image = base64.b64encode(small_png()).decode()
    light, heavy = auth(keys["light"]), auth(keys["heavy"])
    latencies: list[float] = []
    job_ids: list[str] = []
    statuses: list[int] = []

    def heavy_request(i: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            if i % 2:
                resp = client.post("/v1/jobs", files={"file": ("h.pdf", heavy_doc, "application/pdf")},
                                   data={"task": "text"}, headers=heavy)
                if resp.status_code == 202:
                    job_ids.append(resp.json()["id"])
            else:
                resp = client.post("/v1/ocr", files={"file": ("h.pdf", heavy_page, "application/pdf")},
                                   data={"task": "text"}, headers=heavy)
            statuses.append(resp.status_code)

    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(3):  # the light tenant's baseline
            started = time.perf_counter()
            assert client.post("/v1/ocr", json={"image": image, "task": "text"}, headers=light).status_code == 200
            baseline = time.perf_counter() - started
        with ThreadPoolExecutor(HEAVY_AT_ONCE) as pool:
            futures = [pool.submit(heavy_request, i) for i in range(HEAVY_AT_ONCE)]
            time.sleep(1.0)  # the heavy work has started
            window_end = time.monotonic() + 30
            while time.monotonic() < window_end:
                started = time.perf_counter()
                try:
                    resp = client.post("/v1/ocr", json={"image": image, "task": "text"}, headers=light)
                    assert resp.status_code == 200, resp.text
                    latencies.append(time.perf_counter() - started)
                except httpx.TimeoutException:
                    latencies.append(120.0)
            for future in futures:
                future.result()
        cancel_all(client, heavy, job_ids)
    print(f"\nlight tenant under {HEAVY_AT_ONCE} heavy PDFs: baseline {baseline:.2f}s, {len(latencies)} requests, "
          f"max {max(latencies):.2f}s; heavy statuses {sorted(statuses)}")
    assert max(latencies) < 5.0, f"another tenant's small request took {max(latencies):.1f}s"


@pytest.mark.ray
def test_a_tenants_running_jobs_are_capped_across_ingress_replicas(costly):
    """at most `max_running_jobs_per_tenant` jobs per tenant run at once, counted in Redis (the POSTs land
    on both ingress replicas); more answer 429 `too_many_jobs`; another tenant is not affected; a cancelled job
    frees its slot."""
    url, keys = costly
    capped, other = auth(keys["capped"]), auth(keys["other"])
    files = [("file", (f"p{i}.png", small_png(), "image/png")) for i in range(40)]
    accepted: list[str] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        answers = []
        for _ in range(JOB_CAP + 3):
            with httpx.Client(base_url=url, timeout=120) as fresh:  # a new connection: either ingress replica
                resp = fresh.post("/v1/jobs", files=files, data={"task": "text"}, headers=capped)
            answers.append(resp)
            if resp.status_code == 202:
                accepted.append(resp.json()["id"])
        refused = [r for r in answers if r.status_code != 202]
        other_job = client.post("/v1/jobs", files=files[:2], data={"task": "text"}, headers=other)
        client.delete(f"/v1/jobs/{accepted[0]}", headers=capped)
        wait_job(client, accepted[0], capped, lambda b: b["status"] == "cancelled")
        time.sleep(1.0)  # the runner ends and frees its slot
        again = client.post("/v1/jobs", files=files, data={"task": "text"}, headers=capped)
        if again.status_code == 202:
            accepted.append(again.json()["id"])
        cancel_all(client, capped, accepted[1:])
    print(f"\njobs of one tenant: {[r.status_code for r in answers]}, after a cancel {again.status_code}")
    assert len(accepted) - (again.status_code == 202) == JOB_CAP
    assert refused and all(r.status_code == 429 and r.json()["error"]["code"] == "too_many_jobs" and
                           r.headers.get("Retry-After") for r in refused)
    assert other_job.status_code == 202
    assert again.status_code == 202, again.text


@pytest.mark.ray
def test_a_tenants_job_backlog_does_not_starve_another_tenants_ocr(costly):
    """one tenant submits ten 30-page jobs (within its rate); only the cap runs, and the ingress replicas
    keep at most `job_pages_in_flight` job pages each at the engine (by default half its slots in all), so another
    tenant's /v1/ocr finds a free slot instead of queueing behind the backlog (the engine: 8 pages/s)."""
    url, keys = costly
    backlog, light = auth(keys["backlog"]), auth(keys["light"])
    files = [("file", (f"p{i}.png", small_png(), "image/png")) for i in range(30)]
    image = base64.b64encode(small_png()).decode()
    job_ids, latencies = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(10):
            resp = client.post("/v1/jobs", files=files, data={"task": "text"}, headers=backlog)
            if resp.status_code == 202:
                job_ids.append(resp.json()["id"])
        time.sleep(2.0)  # the jobs' pages reach the engine
        for _ in range(8):
            started = time.perf_counter()
            resp = client.post("/v1/ocr", json={"image": image, "task": "text"}, headers=light)
            assert resp.status_code == 200, resp.text
            latencies.append(time.perf_counter() - started)
        running = [client.get(f"/v1/jobs/{j}", headers=backlog).json()["status"] for j in job_ids]
        cancel_all(client, backlog, job_ids)
    print(f"\njob backlog: {len(job_ids)} jobs accepted ({running.count('running')} running); other tenant's "
          f"/v1/ocr max {max(latencies):.2f}s, mean {sum(latencies) / len(latencies):.2f}s: "
          f"{[round(t, 2) for t in latencies]}")
    assert len(job_ids) == JOB_CAP
    assert max(latencies) < 5.0, f"another tenant's /v1/ocr waited {max(latencies):.1f}s behind a job backlog"


async def test_redis_bucket_adjust_has_the_local_buckets_rules(redis_server):
    from service.admission.ratelimit import FailoverLimiter, RedisTokenBucket

    bucket = RedisTokenBucket.from_url(redis_server.url, timeout_s=0.5)
    try:
        rate = 0.01  # nothing refills during the test
        assert (await bucket.acquire("t", 3, rate, 5)).remaining == pytest.approx(2, abs=0.01)
        await bucket.adjust("t", -2, rate, 5)
        assert (await bucket.acquire("t", 4, rate, 5)).allowed
        await bucket.adjust("t", -100, rate, 5)
        assert (await bucket.acquire("t", 5, rate, 5)).allowed
        await bucket.adjust("t", 100, rate, 5)
        denied = await bucket.acquire("t", 1, rate, 5)
        assert not denied.allowed and denied.retry_after_s == pytest.approx(600, rel=0.01)  # (1 - (-5)) / 0.01
        await bucket.adjust("fresh", -1, rate, 5)  # an unknown bucket is a full one, and stays full
        assert float(redis_server.client().hget("ocr:rl:{fresh}", "tokens")) == 5
        assert redis_server.client().pttl("ocr:rl:{t}") > 0
        # Redis gone: the failover limiter settles on its local share (fail open), without raising
        limiter = FailoverLimiter(bucket, fail_mode="open")
        redis_server.kill()
        await limiter.adjust("t", 1, rate, 5)
        assert limiter.degraded and limiter.backend_errors == 1
    finally:
        await bucket.close()


async def test_the_redis_job_slots_are_shared_leased_and_given_back(redis_server, monkeypatch):
    from service.jobs import store as store_module

    monkeypatch.setattr(store_module, "SLOT_LEASE_S", 0.5)
    stores = [store_module.RedisJobStore(redis_server.url, 60) for _ in range(2)]  # two ingress replicas
    try:
        a, b = stores
        assert await a.take_slot("t", "job-1", 2) and await b.take_slot("t", "job-2", 2)
        assert not await a.take_slot("t", "job-3", 2) and not await b.take_slot("t", "job-3", 2)
        assert await b.take_slot("t", "job-1", 2)  # a job that holds one keeps it
        assert await a.take_slot("other", "job-9", 2)
        await b.release_slot("t", "job-1")
        assert await a.take_slot("t", "job-3", 2)
        for _ in range(3):  # job-3 renews its lease, job-2's replica stopped: job-2's slot runs out
            await asyncio.sleep(0.25)
            await a.renew_slot("t", "job-3")
        assert await b.take_slot("t", "job-4", 2)
        assert not await b.take_slot("t", "job-5", 2)
    finally:
        for store in stores:
            await store.close()
