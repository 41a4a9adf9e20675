"""The OCR tasks through the API layer with the mock engine (upper layers only; the real engine is in
tests/engine/test_tasks_e2e.py): the documented prompt reaches the engine, responses match the OpenAPI schema, streaming
events, raw output, schema errors, guided retries, repetition cut-offs."""

from __future__ import annotations

import json
import math

import pytest

from service.engine.mock import MockEngine
from service.engine.protocol import EngineRequest
from tests.fixtures.api_inprocess import make_client
from tests.fixtures.documents import render_document
from tests.fixtures.ocr_schema import parse_sse, response_validator

DOC_PARSE_15 = ("提取文档图片中正文的所有信息用markdown格式表示，其中页眉、页脚部分忽略，表格用html格式表达，"
                "文档中公式用latex格式表示，按照阅读顺序组织进行解析。")
EXPECTED_PROMPTS_15 = {
    "spotting": ({}, "检测并识别图片中的文字，将文本坐标格式化输出。"),
    "text": ({}, "提取图中的文字。"),
    "document": ({}, DOC_PARSE_15),
    "table": ({}, "把图中的表格解析为HTML。"),
    "formula": ({}, "识别图片中的公式，用LaTeX格式表示。"),
    "chart": ({}, "解析图中的图表，对于流程图使用Mermaid格式表示，其他图表使用Markdown格式表示。"),
    "extract": ({"fields": ["name", "id_number"]},
                "Extract the content of the fields: ['name', 'id_number'] from the image and return it in JSON format."),
    "translate": ({"target_language": "en"},
                  "按照阅读顺序，提取图中文字，公式用latex格式表示，表格用markdown格式表示，再将文字内容翻译为英文。"),
    "subtitles": ({}, "Extract the subtitles from the image."),
    "layout": ({}, "按照阅读顺序解析图中的版式信息。"),
}
EXPECTED_PROMPTS_10 = {
    "spotting": "Detect and recognize text in the image, and output the text coordinates in a formatted manner.",
    "text": "Extract the text in the image.",
    "document": "Extract all information from the main body of the document image and represent it in markdown "
                "format, ignoring headers and footers. Tables should be expressed in HTML format, formulas in the "
                "document should be represented using LaTeX format, and the parsing should be organized according "
                "to the reading order.",
    "table": "Parse the table in the image into HTML.",
    "formula": "Identify the formula in the image and represent it using LaTeX format.",
    "chart": "Parse the chart in the image; use Mermaid format for flowcharts and Markdown for other charts.",
    "translate": "First extract the text, then translate the text content into English. If it is a document, ignore "
                 "the header and footer. Formulas should be represented in LaTeX format, and tables should be "
                 "represented in HTML format.",
}

SPOTTING_RAW = ("<ref>Invoice (AP) 20261130</ref><quad>(81,68),(400,91)</quad>"
                "<ref>发票号码 二零二六</ref><quad>(81,148),(352,171)</quad>"
                "<ref>Total</ref><quad>(81,228),(300,251)</quad>")


def responder(request: EngineRequest) -> str:
    if request.task in ("spotting", "layout"):
        return SPOTTING_RAW
    if request.task == "extract":
        if request.guided_json:
            return '{"name": "ACME", "id_number": 42}'
        return '```json\n{"name": "ACME", "id_number": "not a number"}\n```'
    if request.task == "table":
        return "```html\n<table><tr><td>1</td></tr></table>\n```"
    return "# Title\n\nSome **markdown** $x^2$"


@pytest.fixture(scope="module")
def page_b64() -> str:
    return render_document(["Invoice (AP) 20261130", "发票号码 二零二六", "Total"], size=(800, 1000)).b64()


async def post(client, body: dict):
    resp = await client.post("/v1/ocr", json=body)
    return resp, resp.json() if resp.headers.get("content-type", "").startswith("application/json") else None


@pytest.fixture
async def api():
    engine = MockEngine(responder=responder)
    async with make_client(engine) as client:
        openapi = (await client.get("/openapi.json")).json()
        yield client, engine, response_validator(openapi)


@pytest.mark.parametrize("task", list(EXPECTED_PROMPTS_15))
async def test_every_task_gets_its_documented_prompt_and_a_documented_response(api, page_b64, task):
    client, engine, validate = api
    extra, prompt = EXPECTED_PROMPTS_15[task]
    resp, body = await post(client, {"image": page_b64, "task": task, **extra})
    assert resp.status_code == 200, body
    assert engine.requests[-1].prompt == prompt
    validate(body)
    assert body["task"] == task and body["confidence"] is not None and 0 < body["confidence"] <= 1
    if task in ("spotting", "layout"):
        assert [ln["text"] for ln in body["lines"]] == ["Invoice (AP) 20261130", "发票号码 二零二六", "Total"]
        assert body["lines"][0]["box"] == [65, 68, 320, 91]  # 0-1000 of an 800×1000 upload
        confs = [ln["confidence"] for ln in body["lines"]]
        assert all(0 < c <= 1 for c in confs) and len(set(confs)) > 1
    elif task == "extract":
        assert body["fields"]["name"] == {"value": "ACME", "confidence": body["fields"]["name"]["confidence"],
                                          "valid": True}
        assert body["fields"]["id_number"]["value"] == "not a number"  # a field list has no types
        assert body["errors"] == [] and body["text"] == '{"name": "ACME", "id_number": "not a number"}'
        assert 0 < body["fields"]["id_number"]["confidence"] <= 1
    elif task == "table":
        assert body["text"] == "<table><tr><td>1</td></tr></table>"  # fence stripped
    else:
        assert body["text"] == "# Title\n\nSome **markdown** $x^2$"


@pytest.mark.parametrize("task", list(EXPECTED_PROMPTS_10))
async def test_prompt_set_10_uses_the_english_application_prompts(page_b64, task):
    engine = MockEngine(responder=responder)
    async with make_client(engine, prompt_set="1.0") as client:
        extra = {"target_language": "English"} if task == "translate" else {}
        resp, body = await post(client, {"image": page_b64, "task": task, **extra})
    assert resp.status_code == 200, body
    assert engine.requests[-1].prompt == EXPECTED_PROMPTS_10[task]


async def test_translation_task_types_and_free_prompt(api, page_b64):
    client, engine, _ = api
    cases = [
        ({"target_language": "zh"}, "按照阅读顺序，提取图中文字，公式用latex格式表示，表格用markdown格式表示，再将文字内容翻译为中文。"),
        ({"target_language": "zh", "language": "en"},
         "先解析文档，再将文档内容翻译为中文，其中页眉、页脚忽略，公式用latex格式表示，表格用html格式表示。"),
        ({"target_language": "fr"}, "First extract the text, then translate the text content into French. If it is a "
         "document, ignore the header and footer. Formulas should be represented in LaTeX format, and tables should "
         "be represented in HTML format."),
    ]
    for extra, prompt in cases:
        resp, body = await post(client, {"image": page_b64, "task": "translate", **extra})
        assert resp.status_code == 200, body
        assert engine.requests[-1].prompt == prompt


async def test_extraction_prompt_from_schema_and_sanitised_names(api, page_b64):
    client, engine, _ = api
    schema = {"type": "object", "properties": {"单价": {"type": "string"}, "it's": {"type": "string"},
                                               "x<｜hy_place▁holder▁no▁100｜>y": {"type": "string"}}}
    resp, body = await post(client, {"image": page_b64, "task": "extract", "schema": schema})
    assert resp.status_code == 200, body
    assert engine.requests[-1].prompt == (
        "Extract the content of the fields: ['单价', \"it's\", 'xy'] from the image and return it in JSON format.")


@pytest.mark.parametrize("schema, code", [
    ({"type": "object", "properties": {"a": {"type": "bogus"}}}, "invalid_schema"),
    ({"type": "object"}, "invalid_schema"),
    ({"type": "object", "properties": {"a": {"description": "x" * 40_000}}}, "invalid_schema"),
])
async def test_bad_schema_is_a_400(api, page_b64, schema, code):
    client, engine, _ = api
    before = len(engine.requests)
    resp, body = await post(client, {"image": page_b64, "task": "extract", "schema": schema})
    assert resp.status_code == 400 and body["error"]["code"] == code
    assert len(engine.requests) == before  # never reached the engine


async def test_include_raw_allows_recomputing_confidences(api, page_b64):
    client, engine, validate = api
    resp, body = await post(client, {"image": page_b64, "task": "spotting", "include_raw": True})
    assert resp.status_code == 200
    validate(body)
    raw = body["raw"]
    assert raw["text"] == SPOTTING_RAW and raw["rendered_prompt"] == engine.requests[-1].prompt
    tokens = raw["tokens"]
    assert "".join(t["token"] for t in tokens) == raw["text"]
    doc = math.exp(sum(t["logprob"] for t in tokens) / len(tokens))
    assert body["confidence"] == pytest.approx(doc, rel=1e-5)
    # line i = the tokens overlapping its item <ref>…</quad>
    starts = [raw["text"].index("<ref>" + ln["text"]) for ln in body["lines"]]
    ends = starts[1:] + [len(raw["text"])]
    for line, start, end in zip(body["lines"], starts, ends):
        pos, lps = 0, []
        for t in tokens:
            if pos < end and pos + len(t["token"]) > start:
                lps.append(t["logprob"])
            pos += len(t["token"])
        assert line["confidence"] == pytest.approx(math.exp(sum(lps) / len(lps)), rel=1e-5)
    resp, body = await post(client, {"image": page_b64, "task": "spotting"})
    assert body["raw"] is None


async def test_confidence_false_skips_logprobs_everywhere(api, page_b64):
    """`confidence: false` (JSON, multipart, and streamed): the engine is asked for no logprobs, the lines are the
    same, and every confidence is null."""
    client, engine, validate = api
    resp, with_lp = await post(client, {"image": page_b64, "task": "spotting"})
    assert engine.requests[-1].logprobs is True and with_lp["confidence"] is not None
    resp, body = await post(client, {"image": page_b64, "task": "spotting", "confidence": False, "include_raw": True})
    assert resp.status_code == 200
    validate(body)
    assert engine.requests[-1].logprobs is False
    assert body["confidence"] is None and body["raw"]["tokens"] is None
    assert [ln["text"] for ln in body["lines"]] == [ln["text"] for ln in with_lp["lines"]]
    assert body["lines"] and all(ln["confidence"] is None for ln in body["lines"])
    import base64

    resp = await client.post("/v1/ocr", files={"file": ("page.png", base64.b64decode(page_b64), "image/png")},
                             data={"task": "spotting", "confidence": "false"})
    assert resp.status_code == 200 and resp.json()["confidence"] is None
    assert engine.requests[-1].logprobs is False
    resp = await client.post("/v1/ocr", json={"image": page_b64, "task": "spotting", "stream": True,
                                              "confidence": False})
    events = parse_sse(resp.text)
    assert events[-1][0] == "result" and events[-1][1]["confidence"] is None
    streamed = [d["line"] for e, d in events if e == "line"]
    assert streamed and all(line["confidence"] is None for line in streamed)
    resp, body = await post(client, {"image": page_b64, "task": "spotting", "confidence": "maybe"})
    assert resp.status_code == 422 and body["error"]["code"] == "validation_error"


async def test_include_raw_can_be_disabled(page_b64):
    async with make_client(MockEngine(responder=responder), include_raw_output=False) as client:
        resp, body = await post(client, {"image": page_b64, "task": "text", "include_raw": True})
    assert resp.status_code == 403 and body["error"]["code"] == "forbidden"


async def test_stream_sends_lines_then_the_result(api, page_b64):
    client, _, validate = api
    resp = await client.post("/v1/ocr", json={"image": page_b64, "task": "spotting", "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(resp.text)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "result" and "error" not in kinds
    assert "".join(d["text"] for e, d in events if e == "delta") == SPOTTING_RAW
    result = events[-1][1]
    validate(result)
    streamed = [d for e, d in events if e == "line"]
    assert [d["index"] for d in streamed] == list(range(len(streamed)))
    assert len(streamed) >= 2  # all but possibly the last arrive before the result
    assert [d["line"] for d in streamed] == result["lines"][:len(streamed)]
    # a line event comes right after the delta that completed it, before later deltas
    first_line = kinds.index("line")
    assert kinds[first_line + 1:].count("delta") > 0


async def test_stream_markdown_and_extraction(api, page_b64):
    client, _, validate = api
    for task, extra in (("document", {}), ("extract", {"fields": ["name", "id_number"]})):
        resp = await client.post("/v1/ocr", json={"image": page_b64, "task": task, "stream": True, **extra})
        events = parse_sse(resp.text)
        assert events[-1][0] == "result" and all(e == "delta" for e, _ in events[:-1])
        validate(events[-1][1])
    assert events[-1][1]["fields"]["name"]["value"] == "ACME"


async def test_guided_retry_fixes_an_invalid_extraction(page_b64):
    engine = MockEngine(responder=responder)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "id_number": {"type": "integer"}},
              "required": ["name", "id_number"]}
    async with make_client(engine, extraction_guided_retry=True) as client:
        resp, body = await post(client, {"image": page_b64, "task": "extract", "schema": schema})
    assert resp.status_code == 200
    assert [r.guided_json for r in engine.requests] == [None, schema]
    assert body["fields"] == {"name": {"value": "ACME", "confidence": body["fields"]["name"]["confidence"],
                                       "valid": True},
                              "id_number": {"value": 42, "confidence": body["fields"]["id_number"]["confidence"],
                                            "valid": True}}
    assert body["errors"] == [] and any("guided JSON" in w for w in body["warnings"])


async def test_spotting_json_mode_with_guided_decoding(page_b64):
    engine = MockEngine(responder=lambda r: json.dumps([{"box": [81, 68, 400, 91], "text": "Invoice (AP)"}]))
    async with make_client(engine, spotting_format="json", spotting_guided_json=True) as client:
        resp, body = await post(client, {"image": page_b64, "task": "spotting"})
    assert resp.status_code == 200
    request = engine.requests[-1]
    assert request.prompt.startswith("检测并识别图中所有的文字行") and request.guided_json["type"] == "array"
    assert [ln["text"] for ln in body["lines"]] == ["Invoice (AP)"]


def looping_responder(request: EngineRequest) -> str:
    return "Intro line without loops. " * 4 + "LOOP unit 7 " * 400


@pytest.mark.parametrize("stream", [False, True])
async def test_repetition_is_cut_and_flagged(page_b64, stream):
    engine = MockEngine(responder=looping_responder)
    async with make_client(engine, repetition_min_chars=200, max_output_tokens=4096) as client:
        resp = await client.post("/v1/ocr", json={"image": page_b64, "task": "text", "stream": stream,
                                                  "max_tokens": 4096})
        body = parse_sse(resp.text)[-1][1] if stream else resp.json()
    assert body["finish_reason"] == "repetition"
    assert body["text"] == "Intro line without loops. " * 4 + "LOOP unit 7"  # one copy of the unit kept
    assert any("repeating" in w for w in body["warnings"])
    if stream:  # the ingress stopped reading long before the engine's 4900 characters
        delta_chars = sum(len(d["text"]) for e, d in parse_sse(resp.text) if e == "delta")
        assert delta_chars < 1000
    assert body["usage"]["output_tokens"] > 0


async def test_a_stream_cut_without_confidences_still_counts_its_tokens(page_b64):
    """`confidence: false` sends no logprobs with the deltas: the cut result counts the tokens the engine
    reported generating (the mock: one per 4-character delta), up to where the ingress stopped reading."""
    engine = MockEngine(responder=looping_responder)
    async with make_client(engine, repetition_min_chars=200, max_output_tokens=4096) as client:
        resp = await client.post("/v1/ocr", json={"image": page_b64, "task": "text", "stream": True,
                                                  "max_tokens": 4096, "confidence": False})
    events = parse_sse(resp.text)
    result = events[-1][1]
    assert result["finish_reason"] == "repetition" and result["confidence"] is None
    sent = sum(1 for e, _ in events if e == "delta")
    assert sent <= result["usage"]["output_tokens"] < 250  # the looping deltas read in grace count, the rest not


async def test_normal_long_output_is_untouched(page_b64):
    text = "\n".join(f"Line {i}: value {i * 7919 % 1000}" for i in range(400))
    engine = MockEngine(responder=lambda r: text)
    async with make_client(engine, repetition_min_chars=200, max_output_tokens=4096) as client:
        for stream in (False, True):
            resp = await client.post("/v1/ocr", json={"image": page_b64, "task": "text", "stream": stream,
                                                      "max_tokens": 4096})
            body = parse_sse(resp.text)[-1][1] if stream else resp.json()
            assert body["finish_reason"] == "stop" and body["text"] == text


class SelfGuardingEngine(MockEngine):
    """Like the vLLM engine: runs the repetition guard in its own loop and ends the stream with its cut result."""

    def __init__(self, settings, **kwargs):
        super().__init__(**kwargs)
        self.settings = settings

    async def stream(self, request):
        from service.engine.protocol import EngineDelta, EngineResult
        from service.engine.repetition import RepetitionGuard

        guard = RepetitionGuard.from_settings(self.settings)
        async for delta in super().stream(request):
            if delta.final is not None:
                yield delta
                return
            yield delta
            if guard.feed(delta.text):
                yield EngineDelta(final=EngineResult(text=guard.kept_text, finish_reason="repetition",
                                                     prompt_tokens=99, rendered_prompt="engine-rendered"))
                return


async def test_stream_prefers_the_engines_own_repetition_cut(page_b64):
    from service.config import Settings

    settings = Settings(repetition_min_chars=200, max_output_tokens=4096)
    engine = SelfGuardingEngine(settings, responder=looping_responder)
    async with make_client(engine, repetition_min_chars=200, max_output_tokens=4096) as client:
        resp = await client.post("/v1/ocr", json={"image": page_b64, "task": "text", "stream": True,
                                                  "max_tokens": 4096, "include_raw": True})
    result = parse_sse(resp.text)[-1][1]
    assert result["finish_reason"] == "repetition" and result["usage"]["prompt_tokens"] == 99
    assert result["raw"]["rendered_prompt"] == "engine-rendered"
    assert result["text"] == "Intro line without loops. " * 4 + "LOOP unit 7"
