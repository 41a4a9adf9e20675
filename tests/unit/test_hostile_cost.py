"""What a request costs, when it pays, and how memory and CPU stay bounded, in-process (no Ray): the limiter's
refund/adjust (local bucket), the fair slots behind the admission pool and the job page scheduler, the PDF sandbox's
per-document CPU budget, the decoded-pixel budget, a tenant's running-job cap, and the order of admission (the bucket
before the sandbox or the decoder). The same costs against the deployed service and a real Redis:
tests/integration/test_hostile_cost.py."""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import httpx
import pytest

from service.errors import OCRError
from tests.fixtures.images import huge_compressible_png, small_png
from tests.fixtures.pdfs import heavy_content_pdf


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
    """with one token spent, /v1/ocr (image and PDF), /v1/jobs (PDF and images) and the OpenAI
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
    """`/v1/ocr` takes one page; the 50-page heavy PDF is refused from its page count (its 50 content
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
    """every page of the heavy PDF costs its parse again; the document's CPU budget (over every sandbox
    process of the job) ends it: the rest of the pages fail `invalid_pdf`, and the CPU spent stays near the budget."""
    from service.engine.mock import MockEngine
    from tests.fixtures.api_inprocess import make_client

    budget_s = 2.0
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
    """Thirteen 6300² PNGs (516 MP, 0.7 MB on the wire) pass every per-image check, and together exceed
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
    """at the 202 nothing is decoded; pages are decoded one at a time as the job dispatches them."""
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
    """One ingress without Redis: `too_many_jobs` past the cap, per tenant; a cancelled job's slot is
    free again once its runner has stopped."""
    from service.http.app import create_app
    from service.pipeline.context import AppContext
    from service.engine.mock import MockEngine
    from service.config import Settings
    from tests.fixtures.api_inprocess import BearerTenants

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


async def test_the_page_scheduler_takes_the_tenants_jobs_in_turn():
    """one slot for job pages; tenant a's long job was first, tenant b's short job still gets every
    other page instead of waiting for a's whole job."""
    from service.http.app import create_app
    from service.pipeline.context import AppContext
    from service.engine.mock import MockEngine
    from service.config import Settings
    from tests.fixtures.api_inprocess import BearerTenants

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
