"""`ocr-serve model-kit`: the HunyuanOCR-1.5-shaped model directory every test and benchmark runs on."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from service.cli import modelkit


@pytest.fixture(scope="module")
def full_kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("full-kit")
    proc = subprocess.run([sys.executable, "-m", "service.cli", "model-kit", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["weights"] is False
    return out


def test_full_size_config_is_hunyuan_ocr_1_5(full_kit):
    config = json.loads((full_kit / "config.json").read_text())
    assert config["architectures"] == ["HunYuanVLForConditionalGeneration"]
    text, vision = config["text_config"], config["vision_config"]
    # vLLM's HunYuanVLConfig forwards attribute reads to text_config: it must name the architecture too
    assert text["architectures"] == ["HunYuanVLForConditionalGeneration"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"], text["num_key_value_heads"],
            text["head_dim"], text["intermediate_size"], text["vocab_size"]) == (1024, 24, 16, 8, 128, 3584, 120818)
    assert text["rope_parameters"]["xdrope_section"] == [16, 16, 16, 16]
    assert (vision["hidden_size"], vision["num_hidden_layers"], vision["patch_size"], vision["spatial_merge_size"],
            vision["out_hidden_size"]) == (1152, 27, 16, 2, 1024)
    assert (config["image_start_token_id"], config["image_end_token_id"], config["image_token_id"],
            config["image_newline_token_id"]) == (120118, 120119, 120120, 120121)
    assert not list(full_kit.glob("*.safetensors"))

    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(full_kit)
    assert loaded.model_type == "hunyuan_vl" and loaded.text_config.hidden_size == 1024


def test_tokenizer_has_real_special_ids_and_bare_image_template(full_kit):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(full_kit)
    assert len(tok) == 120818
    ids = {t: tok.convert_tokens_to_ids(t) for t in (modelkit.IMAGE_START, modelkit.IMAGE_END, modelkit.IMAGE_TOKEN,
                                                      modelkit.IMAGE_NEWLINE)}
    assert list(ids.values()) == [120118, 120119, 120120, 120121]
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id) == (120000, 120002, 120020)
    assert tok.image_token_id == 120120 and tok.image_start_token_id == 120118

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Read it."}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the bare image token: vLLM's native model adds start/end itself (two start tokens kill the engine)
    assert prompt.count(modelkit.IMAGE_TOKEN) == 1 and modelkit.IMAGE_START not in prompt
    assert prompt.startswith("<｜hy_begin▁of▁sentence｜>") and prompt.endswith("Read it.<｜hy_User｜>")
    encoded = tok.encode(prompt, add_special_tokens=False)
    assert encoded.count(120120) == 1 and encoded[0] == 120000
    # plain text round-trips (byte-level BPE), CJK included
    sample = "Total 1,234.56 EUR 发票号码"
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample
    # every id decodes (random weights emit any id)
    assert all(tok.decode([i]) is not None for i in (0, 255, 5000, 119999))


def test_processor_config(full_kit):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(full_kit)
    image_processor = processor.image_processor
    assert type(image_processor).__name__ == "HunYuanVLImageProcessor"
    assert (image_processor.patch_size, image_processor.merge_size) == (16, 2)
    assert image_processor.size["shortest_edge"] == 512 * 512
    assert image_processor.size["longest_edge"] == 2048 * 2048


def test_tiny_weights_are_seeded(tmp_path):
    first = modelkit.write_kit(tmp_path / "a", tiny=True, weights=True, seed=3)
    modelkit.write_kit(tmp_path / "b", tiny=True, weights=True, seed=3)
    modelkit.write_kit(tmp_path / "c", tiny=True, weights=True, seed=4)

    def digest(name):
        return hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest()

    assert digest("a") == digest("b") != digest("c")
    assert first["parameters"] > 1_000_000
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "a" / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert 0.08 < float(q.std()) < 0.12  # std 0.1: logprobs and LoRA effects are visible (dummy weights: ±1e-3)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["text_config"]["head_dim"] >= 32  # vLLM's CPU attention needs head_dim ≥ 32
    assert config["text_config"]["architectures"] == ["HunYuanVLForConditionalGeneration"]


def test_adapter_for_the_full_size_kit_matches_its_projections(tmp_path):
    """o_proj's input is heads × head_dim (2,048), not the hidden size (1,024): equal in the tiny kit, so only the
    full-size kit tells them apart."""
    import torch
    from safetensors.torch import load_file

    from service.cli.modelkit import write_kit
    from service.engine.vllm.lora import write_lora_adapter

    kit = tmp_path / "kit"
    write_kit(kit, tiny=False, weights=False)
    adapter = write_lora_adapter(tmp_path / "probe", kit, seed=1)
    text = json.loads((kit / "config.json").read_text())["text_config"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.{}."
    assert len(tensors) == text["num_hidden_layers"] * 4
    last = text["num_hidden_layers"] - 1
    assert tensors[prefix.format(last) + "self_attn.o_proj.lora_A.weight"].shape == (8, 16 * 128)
    assert tensors[prefix.format(last) + "self_attn.o_proj.lora_B.weight"].shape == (1024, 8)
    assert tensors[prefix.format(0) + "mlp.down_proj.lora_A.weight"].shape == (8, 3584)
    assert tensors[prefix.format(0) + "mlp.down_proj.lora_B.weight"].shape == (1024, 8)
    again = load_file(str(write_lora_adapter(tmp_path / "again", kit, seed=1) / "adapter_model.safetensors"))
    assert all(torch.equal(tensors[name], again[name]) for name in tensors), "seeded: the same adapter twice"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) == {"o_proj", "down_proj"}
    # the engine's LoRA warm-up adapter: every linear module of the text model, all zeros
    from service.engine.vllm.lora import LORA_MODULES

    wide = load_file(str(write_lora_adapter(tmp_path / "wide", kit, seed=0, rank=16, std=0.0, modules=LORA_MODULES)
                         / "adapter_model.safetensors"))
    assert len(wide) == text["num_hidden_layers"] * 7 * 2 and all(not t.any() for t in wide.values())
    expected = {"self_attn.q_proj": (1024, 2048), "self_attn.k_proj": (1024, 1024), "self_attn.v_proj": (1024, 1024),
                "self_attn.o_proj": (2048, 1024), "mlp.gate_proj": (1024, 3584), "mlp.up_proj": (1024, 3584),
                "mlp.down_proj": (3584, 1024)}
    for module, (d_in, d_out) in expected.items():
        assert wide[prefix.format(0) + module + ".lora_A.weight"].shape == (16, d_in), module
        assert wide[prefix.format(0) + module + ".lora_B.weight"].shape == (d_out, 16), module
    with pytest.raises(ValueError):
        write_lora_adapter(tmp_path / "bad", kit, seed=0, modules=("qkv_proj",))
