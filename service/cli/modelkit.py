"""`ocr-serve model-kit OUT [--tiny] [--weights]`: write a HunyuanOCR-1.5-shaped model directory.

Real weights cannot be downloaded here, so every test and benchmark gets its model from this kit:
- config.json: the HunyuanOCR-1.5 architecture (full size) or a tiny one for CI (CPU attention needs head_dim ≥ 32).
  `text_config` carries `architectures` too: vLLM's HunYuanVLConfig forwards attribute reads to `text_config`, and
  without it the model resolves to the wrong class.
- tokenizer (tokenizer.json + tokenizer_config.json): a byte-level BPE whose special tokens sit at HunyuanOCR's real
  ids (bos 120000, pad 120002, eos 120020, image start/end/token/newline 120118-120121) and a chat template that puts
  the BARE image token `<｜hy_place▁holder▁no▁102｜>` in the prompt (vLLM's prompt update adds start/end itself).
- preprocessor_config.json: HunYuanVLImageProcessor (patch 16, merge 2, min 512², max 2048² pixels).
- optionally model.safetensors: seeded random weights, std 0.1 (vLLM's `--load-format dummy` weights are ≈±1e-3,
  which makes every logprob −ln(vocab) and LoRA effects vanish).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 120818
BOS, PAD, EOS = 120000, 120002, 120020
IMAGE_START_ID, IMAGE_END_ID, IMAGE_TOKEN_ID, IMAGE_NEWLINE_ID = 120118, 120119, 120120, 120121
# HunyuanOCR's place-holder tokens: `<｜hy_place▁holder▁no▁N｜>` has id PLACEHOLDER_BASE + N (no▁100 = 120118).
PLACEHOLDER_BASE = 120018
NAMED_SPECIALS = {
    120000: "<｜hy_begin▁of▁sentence｜>",
    120001: "<｜hy_end▁of▁sentence｜>",
    120002: "<｜hy_▁pad▁｜>",
    120006: "<｜hy_User｜>",
    120007: "<｜hy_Assistant｜>",
}
FIRST_SPECIAL = 120000


def placeholder(n: int) -> str:
    return f"<｜hy_place▁holder▁no▁{n}｜>"


IMAGE_START, IMAGE_END, IMAGE_TOKEN, IMAGE_NEWLINE = placeholder(100), placeholder(101), placeholder(102), placeholder(103)
SYSTEM_END = placeholder(3)
USER_END = NAMED_SPECIALS[120006]

# HunyuanOCR's prompt layout: bos, optional system text + no▁3, the user turn (image then text) closed by hy_User;
# the model answers and ends with eos (no▁2). Images are the bare image token: vLLM wraps it in start/end itself.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '" + SYSTEM_END + "' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{%- if loop.first -%}{{- '" + SYSTEM_END + "' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part or 'image_url' in part -%}"
    "{{- '" + IMAGE_TOKEN + "' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '" + USER_END + "' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def _rope(section: list[int]) -> dict[str, Any]:
    return {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "rope_theta": 10000.0, "rope_type": "xdrope", "type": "xdrope", "xdrope_section": section}


def model_config(tiny: bool) -> dict[str, Any]:
    """config.json: HunyuanOCR-1.5 (≈1B: text 1024×24, vision 1152×27) or a tiny model with the same structure."""
    if tiny:
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=32, rope_parameters=_rope([4, 4, 4, 4]))
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, out_hidden_size=64, text_hidden_size=64)
    else:
        text = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, rope_parameters=_rope([16, 16, 16, 16]))
        vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                      num_key_value_heads=16, out_hidden_size=1024, text_hidden_size=1024)
    architectures = ["HunYuanVLForConditionalGeneration"]
    text_config = {
        "architectures": architectures, "model_type": "hunyuan_vl_text", "attention_bias": False,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "vocab_size": VOCAB_SIZE, "bos_token_id": BOS, "eos_token_id": EOS, "eod_token_id": EOS,
        "pad_token_id": PAD, "sep_token_id": None, **text,
    }
    vision_config = {
        "model_type": "hunyuan_vl_vision", "hidden_act": "gelu", "interpolate_mode": "bilinear",
        "max_image_size": 2048, "min_image_size": 512, "img_max_token_num": 16384, "max_vit_seq_len": 65536,
        "temporal_patch_size": 1, "num_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
        "rms_norm_eps": 1e-5, **vision,
    }
    return {
        "architectures": architectures, "model_type": "hunyuan_vl", "tie_word_embeddings": True,
        "image_token_id": IMAGE_TOKEN_ID, "im_start_id": IMAGE_START_ID, "im_end_id": IMAGE_END_ID,
        "im_newline_id": IMAGE_NEWLINE_ID, "image_start_token_id": IMAGE_START_ID,
        "image_end_token_id": IMAGE_END_ID, "image_newline_token_id": IMAGE_NEWLINE_ID,
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
        "text_config": text_config, "vision_config": vision_config,
        "torch_dtype": "bfloat16",
    }


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte→unicode map: the 256 single-byte tokens of a byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = [], 0
    mapping = {}
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    chars = [mapping[b] for b in range(256)]
    return chars


def special_tokens() -> dict[int, str]:
    """Every id from 120000 up: named specials and `<｜hy_place▁holder▁no▁N｜>` at PLACEHOLDER_BASE + N."""
    out = {}
    for token_id in range(FIRST_SPECIAL, VOCAB_SIZE):
        out[token_id] = NAMED_SPECIALS.get(token_id) or (
            placeholder(token_id - PLACEHOLDER_BASE) if token_id >= PLACEHOLDER_BASE
            else f"<｜hy_reserved▁{token_id - FIRST_SPECIAL}｜>")
    return out


def tokenizer_json() -> dict[str, Any]:
    """A byte-level BPE: 256 bytes, merges for common ASCII pairs, filler tokens up to 120000, then specials.

    Random weights emit any id, so every id below 120000 decodes to some text (pairs and triples of letters)."""
    alphabet = _byte_level_alphabet()
    vocab: dict[str, int] = {}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    common = [alphabet[b] for b in b"etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ0123456789 .,:-"]
    merges = []
    for a in common:
        for b in common:
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append([a, b])
    letters = [alphabet[b] for b in b"abcdefghijklmnopqrstuvwxyz"]
    filler = (a + b + c for a in letters for b in letters for c in letters)
    filler2 = (a + b + c + d for a in letters for b in letters for c in letters for d in letters)
    for token in list(filler) + list(filler2):
        if len(vocab) >= FIRST_SPECIAL:
            break
        vocab.setdefault(token, len(vocab))
    assert len(vocab) == FIRST_SPECIAL, len(vocab)
    specials = special_tokens()
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in specials.items()]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def tokenizer_config() -> dict[str, Any]:
    specials = special_tokens()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": specials[BOS],
        "eos_token": specials[EOS],
        "pad_token": specials[PAD],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": {
            "image_token": IMAGE_TOKEN,
            "image_start_token": IMAGE_START,
            "image_end_token": IMAGE_END,
            "image_newline_token": IMAGE_NEWLINE,
        },
        "chat_template": CHAT_TEMPLATE,
    }


def preprocessor_config() -> dict[str, Any]:
    return {
        "image_processor_type": "HunYuanVLImageProcessor",
        "processor_class": "HunYuanVLProcessor",
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 1,
        "min_pixels": 512 * 512,
        "max_pixels": 2048 * 2048,
        "size": {"shortest_edge": 512 * 512, "longest_edge": 2048 * 2048},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }


def write_weights(out: Path, seed: int = 0, std: float = 0.1) -> int:
    """Seeded random weights (normal, std `std`; norms at 1) in HF's layout; returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("_rms.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json: put ours back (text_config.architectures, ids)
    return sum(p.numel() for p in model.parameters())


def write_kit(out: Path, *, tiny: bool, weights: bool, seed: int = 0) -> dict[str, Any]:
    """Write the whole directory; returns a summary."""
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(tiny)
    if tiny:
        config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), ensure_ascii=False, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: tokenizer_config()[k] for k in ("bos_token", "eos_token", "pad_token")}, ensure_ascii=False, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "do_sample": False}, indent=2))
    summary: dict[str, Any] = {"dir": str(out), "tiny": tiny, "weights": weights}
    if weights:
        summary["parameters"] = write_weights(out, seed=seed)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return summary


def cmd_model_kit(args: argparse.Namespace) -> int:
    summary = write_kit(Path(args.out), tiny=args.tiny, weights=args.weights, seed=args.seed)
    print(json.dumps(summary))
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("model-kit", help="write a HunyuanOCR-1.5-shaped model directory (config, tokenizer, "
                              "processor; optionally seeded random weights)")
    p.add_argument("out", help="output directory")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (CI on CPU)")
    p.add_argument("--weights", action="store_true",
                   help="write seeded random weights (std 0.1); without it, serve with load_format=dummy")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    p.set_defaults(func=cmd_model_kit)
