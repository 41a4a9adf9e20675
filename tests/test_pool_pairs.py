"""`python -m loadtest bench pool`: rounds of several pair runs pooled into one paired summary."""

from __future__ import annotations

import json

import pytest

from loadtest.__main__ import main as loadtest_main
from loadtest.pool_pairs import pool


def pair_results(path, servers, rounds_ms, workload="id_card"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"parts": {"pair": {"servers": servers, "workload": workload, "rounds_ms": rounds_ms}}}))
    return path


def test_pooled_rounds_narrow_the_interval_and_keep_each_runs_median(tmp_path, capsys):
    """Two runs whose own intervals are wide pool into one with every round: the median difference is the servers'
    (6 ms, under drift of ±40 ms between rounds and a different level per machine), its interval narrower than
    either run's; each run's own median stays in the table; servers not in every run are left out."""
    import math

    def rounds(n, base):
        raw = [base + 40 * math.sin(i / 3) for i in range(n)]
        return {"raw": raw, "service": [r + 6 + ((i * 7) % 9 - 4) * 2.5 for i, r in enumerate(raw)]}

    a = pair_results(tmp_path / "a" / "results.json", ["raw", "service"], rounds(60, 250))
    second = rounds(90, 300)
    second["direct"] = [r - 10 for r in second["raw"]]  # only the second run had direct
    b = pair_results(tmp_path / "b" / "results.json", ["raw", "service", "direct"], second)
    out = tmp_path / "pooled.json"
    assert loadtest_main(["bench", "pool", str(a), str(b), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert pooled["complete_rounds"] == 150 and pooled["reference"] == "raw" and set(pooled["differences"]) == {
        "service"}
    d = pooled["differences"]["service"]
    assert abs(d["median_ms"] - 6) <= 1.5 and d["ci95_ms"][0] <= d["median_ms"] <= d["ci95_ms"][1]
    only_a = pool([json.loads(a.read_text())["parts"]["pair"]])["differences"]["service"]
    assert d["ci95_ms"][1] - d["ci95_ms"][0] <= only_a["ci95_ms"][1] - only_a["ci95_ms"][0]
    assert [r["rounds"] for r in pooled["runs"]] == [60, 90] and pooled["sources"] == [str(a), str(b)]
    table = capsys.readouterr().out
    assert "150 rounds from 2 runs" in table and "| service | +" in table and "direct" not in table
    assert not pooled["across_runs"]["service"]["runs_disagree"] and "disagree" not in table


def test_runs_that_disagree_are_named_and_their_spread_counted(tmp_path, capsys):
    """Three runs whose differences sit 15 ms apart, each pinned to ±2 ms by its own rounds: the pooled rounds give a
    narrow interval around the middle one, the runs resampled too give one that spans the runs, and the report says
    the runs disagree. The per-difference labels cover the pairs between non-reference servers as well."""
    paths = []
    for k, offset in enumerate((3.0, 18.0, 33.0)):
        raw = [250 + 30 * ((i * 37) % 11 - 5) / 5 for i in range(80)]
        paths.append(pair_results(tmp_path / f"r{k}.json", ["raw", "service", "direct"], {
            "raw": raw, "service": [r + offset + ((i * 7) % 5 - 2) for i, r in enumerate(raw)],
            "direct": [r + 1 + ((i * 3) % 5 - 2) for i, r in enumerate(raw)]}))
    out = tmp_path / "pooled.json"
    assert loadtest_main(["bench", "pool", *map(str, paths), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    rounds_only, across = pooled["differences"]["service"]["ci95_ms"], pooled["across_runs"]["service"]["ci95_ms"]
    assert rounds_only[1] - rounds_only[0] < 5 and across[0] <= 5 and across[1] >= 31
    assert pooled["across_runs"]["service"]["runs_disagree"] and not pooled["across_runs"]["direct"]["runs_disagree"]
    assert set(pooled["across_runs"]) == {"service", "direct", "direct − service"}
    assert [round(r["differences"]["service"]["median_ms"]) for r in pooled["runs"]] == [3, 18, 33]
    table = capsys.readouterr().out
    assert "The runs disagree on service, direct − service:" in table
    assert "+3.0 (+" in table and "+33.0 (+" in table  # each run's median with its own interval


def test_pool_refuses_what_it_cannot_pool(tmp_path):
    """Different workloads, a run without per-round latencies, fewer than two shared servers, one run twice."""
    a = pair_results(tmp_path / "a.json", ["raw", "service"], {"raw": [250.0], "service": [255.0]})
    a4 = pair_results(tmp_path / "a4.json", ["raw", "service"], {"raw": [1600.0], "service": [1610.0]}, "a4")
    other = pair_results(tmp_path / "o.json", ["raw", "direct"], {"raw": [250.0], "direct": [245.0]})
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"parts": {"pair": {"servers": ["raw", "service"], "workload": "id_card"}}}))
    for paths, words in (([a, a4], "different workloads"), ([a, old], "rounds_ms"), ([a, other], "two servers")):
        with pytest.raises(SystemExit, match=words):
            loadtest_main(["bench", "pool", *map(str, paths)])
    with pytest.raises(SystemExit):  # argparse's error: exit status 2
        loadtest_main(["bench", "pool", str(a), str(a)])


def test_pool_compares_the_time_outside_the_engines_when_runs_kept_it(tmp_path, capsys):
    """Runs that kept each round's engine time pool that comparison too: b's layers in front of its engine cost 2 ms
    more than a's in both runs, whatever their engines took."""
    paths = []
    for k, engine_gap in enumerate((4.0, -3.0)):
        raw = [250 + 30 * ((i * 37) % 11 - 5) / 5 for i in range(40)]
        path = pair_results(tmp_path / f"r{k}.json", ["raw", "a", "b"], {
            "raw": raw, "a": [r + 10 for r in raw], "b": [r + 12 + engine_gap for r in raw]})
        data = json.loads(path.read_text())
        data["parts"]["pair"]["engine_rounds_ms"] = {"a": [r - 5 for r in raw], "b": [r - 5 + engine_gap for r in raw]}
        path.write_text(json.dumps(data))
        paths.append(path)
    out = tmp_path / "pooled.json"
    assert loadtest_main(["bench", "pool", *map(str, paths), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert pooled["outside_engine"]["b − a"]["median_ms"] == 2.0 and "engine_rounds_ms" not in pooled
    assert "outside each server's own engine: b − a median +2.0" in capsys.readouterr().out
