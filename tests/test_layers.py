"""Building blocks against written-out reference formulas (the Qwen3 conventions of qwen-tts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kazeia import cpu, matmul
from kazeia.layers import Attention, KVCache, Rotary, apply_rotary, cache_dtype, rms_norm
from kazeia.matmul import ROW_BUCKETS, matrix_product


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's order: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_bit_identical_to_the_reference_order(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 24, 64, generator=gen) * 3).to(dtype)
    weight = (torch.rand(24, 64, generator=gen) + 0.5).to(dtype)  # per-head scales, as in the fused qk norm
    assert torch.equal(rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6))
    assert torch.equal(rms_norm(x, weight[0], 1e-6), reference_rms_norm(x, weight[0], 1e-6))


def test_rotary_matches_rotate_half_and_its_table():
    rot = Rotary(64, 1_000_000.0)
    positions = torch.arange(7, 12)
    freqs = positions.float()[:, None] * rot.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    x = torch.randn(2, 5, 3, 64)  # (B, T, heads, hd)
    half = x[..., 32:], x[..., :32]
    rotated = torch.cat((-half[0], half[1]), dim=-1)
    expected = x * emb.cos()[:, None] + rotated * emb.sin()[:, None]
    torch.testing.assert_close(apply_rotary(x, *rot(positions, torch.float32)), expected, rtol=0, atol=1e-6)
    # The cached table serves the same values as computing the positions on their own.
    for table, direct in zip(rot.span(7, 5, torch.float32, "cpu"), rot(positions, torch.float32), strict=True):
        assert torch.equal(table, direct)
    assert rot.span(1000, 3, torch.float32, "cpu")[0].shape == (3, 1, 64)  # grows on demand


def test_float32_cache_attention_matches_same_dtype_attention():
    """bfloat16 weights on the CPU keep float32 keys/values: same result within bfloat16 rounding."""
    assert cache_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 16, qk_norm_eps=1e-6).to(torch.bfloat16)
    attn.fuse()
    x = torch.randn(1, 6, 32, dtype=torch.bfloat16)
    rope = Rotary(16, 10000.0)(torch.arange(6), torch.bfloat16)
    wide = KVCache(1, 2, 8, 16, "cpu", torch.float32)
    narrow = KVCache(1, 2, 8, 16, "cpu", torch.bfloat16)
    got, same = attn(x, rope, wide, 0, None), attn(x, rope, narrow, 0, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), same.float(), rtol=0.02, atol=0.02)
    assert torch.equal(wide.k[:, :, :6].bfloat16(), narrow.k[:, :, :6])  # keys stored exactly


@pytest.mark.parametrize("rows", [3, 49])
def test_a_prompt_product_is_f_linear_whatever_its_team(rows):
    """`layers.matrix_product` (oneDNN's matmul on the plain weight) gives F.linear's product to
    float rounding, and the same bits on a team of two threads as on one (`cpu.team`)."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(384, 256), torch.randn(384), torch.randn(rows, 256)
    with cpu.team(1):
        alone = matrix_product(x, weight, bias)
    torch.testing.assert_close(alone, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    with cpu.team(2):
        assert torch.equal(matrix_product(x, weight, bias), alone)
    half = matrix_product(x.bfloat16(), weight.bfloat16(), bias.bfloat16())  # not float32: F.linear's
    assert torch.equal(half, F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's matmul: its shapes are bounded")
def test_prompt_products_of_every_length_hand_onednn_a_few_row_counts(monkeypatch):
    """Prompts of 0 to 600 rows (and a batch of 3 x 97): oneDNN is only ever asked for the row
    counts of ROW_BUCKETS, so the primitives it builds and keeps for every new shape (~0.7 MB
    each, up to 1024 of them) stay few whatever the prompts' lengths; each product is F.linear's
    to float rounding, its padding rows dropped."""
    seen = set()

    def spy(rows, weight, bias, *args):
        seen.add(rows.shape[0])
        return matmul.F.linear(rows, weight, bias)  # what oneDNN computes, to rounding

    monkeypatch.setattr(matmul, "LINEAR_POINTWISE", spy)
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    for shape in [(n, 24) for n in range(0, 601, 7)] + [(3, 97, 24)]:
        x = torch.randn(*shape)
        got = matrix_product(x, weight, bias)
        assert got.shape == (*shape[:-1], 40)
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert seen == set(ROW_BUCKETS)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's matmul")
@pytest.mark.parametrize("rows", [1, 5, 49, 300])
def test_a_padded_prompt_product_is_f_linear_to_rounding(rows):
    """The real oneDNN product on padded and blocked rows: F.linear's result to float rounding."""
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    torch.testing.assert_close(matrix_product(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
