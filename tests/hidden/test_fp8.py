"""float8_e4m3fn storage of hidden states: per-token, per-layer-block scales (eyrie.hidden.fp8)."""

from __future__ import annotations

import pytest
import torch

from eyrie.hidden.fp8 import FP8_DTYPE, FP8_MAX, dequantize_blocks, quantize_blocks


def relative_norm_error(x, y, blocks):
    T = x.shape[0]
    x, y = x.reshape(T, blocks, -1), y.reshape(T, blocks, -1)
    return (y - x).norm(dim=-1) / x.norm(dim=-1)  # (T, blocks)


def test_round_trip_error_is_e4m3s():
    torch.manual_seed(0)
    x = torch.randn(64, 3 * 128)
    q, scale = quantize_blocks(x, 3)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (64, 3)
    y = dequantize_blocks(q, scale)
    errors = relative_norm_error(x, y, 3)
    assert errors.mean() < 0.03 and errors.max() < 0.04
    # 3 mantissa bits: each normal-range value is within half a step (1/16 relative) of itself.
    normal = x.abs() > scale.repeat_interleave(128, dim=1) * 2.0**-6
    assert ((y - x).abs() / x.abs())[normal].max() <= 1 / 16 + 1e-6


def test_each_block_has_its_own_scale():
    """An early layer's small states next to a late layer's huge ones must not lose their precision."""
    torch.manual_seed(1)
    magnitudes = torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(32)
    x = torch.randn(16, 96) * magnitudes
    y = dequantize_blocks(*quantize_blocks(x, 3))
    assert relative_norm_error(x, y, 3).max() < 0.04


def test_absmax_maps_to_the_largest_e4m3_value():
    x = torch.tensor([[1.0, -8.0, 2.0, 0.5]])
    q, scale = quantize_blocks(x, 2)
    torch.testing.assert_close(scale, torch.tensor([[8.0 / FP8_MAX, 2.0 / FP8_MAX]]))
    assert q.float()[0, 1] == -FP8_MAX and q.float()[0, 2] == FP8_MAX
    torch.testing.assert_close(dequantize_blocks(q, scale), x)  # these values are exact in e4m3


def test_zero_block_stays_zero():
    x = torch.zeros(3, 8)
    x[1, 4:] = 5.0
    q, scale = quantize_blocks(x, 2)
    y = dequantize_blocks(q, scale)
    assert torch.isfinite(y).all() and torch.equal(y, x)


def test_bf16_input_and_bad_width():
    x = torch.randn(4, 12, dtype=torch.bfloat16)
    y = dequantize_blocks(*quantize_blocks(x, 3))
    assert y.dtype == torch.float32 and relative_norm_error(x.float(), y, 3).max() < 0.04
    with pytest.raises(ValueError, match="3 equal blocks"):
        quantize_blocks(torch.zeros(2, 10), 3)
