"""The drafter layer's pointwise pieces, eager or fused (train.fused_pointwise): the rotary on q and k, and the MLP's
SiLU(gate) * up.

Eagerly, rotating q and k is about 12 kernels in forward (products, slices, a negation, a concat, sums) and about 20
in backward, and SiLU * up is 2 in forward and 3 in backward, each reading and writing a whole activation. Fused
(PointwiseKernels(fused=True)), each piece's forward math and the math of its backward run through torch.compile
(inductor) as one or two kernels, in autograd Functions that keep only what backward needs:

    rotary   x * cos + rotate_half(x) * sin for q and k; backward g * cos + rotate_half^T(g * sin), with
             rotate_half^T(y) = cat(y2, -y1); cos and sin are constants, the only tensors kept
    swiglu   silu(gate) * up; backward from gate and up alone (silu(gate) is recomputed, not kept: at the Llama-3.1-8B
             drafter shape 59 MB a TTT step, 0.4 GB a training step of 2,048 tokens)

The formulas are eager's, so the values are equal up to rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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


def _swiglu_forward(gate, up):
    return F.silu(gate) * up


def _swiglu_backward(gate, up, grad):
    """(grad_gate, grad_up) of silu(gate) * up, at least float32 inside and the inputs' dtypes out; silu' = s * (1 + g * (1 - s))."""
    wide = torch.promote_types(gate.dtype, torch.float32)
    g, u, d = gate.to(wide), up.to(wide), grad.to(wide)
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


PIECES = {"rotary_forward": _rotary_forward, "rotary_backward": _rotary_backward,
          "swiglu_forward": _swiglu_forward, "swiglu_backward": _swiglu_backward}


@functools.cache
def _compiled(name: str):
    return torch.compile(PIECES[name], dynamic=True, fullgraph=True)


class PointwiseKernels(FusedPieces):
    """The layer's pointwise pieces, eager or fused by torch.compile (train.fused_pointwise).

    Inside an outer torch.compile (train.compile's pieces trace through them) the eager math runs: the outer graph
    fuses it. If compiling fails, a warning is issued, the reason kept in error, and the pieces run eagerly from then on.
    """

    def __init__(self, fused: bool):
        super().__init__(fused, PIECES, lambda name: _compiled(name), "train.fused_pointwise", "the rotary and SiLU * up run eagerly")


EAGER_POINTWISE = PointwiseKernels(fused=False)
fuses_pointwise = fuses_on_cuda  # train.fused_pointwise settled for a device


def _fused(kernels: PointwiseKernels) -> bool:
    return kernels.active and not torch.compiler.is_compiling()


class _RotaryFunction(torch.autograd.Function):
    """Rotary on q and k through kernels, keeping only cos and sin for backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, out_dtype, kernels):
        ctx.save_for_backward(cos, sin)
        ctx.kernels, ctx.dtypes = kernels, (q.dtype, k.dtype)
        return kernels.run("rotary_forward", q, k, cos, sin, out_dtype)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        grad_q, grad_k = ctx.kernels.run("rotary_backward", grad_q, grad_k, cos, sin, *ctx.dtypes)
        return grad_q, grad_k, None, None, None, None


def apply_rotary(q, k, cos, sin, kernels: PointwiseKernels = EAGER_POINTWISE, out_dtype: torch.dtype | None = None):
    """(q, k) rotated, in out_dtype (None: the dtype plain tensor math gives). Eager kernels take plain autograd (the
    reference formula, as inference runs it); fused ones the autograd Function above. cos and sin broadcast against
    q and k and carry no gradient."""
    if not _fused(kernels):
        return _rotary_forward(q, k, cos, sin, out_dtype)
    return _RotaryFunction.apply(q, k, cos.detach(), sin.detach(), out_dtype, kernels)


class _SwigluFunction(torch.autograd.Function):
    """silu(gate) * up through kernels, keeping gate and up for backward."""

    @staticmethod
    def forward(ctx, gate, up, kernels):
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return kernels.run("swiglu_forward", gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = ctx.kernels.run("swiglu_backward", gate, up, grad)
        return grad_gate, grad_up, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, kernels: PointwiseKernels = EAGER_POINTWISE) -> torch.Tensor:
    """silu(gate) * up: plain autograd with eager kernels, the autograd Function above with fused ones."""
    if not _fused(kernels):
        return _swiglu_forward(gate, up)
    return _SwigluFunction.apply(gate, up, kernels)
