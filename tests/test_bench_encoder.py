"""`python -m loadtest bench encoder --attn-backends`: the vision tower's attention timed per backend.

The GPU run switches vLLM's real MMEncoderAttention between backends in place. Here the same code runs on a real
MMEncoderAttention of HunyuanOCR's head layout (16 heads of 72) on CPU, where only PyTorch's SDPA exists: the
switch must reach the attributes vLLM reads, come back afterwards (also after a failure), a backend the machine
cannot run must be recorded rather than end the run, and the outputs compared must be the real attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from loadtest import profile_encoder  # noqa: E402

HEADS, HEAD_SIZE = 16, 72


@pytest.fixture(scope="module")
def attention():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import MMEncoderAttention

    with set_current_vllm_config(VllmConfig()):
        module = MMEncoderAttention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, prefix="visual.layers.0.self_attn.attn")
    return module


def per_image_attention(q, k, v, lengths):
    """Plain softmax attention within each image (float64), the answer every backend must give."""
    outs, start = [], 0
    for n in lengths:
        split = [t[0, start:start + n].double().reshape(n, HEADS, HEAD_SIZE).transpose(0, 1) for t in (q, k, v)]
        weights = torch.softmax(split[0] @ split[1].transpose(1, 2) * HEAD_SIZE ** -0.5, dim=-1)
        outs.append((weights @ split[2]).transpose(0, 1).reshape(n, HEADS * HEAD_SIZE))
        start += n
    return torch.cat(outs)


def test_backend_switch_reaches_the_module_and_is_undone(attention):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    before = (attention.attn_backend, attention.is_flash_attn_backend, attention._fa_version)
    with profile_encoder.attention_backend([attention], "TRITON_ATTN"):
        assert attention.attn_backend == AttentionBackendEnum.TRITON_ATTN
        assert attention.is_flash_attn_backend is False and attention._fa_version is None
    assert (attention.attn_backend, attention.is_flash_attn_backend, attention._fa_version) == before
    with pytest.raises(RuntimeError, match="boom"):
        with profile_encoder.attention_backend([attention], "TORCH_SDPA:MATH"):
            raise RuntimeError("boom")
    assert (attention.attn_backend, attention.is_flash_attn_backend, attention._fa_version) == before


def test_attention_backends_are_timed_compared_and_failures_recorded(attention):
    lengths = [40, 24]
    backends = ["TORCH_SDPA", "TORCH_SDPA:MATH", "TORCH_SDPA:CUDNN_ATTENTION"]
    rows = profile_encoder.measure_attention(attention, [("small", lengths[:1]), ("two", lengths)], backends,
                                             repeats=2, device=torch.device("cpu"), dtype=torch.float32)
    assert [(r["case"], r["images"], r["backend"]) for r in rows] == \
        [(c, n, b) for c, n in (("small", 1), ("two", 2)) for b in backends]
    for r in rows:
        if r["backend"] == "TORCH_SDPA:CUDNN_ATTENTION":  # no cuDNN kernel on a CPU: recorded, the run goes on
            assert "error" in r and "ms" not in r
            continue
        assert r["ms"] > 0 and r["tflops"] > 0
        if r["backend"] == "TORCH_SDPA:MATH":
            assert r["max_abs_diff"] < 1e-5
    # `tflops` counts QKᵀ and PV within each image only
    two = next(r for r in rows if r["case"] == "two" and r["backend"] == "TORCH_SDPA")
    flop = sum(4 * n * n * HEADS * HEAD_SIZE for n in lengths)
    assert two["tflops"] == pytest.approx(flop / (two["ms"] / 1000) / 1e12, rel=0.01)

    report = profile_encoder.attention_report({"attention_backends": rows})
    assert "| TORCH_SDPA:MATH |" in report and "error" in report and "two ×2" in report
    assert "TORCH_SDPA:CUDNN_ATTENTION (small ×1):" in report


def test_the_measured_call_is_attention_within_each_image(attention):
    """What the harness times is the real thing: q, k, v as views into one qkv projection, cu_seqlens keeping the
    images apart (an attention across both images would differ from this reference)."""
    lengths = [40, 24]
    qkv = torch.randn(1, sum(lengths), 3 * HEADS * HEAD_SIZE, generator=torch.Generator().manual_seed(0))
    q, k, v = qkv.chunk(3, dim=-1)
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    with profile_encoder.attention_backend([attention], "TORCH_SDPA"):
        out = attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=torch.tensor(max(lengths)))
    assert torch.allclose(out.reshape(sum(lengths), -1).double(), per_image_attention(q, k, v, lengths), atol=1e-5)


def test_unknown_backends_are_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        profile_encoder.main(["--out", str(tmp_path), "--attn-backends", "FLASH_ATTN,XFORMERS"])
    assert exc.value.code == 2 and "unknown attention backend 'XFORMERS'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_encoder.main(["--out", str(tmp_path), "--attn-backends", "TRITON_ATTN:MATH"])
    with pytest.raises(SystemExit):
        profile_encoder.main(["--out", str(tmp_path), "--no-loop"])
