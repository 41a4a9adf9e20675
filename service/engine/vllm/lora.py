"""The Triton LoRA kernels vLLM launches for this model, and which prompt lengths compile all of their variants.

vLLM runs each LoRA layer as two Triton kernels, shrink (x·A) and expand (·B), and picks each kernel's block config
by the step's token count: from its built-in default (two configs for shrink, split at 128 tokens) or from tuned
files (`VLLM_TUNED_CONFIG_FOLDER`, the nearest tuned token count). Triton compiles one variant per config and per
class of the integer arguments (the token count's divisibility), on first use. Steps up to the largest CUDA-graph
size run in graphs captured at start-up; longer ones run eagerly, so a config first picked there compiles while
users wait (docs/design/lora.md). The engine's warm-up therefore runs one prompt length per token count residue in
every range of token counts over which vLLM's choice stays the same (`warmup_prompt_lengths`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# vLLM's MergedQKV and MergedColumn LoRA layers (its HunYuan model's packed_modules_mapping), then o and down
PACKED_LAYERS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)),
                 ("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
# Triton specialises integer arguments on divisibility by 16, and the kernels' addresses on alignment: every token
# count mod 16 covers the classes (one length compiled kernels that a length of another residue had not)
TOKEN_RESIDUES = 16


@dataclass(frozen=True)
class KernelShape:
    """One LoRA kernel as vLLM launches it: `k` and `n` are the config keys (shrink: input size and rank; expand:
    rank and the widest output slice); `calls_per_step` counts its launches in one engine step."""

    op: str
    num_slices: int
    k: int
    n: int
    output_slices: tuple[int, ...]
    layers: tuple[str, ...]
    calls_per_step: int

    @property
    def label(self) -> str:
        return f"{self.op} {'+'.join(self.layers)} ({self.num_slices} slice{'s' * (self.num_slices > 1)}, " \
               f"K {self.k}, N {self.n})"


def kernel_shapes(model_dir: Path, rank: int) -> list[KernelShape]:
    """The distinct shrink and expand kernels of the model's LoRA layers, with how often each runs per step."""
    linear, num_layers = text_linear_shapes(model_dir)
    by_name = {name.split(".")[1]: shape for name, shape in linear.items()}
    shapes: dict[tuple, KernelShape] = {}
    for packed, parts in PACKED_LAYERS:
        input_size = by_name[parts[0]][0]
        outputs = tuple(by_name[part][1] for part in parts)
        for op, k, n in (("shrink", input_size, rank), ("expand", rank, max(outputs))):
            key = (op, len(parts), k, n)
            known = shapes.get(key)
            shapes[key] = KernelShape(op=op, num_slices=len(parts), k=k, n=n, output_slices=outputs,
                                      layers=(known.layers if known else ()) + (packed,),
                                      calls_per_step=(known.calls_per_step if known else 0) + num_layers)
    return list(shapes.values())


def packed_layer_differences(engine_slices: dict[str, list[int]]) -> list[str]:
    """Where the linear LoRA layers the engine built (`OCRWorkerExtension.ocr_lora_layers`) differ from
    PACKED_LAYERS, which `kernel_shapes` assumes: one line per layer kind, none when they agree. A kernel's config
    depends on its number of slices and its sizes, so with a difference the warm-up's prompt lengths were chosen
    for other kernels than the ones adapter requests launch."""
    expected = {packed: [len(parts)] for packed, parts in PACKED_LAYERS}
    differences = []
    for kind in sorted(set(expected) | set(engine_slices)):
        if kind not in engine_slices:
            differences.append(f"{kind}: no such LoRA layer in the engine (expected {expected[kind]} slices)")
        elif kind not in expected:
            differences.append(f"{kind}: a LoRA layer the warm-up's lengths were not chosen for "
                               f"({engine_slices[kind]} slices)")
        elif engine_slices[kind] != expected[kind]:
            differences.append(f"{kind}: {engine_slices[kind]} slices in the engine, {expected[kind]} expected")
    return differences


def config_key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


def vllm_config(shape: KernelShape, max_loras: int, tokens: int, *, tuned: bool = True) -> dict:
    """The config vLLM's kernel launch picks for `tokens` tokens (its own lookup, with the arguments its launchers
    pass: slots + 1 for the no-adapter row). `tuned=False`: its default, as if no tuned folder were set."""
    from vllm.lora.ops.triton_ops import utils

    saved = None if tuned else os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    try:
        lookup = utils.get_lora_op_configs if tuned else utils.get_lora_op_configs.__wrapped__
        return dict(lookup(shape.op, max_loras=max_loras + 1, batch=tokens,
                           hidden_size=shape.k if shape.op == "shrink" else shape.n,
                           rank=shape.n if shape.op == "shrink" else shape.k, num_slices=shape.num_slices,
                           add_inputs=True if shape.op == "expand" else None))
    finally:
        if saved is not None:
            os.environ["VLLM_TUNED_CONFIG_FOLDER"] = saved


def config_ranges(shapes: list[KernelShape], max_loras: int, longest: int,
                  largest_graph: int | None = None) -> list[tuple[int, int]]:
    """Token counts 1..longest split into the ranges over which vLLM picks the same config for every kernel, and
    also after `largest_graph` (the largest CUDA-graph size): a step up to it is padded to a captured size, which
    start-up compiled, so a warm-up prompt below it covers no residue of the eager steps above it."""
    ranges: list[tuple[int, int]] = []
    previous = None
    for tokens in range(1, longest + 1):
        choice = tuple(config_key(vllm_config(shape, max_loras, tokens)) for shape in shapes)
        if choice != previous or tokens - 1 == largest_graph:
            ranges.append((tokens, tokens))
            previous = choice
        else:
            ranges[-1] = (ranges[-1][0], tokens)
    return ranges


def warmup_prompt_lengths(ranges: list[tuple[int, int]], residues: int = TOKEN_RESIDUES) -> list[int]:
    """Per range, its first `residues` token counts (all of a shorter range): every residue mod 16 of every config.
    A prompt of n tokens alone makes a prefill step of n tokens."""
    return [n for first, last in ranges for n in range(first, min(last, first + residues - 1) + 1)]


# the text model's linear modules a PEFT adapter may target (vLLM packs q/k/v and gate/up into one layer each)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def text_linear_shapes(model_dir: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """The text model's linear modules a LoRA adapter may target, as {"self_attn.q_proj": (in, out), ...} in
    LORA_MODULES order, and the number of layers that each have them."""
    text = json.loads((Path(model_dir) / "config.json").read_text())["text_config"]
    hidden, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    head_dim = text.get("head_dim", hidden // text["num_attention_heads"])
    attention = text["num_attention_heads"] * head_dim
    kv = text.get("num_key_value_heads", text["num_attention_heads"]) * head_dim
    return {"self_attn.q_proj": (hidden, attention), "self_attn.k_proj": (hidden, kv),
            "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (attention, hidden),
            "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}, layers


def write_lora_adapter(directory: Path, model_dir: Path, *, seed: int, rank: int = 8, std: float = 0.5,
                       modules: tuple[str, ...] = ("o_proj", "down_proj")) -> Path:
    """A PEFT-format LoRA adapter for a kit's text model: `modules` of every layer (default o_proj and down_proj; any
    of LORA_MODULES), seeded random A and B
    (PEFT zeroes B at init; here both are random, so the adapter changes the outputs). For tests on the tiny kit and
    the GPU check of LoRA slots (tests/gpu/) on the full-size one. With std 0 it is a zero
    adapter, which changes nothing (the engine's LoRA warm-up)."""
    import torch
    from safetensors.torch import save_file

    all_shapes, layers = text_linear_shapes(model_dir)
    shapes = {name: shape for name, shape in all_shapes.items() if name.split(".")[1] in modules}
    if len(shapes) != len(modules):
        raise ValueError(f"LoRA modules must be among {LORA_MODULES}, got {modules}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, (d_in, d_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator) * std
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank * 2, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(modules), "base_model_name_or_path": "hunyuan-ocr",
        "modules_to_save": None, "fan_in_fan_out": False, "inference_mode": True,
    }))
    return directory
