"""The CLI's Server-Sent Events client (`ocr-serve ocr` on a PDF follows the job's events): parsed as the HTML
standard says, and a stream that breaks is reopened with `Last-Event-ID` so no page is lost or counted twice."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from service.cli.client import MAX_RECONNECTS, ProgressBar, SSEParser, follow_job_events


def parse(text: str) -> list[tuple[str, str, str]]:
    parser = SSEParser()
    return [(e.event, e.data, e.id) for e in parser.events(text.split("\n"))]


def test_one_leading_space_is_stripped_and_no_more():
    assert parse("data:  two spaces\n\ndata:none\n\ndata: \tx \n\n") == [
        ("message", " two spaces", ""), ("message", "none", ""), ("message", "\tx ", "")]
    assert parse("event:  page\ndata: 1\n\n") == [(" page", "1", "")]


def test_data_lines_join_with_newlines_and_comments_are_skipped():
    assert parse(": keep-alive\ndata: first\n: another comment\ndata:\ndata: third\n\n") == [
        ("message", "first\n\nthird", "")]


def test_fields_without_a_colon_and_events_without_data():
    # `data` alone is an empty data line; an event with no data line is not dispatched; unknown fields are ignored
    assert parse("data\ndata\n\nevent: ping\n\nfoo: bar\ndata: x\n\n") == [
        ("message", "\n", ""), ("message", "x", "")]


def test_the_last_event_id_persists_and_retry_is_read():
    parser = SSEParser()
    got = list(parser.events("id: 3\nevent: page\ndata: {}\n\nevent: done\ndata: {}\n\nretry: 2500\nretry: x\n\n"
                             .split("\n")))
    assert [(e.event, e.id) for e in got] == [("page", "3"), ("done", "3")]
    assert parser.retry_ms == 2500 and parser.last_event_id == "3"


def test_a_partial_event_at_the_end_is_dropped():
    assert parse("data: complete\n\ndata: cut off") == [("message", "complete", "")]


def page_event(index: int) -> str:
    return (f"id: {index}\nevent: page\n"
            f"data: {json.dumps({'index': index, 'page': index + 1, 'status': 'ok'})}\n\n")


class BreakingStream(httpx.SyncByteStream):
    """Sends `text`, then the connection drops."""

    def __init__(self, text: str):
        self.text = text

    def __iter__(self):
        yield self.text.encode()
        raise httpx.ReadError("connection reset by peer")


def test_a_broken_stream_resumes_after_the_last_page_received():
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if len(requests) == 1:  # pages 1 and 2, then the connection drops
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=BreakingStream(": ping\n\n" + page_event(0) + page_event(1)))
        if len(requests) == 2:  # a replica draining
            return httpx.Response(503, json={"error": {"code": "shutting_down", "message": "retry"}})
        start = int(request.headers["last-event-id"]) + 1
        body = "".join(page_event(i) for i in range(start, 4))
        body += 'event: done\ndata: {"status": "succeeded", "pages_done": 4}\n\n'
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    out, waits = io.StringIO(), []
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://ocr") as client:
        failed = follow_job_events(client, "job-1", ProgressBar(4, out), sleep=waits.append)
    assert failed is None
    assert [r.headers.get("last-event-id") for r in requests] == [None, "1", "1"]
    assert [line.split("] ")[1].split("  ")[0] for line in out.getvalue().splitlines()] == [
        "1/4 pages", "2/4 pages", "3/4 pages", "4/4 pages", "4/4 pages"]
    assert len(waits) == 2 and waits[0] != waits[1] and all(0 < w <= 8 for w in waits)


def test_a_client_error_ends_the_stream_and_reconnections_are_bounded():
    def refused(request: httpx.Request) -> httpx.Response:
        body = 'event: error\ndata: {"error": {"code": "not_found", "message": "job expired"}}\n\n'
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    waits: list[float] = []
    with httpx.Client(transport=httpx.MockTransport(refused), base_url="http://ocr") as client:
        failed = follow_job_events(client, "job-1", ProgressBar(1, io.StringIO()), sleep=waits.append)
    assert failed["error"]["code"] == "not_found" and waits == []

    calls = []

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("connection refused")

    with httpx.Client(transport=httpx.MockTransport(down), base_url="http://ocr") as client:
        failed = follow_job_events(client, "job-1", ProgressBar(1, io.StringIO()), sleep=waits.append)
    assert failed["error"]["code"] == "connection_lost" and len(calls) == MAX_RECONNECTS + 1


@pytest.mark.parametrize("retry_ms", [250])
def test_the_servers_retry_field_sets_the_wait(retry_ms):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=BreakingStream(f"retry: {retry_ms}\n\n" + page_event(0)))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b'event: done\ndata: {"status": "succeeded", "pages_done": 1}\n\n')

    waits: list[float] = []
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://ocr") as client:
        assert follow_job_events(client, "job-1", ProgressBar(1, io.StringIO()), sleep=waits.append) is None
    assert waits == [retry_ms / 1000] and calls[1].headers["last-event-id"] == "0"
