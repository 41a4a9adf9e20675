"""What a request costs, when it pays, and how memory and CPU stay bounded: hostile tenants against the real service.

Through Ray Serve over real HTTP (mock engine, two ingress replicas sharing Redis, API keys):
- a job of eight compressible 6300×6300 PNGs (0.4 MB on the wire, 317 MP decoded) holds a page or two of pixels in the
  ingress, and gives them back when it is cancelled;
- a 48 KB PDF whose 50 pages share one heavy content stream, from a tenant whose bucket is empty, gets its 429 before
  any PDFium work (no CPU spent on it), on /v1/jobs, /v1/ocr and the OpenAI endpoints;
- eight heavy PDFs at once per ingress replica from one tenant leave another tenant's small requests fast;
- a tenant's running jobs are capped (429 `too_many_jobs`), across both ingress replicas;
- one tenant's job backlog does not starve another tenant's interactive /v1/ocr.

In-process (no Ray): the limiter's refund/adjust (local and Redis Lua bucket), the fair slots behind the admission
pool and the job page scheduler, the PDF sandbox's per-document CPU budget, the decoded-pixel budget, and the order of
admission (the bucket before the sandbox or the decoder).
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image, ImageDraw

from service.cli.keys import add_key
from service.errors import OCRError
from tests.fixtures.pdfs import heavy_content_pdf
from tests.fixtures.reliability import replica_processes

MiB = 2**20
HUGE_SIDE = 6300  # 39.7 MP: just under max_image_pixels (40 MP)
HUGE_PAGES = 8
# the engine: four pages at once, half a second each (8 pages/s), so queues in front of it are visible; job pages
# may take half of its slots (job_pages_in_flight's default: 4 × 1 replica / 2, shared by 2 ingress replicas)
MOCK_DELAY_S = 0.5
ENGINE_SLOTS = 4
JOB_CAP = 3
HEAVY_AT_ONCE = 16  # eight per ingress replica


def small_png(size=(320, 120)) -> bytes:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((10, 40), "Invoice 12345", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def huge_compressible_png() -> bytes:
    """6300×6300 greyscale, almost all white: ≈ 40 KB of PNG, 40 MB of pixels once decoded (159 MB as the RGB image
    the engine gets). Greyscale, like most scans: a bare RGB PNG at the engine's size would go to the engine
    undecoded (`png_pixel_check: engine`), which decodes it in its own replica."""
    img = Image.new("L", (HUGE_SIDE, HUGE_SIDE), 255)
    ImageDraw.Draw(img).text((100, 100), "Page of a huge scan", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=9)
    return buf.getvalue()


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


# --- through the deployed service -------------------------------------------------------------------------------------

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
    """Finding 3: the job keeps the 1 MB of PNGs and decodes one page when it is dispatched; the ingress that runs it
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
    """Finding 4: the 50-page heavy PDF (≈ 70 s of PDFium CPU to load every page) from a tenant whose bucket is
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
    """Finding 4: eight heavy PDFs at once per ingress replica from one tenant (jobs and single-page /v1/ocr) run on
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
    """Finding 11: at most `max_running_jobs_per_tenant` jobs per tenant run at once, counted in Redis (the POSTs land
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
    """Finding 11: one tenant submits ten 30-page jobs (within its rate); only the cap runs, and the ingress replicas
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


# --- in-process: the limiter's adjust, fair slots, the admission order, PDF budgets -----------------------------------

class ManualClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_local_bucket_refunds_up_to_a_full_bucket_and_charges_into_debt():
    from service.admission.ratelimit import LocalTokenBucket

    clock = ManualClock()
    bucket = LocalTokenBucket(clock=clock)
    assert (await bucket.acquire("t", 3, 1.0, 5)).remaining == 2
    await bucket.adjust("t", -2, 1.0, 5)  # the real cost was 1: two tokens back
    assert (await bucket.acquire("t", 4, 1.0, 5)).allowed  # 4 of the 4 left
    await bucket.adjust("t", -100, 1.0, 5)  # never more than a full bucket
    assert (await bucket.acquire("t", 5, 1.0, 5)).allowed and not (await bucket.acquire("t", 1, 1.0, 5)).allowed
    await bucket.adjust("t", 100, 1.0, 5)  # a decode that cost more than estimated: debt, down to minus a bucket
    denied = await bucket.acquire("t", 1, 1.0, 5)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(6.0)  # from -5 to 1 at 1 token/s
    clock.now += 6.0
    assert (await bucket.acquire("t", 1, 1.0, 5)).allowed


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


async def test_fair_slots_take_tenants_in_turn_and_cap_each_tenant():
    from service.admission.workpool import FairSlots

    slots = FairSlots(capacity=2, per_tenant=1, max_waiting=3)
    order: list[str] = []

    async def work(tenant: str, hold: asyncio.Event):
        await slots.acquire(tenant)
        order.append(tenant)
        try:
            await hold.wait()
        finally:
            slots.release(tenant)

    release = asyncio.Event()
    tasks = [asyncio.create_task(work("a", release)) for _ in range(3)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(work("b", release)) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert order == ["a", "b"]  # a holds its one slot; b takes the other although a asked first
    with pytest.raises(OCRError) as err:  # a has 2 waiting; max 3 → a 4th and 5th: one more fits, then 503
        await asyncio.gather(*(slots.acquire("a") for _ in range(2)))
    assert err.value.code == "overloaded" and err.value.headers["Retry-After"]
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["a", "b", "a", "b", "a"]  # a and b in turn
    await asyncio.sleep(0)
    assert slots.free == 1 and slots.held == {"a": 1}  # the acquire that fitted in the queue holds its slot


async def test_a_cancelled_waiter_leaves_no_slot_behind():
    from service.admission.workpool import FairSlots

    slots = FairSlots(capacity=1)
    await slots.acquire("a")
    waiter = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    slots.release("a")
    assert slots.free == 1 and slots.waiting() == 0 and not slots.held


async def test_the_work_pool_never_runs_more_threads_than_it_has():
    """A request that goes away while its decode runs keeps its thread's slot until the thread is done."""
    from service.admission.workpool import WorkPool

    pool = WorkPool(threads=2, per_tenant=2, max_waiting=10)
    running, most = [0], [0]
    lock = threading.Lock()

    def blocking_work():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1

    first = [asyncio.create_task(pool.run("t", blocking_work)) for _ in range(2)]
    await asyncio.sleep(0.05)
    for task in first:
        task.cancel()  # the clients went away; the threads still run
    more = [asyncio.create_task(pool.run("t", blocking_work)) for _ in range(4)]
    await asyncio.gather(*first, return_exceptions=True)
    await asyncio.wait_for(asyncio.gather(*more), 10)
    pool.shutdown()
    assert most[0] == 2


class NeverParse:
    """Stands in for every parser of an upload: the test fails if one runs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("an upload was parsed before the tenant paid")


async def test_an_empty_bucket_is_refused_before_any_upload_is_parsed(monkeypatch):
    """Finding 4, in-process: with one token spent, /v1/ocr (image and PDF), /v1/jobs (PDF and images) and the OpenAI
    endpoints answer 429 and neither the image header parser, the decoder nor the PDF sandbox ran."""
    from service import imaging as images_module
    from service.admission import pdf as pdf_module
    from service.jobs import runner as runner_module
    from service.jobs import source as jobs_module
    from service.pipeline import page as ocr_module
    from service.engine.mock import MockEngine
    from tests.fixtures.api_inprocess import make_client

    image = base64.b64encode(small_png()).decode()
    async with make_client(MockEngine(), default_burst=1, default_rate=0.001) as client:
        assert (await client.post("/v1/ocr", json={"image": image, "task": "text"})).status_code == 200
        guard = NeverParse()
        for module, name in [(images_module, "decode_image"), (images_module, "probe_image"),
                             (ocr_module, "decode_image"), (ocr_module, "probe_image"), (jobs_module, "probe_image"),
                             (pdf_module, "_Worker"), (jobs_module, "PdfSession"), (ocr_module, "probe_upload"),
                             (ocr_module, "decode_base64_image"), (runner_module, "probe_source")]:
            monkeypatch.setattr(module, name, guard)  # raising: every name must exist where it is patched
        pdf = heavy_content_pdf(3, strokes=1000)
        answers = [
            await client.post("/v1/ocr", json={"image": image, "task": "text"}),
            await client.post("/v1/ocr", files={"file": ("d.pdf", pdf, "application/pdf")}, data={"task": "text"}),
            await client.post("/v1/jobs", files={"file": ("d.pdf", pdf, "application/pdf")}, data={"task": "text"}),
            await client.post("/v1/jobs", files=[("file", ("p.png", small_png(), "image/png"))] * 3,
                              data={"task": "text"}),
            await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}]}]}),
            await client.post("/v1/completions", json={"prompt": "", "image": image}),
        ]
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(429, "rate_limited")] * 6
    assert guard.calls == 0


def children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def test_v1_ocr_refuses_a_many_page_pdf_from_its_page_count_without_loading_a_page():
    """Finding 4: `/v1/ocr` takes one page; the 50-page heavy PDF is refused from its page count (its 50 content
    stream parses, ≈ 70 s of CPU, never happen)."""
    from service.engine.mock import MockEngine
    from tests.fixtures.api_inprocess import make_client

    heavy = heavy_content_pdf(50)
    cpu_before = children_cpu_s()
    async with make_client(MockEngine()) as client:
        resp = await client.post("/v1/ocr", files={"file": ("h.pdf", heavy, "application/pdf")},
                                 data={"task": "text"})
    cpu = children_cpu_s() - cpu_before
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_many_pages"
    assert cpu < 5.0, f"the sandbox spent {cpu:.1f}s of CPU to count pages"


async def test_a_pdf_job_stops_at_its_documents_cpu_budget():
    """Finding 4: every page of the heavy PDF costs its parse again; the document's CPU budget (over every sandbox
    process of the job) ends it: the rest of the pages fail `invalid_pdf`, and the CPU spent stays near the budget."""
    from service.engine.mock import MockEngine
    from tests.fixtures.api_inprocess import make_client

    budget_s = 4.0
    heavy = heavy_content_pdf(20, strokes=500_000)  # ≈ 0.2 s to load a page, ≈ 0.6 s to render it
    cpu_before = children_cpu_s()
    async with make_client(MockEngine(), pdf_document_cpu_s=budget_s) as client:
        resp = await client.post("/v1/jobs", files={"file": ("h.pdf", heavy, "application/pdf")},
                                 data={"task": "text"})
        assert resp.status_code == 202, resp.text
        runner = client._transport.app.state.jobs
        await asyncio.wait_for(runner.wait_all(), 120)
        final = (await client.get(f"/v1/jobs/{resp.json()['id']}")).json()
    cpu = children_cpu_s() - cpu_before
    failed = [p for p in final["pages"] if p["status"] == "failed"]
    assert final["status"] == "partial" and failed, final["status"]
    assert all(p["error"]["code"] == "invalid_pdf" and "budget" in p["error"]["message"] for p in failed)
    assert cpu < budget_s + 3.0, f"{cpu:.1f}s of sandbox CPU for a document allowed {budget_s:g}s"


async def test_a_jobs_decoded_pixels_are_budgeted_from_the_headers_before_any_decode(monkeypatch):
    """Finding 3: thirteen 6300² PNGs (516 MP, 0.7 MB on the wire) pass every per-image check, and together exceed
    `max_request_pixels` (500 MP): 413 `too_many_pixels`, nothing decoded."""
    from service import imaging as images_module
    from service.engine.mock import MockEngine
    from service.jobs import runner as runner_module
    from tests.fixtures.api_inprocess import make_client

    guard = NeverParse()
    monkeypatch.setattr(images_module, "decode_image", guard)
    monkeypatch.setattr(runner_module, "decode_image", guard)
    png = huge_compressible_png()
    async with make_client(MockEngine()) as client:
        resp = await client.post("/v1/jobs", files=[("file", (f"p{i}.png", png, "image/png")) for i in range(13)],
                                 data={"task": "text"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_many_pixels", resp.text
    assert guard.calls == 0


async def test_a_job_keeps_its_upload_and_decodes_a_page_when_it_is_dispatched(monkeypatch):
    """Finding 3: at the 202 nothing is decoded; pages are decoded one at a time as the job dispatches them."""
    from service.engine.mock import MockEngine
    from service.jobs import runner as runner_module
    from tests.fixtures.api_inprocess import make_client

    decoding = {"now": 0, "most": 0, "total": 0}
    real_decode = runner_module.decode_image

    def counting_decode(*args, **kwargs):
        decoding["now"] += 1
        decoding["most"] = max(decoding["most"], decoding["now"])
        decoding["total"] += 1
        try:
            time.sleep(0.05)
            return real_decode(*args, **kwargs)
        finally:
            decoding["now"] -= 1

    monkeypatch.setattr(runner_module, "decode_image", counting_decode)
    engine = MockEngine(delay_s=0.3)
    async with make_client(engine, job_page_concurrency=4) as client:
        resp = await client.post("/v1/jobs", files=[("file", (f"p{i}.png", small_png(), "image/png"))
                                                     for i in range(6)], data={"task": "text"})
        assert resp.status_code == 202 and decoding["total"] == 0
        runner = client._transport.app.state.jobs
        await asyncio.wait_for(runner.wait_all(), 60)
        final = (await client.get(f"/v1/jobs/{resp.json()['id']}")).json()
    assert final["status"] == "succeeded"
    assert decoding == {"now": 0, "most": 1, "total": 6}


async def test_a_tenants_running_jobs_are_capped_in_process():
    """Finding 11, one ingress without Redis: `too_many_jobs` past the cap, per tenant; a cancelled job's slot is
    free again once its runner has stopped."""
    from service.http.app import create_app
    from service.pipeline.context import AppContext
    from service.engine.mock import MockEngine
    from service.config import Settings
    from tests.test_jobs import BearerTenants

    ctx = AppContext(settings=Settings(max_running_jobs_per_tenant=2), engine=MockEngine(delay_s=0.2),
                     authenticator=BearerTenants())
    files = [("file", (f"p{i}.png", small_png(), "image/png")) for i in range(20)]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://test",
                                 timeout=60) as client:
        alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
        answers = [await client.post("/v1/jobs", files=files, data={"task": "text"}, headers=alice)
                   for _ in range(3)]
        assert [r.status_code for r in answers] == [202, 202, 429]
        assert answers[2].json()["error"]["code"] == "too_many_jobs" and answers[2].headers["Retry-After"]
        assert (await client.post("/v1/jobs", files=files, data={"task": "text"}, headers=bob)).status_code == 202
        await client.delete(f"/v1/jobs/{answers[0].json()['id']}", headers=alice)
        runner = client._transport.app.state.jobs
        for _ in range(100):  # the runner stops within a moment
            if answers[0].json()["id"] not in runner.running():
                break
            await asyncio.sleep(0.05)
        again = await client.post("/v1/jobs", files=files, data={"task": "text"}, headers=alice)
        assert again.status_code == 202, again.text
        for job in [answers[1], again]:
            await client.delete(f"/v1/jobs/{job.json()['id']}", headers=alice)
        await asyncio.wait_for(runner.wait_all(), 30)


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


async def test_the_page_scheduler_takes_the_tenants_jobs_in_turn():
    """Finding 11: one slot for job pages; tenant a's long job was first, tenant b's short job still gets every
    other page instead of waiting for a's whole job."""
    from service.http.app import create_app
    from service.pipeline.context import AppContext
    from service.engine.mock import MockEngine
    from service.config import Settings
    from tests.test_jobs import BearerTenants

    engine = MockEngine(delay_s=0.05)
    ctx = AppContext(settings=Settings(job_pages_in_flight=1, job_page_concurrency=4), engine=engine,
                     authenticator=BearerTenants())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://test",
                                 timeout=60) as client:
        first = await client.post("/v1/jobs", files=[("file", (f"a{i}.png", small_png(), "image/png"))
                                                     for i in range(12)],
                                  data={"task": "text"}, headers={"Authorization": "Bearer a"})
        second = await client.post("/v1/jobs", files=[("file", (f"b{i}.png", small_png(), "image/png"))
                                                      for i in range(4)],
                                   data={"task": "text"}, headers={"Authorization": "Bearer b"})
        assert first.status_code == second.status_code == 202
        await asyncio.wait_for(client._transport.app.state.jobs.wait_all(), 60)
    owners = ["a" if r.request_id.startswith(first.json()["id"]) else "b" for r in engine.requests]
    last_b = max(i for i, owner in enumerate(owners) if owner == "b")
    assert owners.count("b") == 4 and last_b <= 10, owners  # b's 4 pages among a's first few, not after all 12
