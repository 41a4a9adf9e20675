"""`ocr-serve parse`: raw model text on stdin → the API result JSON, through the service's own code path."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


def run_parse(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "parse", *args], input=stdin, text=True,
                          capture_output=True, timeout=120)


def test_spotting_replay_maps_boxes_to_the_uploaded_image():
    raw = "<ref>Hello (AP)</ref><quad>(100,200),(500,260)</quad><ref>世界</ref><quad>(100,300),(400,36"
    proc = run_parse(["--task", "spotting", "--width", "1000", "--height", "2000", "--scale", "0.5"], raw)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [(ln["text"], ln["box"]) for ln in out["lines"]] == [("Hello (AP)", [100, 400, 500, 520])]
    assert out["image"] == {"width": 1000, "height": 2000, "engine_width": 500, "engine_height": 1000, "scale": 0.5}
    assert any("incomplete" in w for w in out["warnings"])


def test_extract_replay_with_schema_file(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"total": {"type": "number"}},
                                  "required": ["total"]}))
    proc = run_parse(["--task", "extract", "--width", "10", "--height", "10", "--schema", str(schema)],
                     '```json\n{"total": "12.50"}\n```')
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fields"] == {"total": {"value": 12.5, "confidence": None, "valid": True}} and out["errors"] == []


def test_raw_json_replay_recomputes_confidence_and_the_same_result():
    tokens = [{"token": "<ref>", "logprob": -0.1}, {"token": "abc", "logprob": -0.7},
              {"token": "</ref><quad>(1,2),(500,600)</quad>", "logprob": -0.2}]
    raw = {"text": "".join(t["token"] for t in tokens), "tokens": tokens, "rendered_prompt": "p"}
    proc = run_parse(["--task", "spotting", "--width", "100", "--height", "100", "--raw-json", "--include-raw"],
                     json.dumps({"id": "x", "raw": raw}))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["lines"][0]["confidence"] == pytest.approx(math.exp(-(0.1 + 0.7 + 0.2) / 3), rel=1e-5)
    assert out["raw"] == raw


@pytest.mark.parametrize("args, stdin", [
    (["--task", "nope", "--width", "1", "--height", "1"], ""),
    (["--task", "extract", "--width", "1", "--height", "1"], "{}"),
    (["--task", "text", "--width", "0", "--height", "1"], ""),
    (["--task", "text", "--width", "1", "--height", "1", "--raw-json"], "not json"),
])
def test_bad_arguments_exit_2(args, stdin):
    proc = run_parse(args, stdin)
    assert proc.returncode == 2 and "invalid_request" in proc.stderr
