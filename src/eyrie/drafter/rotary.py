"""The drafter's rotary on q and k: x * cos + rotate_half(x) * sin, eager or fused (train.fused_rotary).

Eagerly, rotating q and k is about 12 kernels in forward (products, slices, a negation, a concat, sums) and about 20
in backward, each reading and writing a whole (B, heads, T, head_dim) tensor. Fused (RotaryKernels(fused=True)), the
forward math of q and k and the backward math of their gradients each run through torch.compile (inductor) as one or
two kernels. The backward is the formula's transpose: grad_x = g * cos + rotate_half^T(g * sin), with
rotate_half^T(y) = cat(y2, -y1); cos and sin are constants (no gradient), and only they are kept for backward.
"""

from __future__ import annotations

import functools

import torch

from eyrie.core.fused_pieces import FusedPieces, fuses_on_cuda


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_transposed(y: torch.Tensor) -> torch.Tensor:
    """The adjoint of rotate_half: <rotate_half(x), y> = <x, _rotate_half_transposed(y)>."""
    half = y.shape[-1] // 2
    return torch.cat((y[..., half:], -y[..., :half]), dim=-1)


def _rotary_forward(q, k, cos, sin, out_dtype=None):
    """(q, k) rotated, in out_dtype (None: the promoted dtype of x and cos, as plain tensor math gives)."""
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return (q, k) if out_dtype is None else (q.to(out_dtype), k.to(out_dtype))


def _rotary_backward(grad_q, grad_k, cos, sin, q_dtype, k_dtype):
    """The gradients of q and k (in their own dtypes) from those of the rotated q and k."""
    return ((grad_q * cos + _rotate_half_transposed(grad_q * sin)).to(q_dtype),
            (grad_k * cos + _rotate_half_transposed(grad_k * sin)).to(k_dtype))


PIECES = {"forward": _rotary_forward, "backward": _rotary_backward}


@functools.cache
def _compiled(name: str):
    return torch.compile(PIECES[name], dynamic=True, fullgraph=True)


class RotaryKernels(FusedPieces):
    """The rotary's forward and backward math, eager or fused by torch.compile (train.fused_rotary).

    Inside an outer torch.compile (train.compile's pieces trace through the rotary) the eager math runs: the outer
    graph fuses it. If compiling fails, a warning is issued, the reason kept in error, and the rotary runs eagerly
    from then on.
    """

    def __init__(self, fused: bool):
        super().__init__(fused, PIECES, lambda name: _compiled(name), "train.fused_rotary", "the rotary runs eagerly")


EAGER_ROTARY = RotaryKernels(fused=False)
fuses_rotary = fuses_on_cuda  # train.fused_rotary settled for a device


class _RotaryFunction(torch.autograd.Function):
    """Rotary on q and k through kernels, keeping only cos and sin for backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, out_dtype, kernels):
        ctx.save_for_backward(cos, sin)
        ctx.kernels, ctx.dtypes = kernels, (q.dtype, k.dtype)
        return kernels.run("forward", q, k, cos, sin, out_dtype)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        grad_q, grad_k = ctx.kernels.run("backward", grad_q, grad_k, cos, sin, *ctx.dtypes)
        return grad_q, grad_k, None, None, None, None


def apply_rotary(q, k, cos, sin, kernels: RotaryKernels = EAGER_ROTARY, out_dtype: torch.dtype | None = None):
    """(q, k) rotated, in out_dtype (None: the dtype plain tensor math gives). Eager kernels take plain autograd (the
    reference formula, as inference runs it); fused ones the autograd Function above. cos and sin broadcast against
    q and k and carry no gradient."""
    if not kernels.active or torch.compiler.is_compiling():
        return _rotary_forward(q, k, cos, sin, out_dtype)
    return _RotaryFunction.apply(q, k, cos.detach(), sin.detach(), out_dtype, kernels)
