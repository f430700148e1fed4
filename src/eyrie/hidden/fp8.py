"""float8_e4m3fn storage for hidden states: one scale per token and per layer block.

A token's aux row holds three layers' states side by side ([T, 3H]) whose magnitudes differ a
lot (early layers are small, late ones carry outlier channels), so each H-wide block gets its own
scale: scale = absmax / 448 (e4m3's largest finite value), q = x / scale rounded to e4m3. The
relative error is then e4m3's (3 mantissa bits: at most 1/16 per element, ~2-3% norm-wise), and
no value overflows. Scales are float32: 4 bytes per block is noise next to H bytes of states.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_NAME = "float8_e4m3fn"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32


def quantize_blocks(x: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, blocks*W] (any float dtype, any device) -> (q [T, blocks*W] float8_e4m3fn, scale [T, blocks] float32)."""
    T, width = x.shape
    if width % blocks:
        raise ValueError(f"a row of {width} values does not split into {blocks} equal blocks")
    grouped = x.float().reshape(T, blocks, width // blocks)  # (T, blocks, W)
    scale = grouped.abs().amax(dim=-1) / FP8_MAX  # (T, blocks)
    # An all-zero block keeps scale 0 (it dequantizes to zeros); divide by 1 there instead of 0.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (grouped / safe.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(T, width), scale.to(SCALE_DTYPE)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [T, blocks*W] float8 and scale [T, blocks] -> float32 [T, blocks*W]."""
    T, width = q.shape
    blocks = scale.shape[-1]
    grouped = q.float().reshape(T, blocks, width // blocks) * scale.float().unsqueeze(-1)
    return grouped.reshape(T, width)
