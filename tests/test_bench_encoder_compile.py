"""`python -m loadtest bench encoder --compile`: the vision tower with each block's dense part under torch.compile.

vLLM 0.26 cannot compile HunyuanOCR's tower (`compile_mm_encoder` covers only towers marked for it), so the bench
compiles the parts between the GEMMs itself. On the GPU it uses inductor; here the same code runs through dynamo
with the `aot_eager` backend (the graphs dynamo captures, run without code generation, which needs no C compiler)
on the stand-in tower of vLLM 0.26's layout: the compiled forward must give the batched forward's answer for every
page size and image count, reuse one graph for all layers and sizes, refuse a tower it was not written for, and a
mode that fails must be recorded rather than end the run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from loadtest import profile_encoder  # noqa: E402
from service.engine import vllm_plugin  # noqa: E402
from tests.fixtures.hunyuan_tower import MLP, Tower  # noqa: E402

GRIDS = {"id_card": (1, 4, 6), "a4": (1, 6, 4)}
CASES = (("id_card", 1), ("id_card", 3), ("a4", 1))


@pytest.fixture()
def tower():
    torch.manual_seed(0)
    return Tower().eval()


@pytest.mark.parametrize("grids", [[[1, 4, 6]], [[1, 4, 6], [1, 2, 8], [1, 6, 4]], [[1, 2, 2]] * 5])
def test_compiled_tower_equals_the_batched_forward(tower, grids):
    torch._dynamo.reset()
    forward = profile_encoder.compiled_tower_forward(tower, backend="aot_eager")
    x = torch.randn(sum(h * w for _, h, w in grids), 12)
    with torch.inference_mode():
        expected = vllm_plugin.batched_vision_forward(tower, x, grids)
        got = forward(x, grids)
    assert len(got) == len(grids)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_one_graph_serves_every_layer_and_page_size(tower):
    """The weights are arguments and the patch count is dynamic: three layers and three page sizes compile each
    function once (a graph per layer or per size would make the GPU's first pages pay compiles)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    forward = profile_encoder.compiled_tower_forward(tower, backend="aot_eager")
    with torch.inference_mode():
        for grids in ([[1, 4, 6]], [[1, 6, 8]], [[1, 4, 6], [1, 2, 8]]):
            forward(torch.randn(sum(h * w for _, h, w in grids), 12), grids)
    assert counters["stats"]["unique_graphs"] == 2


def test_the_weights_are_the_layers_own(tower):
    """Changing one layer's MLP weight changes the compiled output as it changes the eager one."""
    torch._dynamo.reset()
    forward = profile_encoder.compiled_tower_forward(tower, backend="aot_eager")
    grids, x = [[1, 4, 6]], torch.randn(24, 12)
    with torch.inference_mode():
        before = forward(x, grids)[0]
        tower.layers[1].mlp.dense_4h_to_h.weight.add_(0.5)
        after, expected = forward(x, grids)[0], vllm_plugin.batched_vision_forward(tower, x, grids)[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


def test_gelu_approximation_of_the_activations_it_knows():
    assert profile_encoder.gelu_approximation(torch.nn.GELU()) == "none"
    assert profile_encoder.gelu_approximation(torch.nn.GELU(approximate="tanh")) == "tanh"

    class GELU(torch.nn.Module):  # vLLM's CustomOp of this name is exact GELU
        pass

    class GELUTanh(torch.nn.Module):
        pass

    assert profile_encoder.gelu_approximation(GELU()) == "none"
    assert profile_encoder.gelu_approximation(GELUTanh()) == "tanh"
    with pytest.raises(ValueError, match="SiLU is not a GELU"):
        profile_encoder.gelu_approximation(torch.nn.SiLU())


def test_a_tower_it_was_not_written_for_is_refused(tower):
    tower.layers[0].mlp = MLP(act_fn=torch.nn.SiLU())
    with pytest.raises(ValueError, match="not a GELU"):
        profile_encoder.compiled_tower_forward(tower, backend="aot_eager")
    tower.layers[0].mlp = MLP()
    tower.layers[2].post_attention_layernorm.eps = 1e-3
    with pytest.raises(ValueError, match="differ in eps"):
        profile_encoder.compiled_tower_forward(tower, backend="aot_eager")


def test_measure_times_eager_and_each_mode_and_records_failures(tower):
    rows = profile_encoder.measure_tower_compiled(tower, ["default"], repeats=2, backend="aot_eager", grids=GRIDS,
                                                  cases=CASES, patch_dim=12)
    assert [(r["variant"], r["case"], r["images"]) for r in rows] == \
        [("eager", c, n) for c, n in CASES] + [("compile:default", c, n) for c, n in CASES]
    for row in rows:
        assert row["ms"] > 0 and row["ms_per_image"] == pytest.approx(row["ms"] / row["images"], abs=0.01)
    for row in rows[3:]:
        assert row["max_abs_diff"] < 1e-5 and row["vs_eager"] > 0 and row["first_call_s"] >= 0
    report = profile_encoder.compile_report(rows)
    assert "| compile:default |" in report and "id_card ×3" in report

    tower.layers[0].mlp = MLP(act_fn=torch.nn.SiLU())
    rows = profile_encoder.measure_tower_compiled(tower, ["default"], repeats=1, backend="aot_eager", grids=GRIDS,
                                                  cases=CASES[:1], patch_dim=12)
    assert rows[0]["variant"] == "eager" and rows[0]["ms"] > 0
    assert rows[1]["variant"] == "compile:default" and "not a GELU" in rows[1]["error"]
    assert "- compile:default: ValueError" in profile_encoder.compile_report(rows)


def test_a_mode_that_fails_is_recorded_and_eager_still_measured(tower):
    """A backend that does not exist fails the mode at once; one that fails while compiling fails each case."""
    rows = profile_encoder.measure_tower_compiled(tower, ["default"], repeats=1, backend="no-such-backend",
                                                  grids=GRIDS, cases=CASES[:2], patch_dim=12)
    assert [(r["variant"], r.get("case")) for r in rows] == \
        [("eager", "id_card"), ("eager", "id_card"), ("compile:default", None)]
    assert rows[0]["ms"] > 0 and rows[2]["error"].startswith("InvalidBackend")

    def failing_backend(graph, example_inputs):
        raise RuntimeError("no kernel for this machine")

    rows = profile_encoder.measure_tower_compiled(tower, ["default"], repeats=1, backend=failing_backend,
                                                  grids=GRIDS, cases=CASES[:2], patch_dim=12)
    failed = [r for r in rows if r["variant"] == "compile:default"]
    assert [(r["case"], r["images"]) for r in failed] == [("id_card", 1), ("id_card", 3)]
    assert all("no kernel for this machine" in r["error"] and "ms" not in r for r in failed)
    assert "error | error |" in profile_encoder.compile_report(rows)


def test_unknown_compile_modes_are_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_encoder.main(["--out", str(tmp_path), "--compile", "turbo"])
    assert exit_info.value.code == 2
    assert "unknown compile mode 'turbo'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
