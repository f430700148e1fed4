"""The drafter's RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), eager or fused (train.fused_norms).

Eagerly, each call's forward is about 5 kernels (cast, square, mean, rsqrt, products) and its backward about 12
(casts, products, means): at the Llama-3.1-8B drafter shape on an H100, the 28 norm backwards of a training step
(4 norms x 7 TTT steps) took about 8 ms of a 109 ms step, and the forwards a few ms more
(`python benchmarks/train_throughput.py --variants flex+fused-loss+fused-wgrad --profile flex+fused-loss+fused-wgrad`).
With fused kernels (NormKernels(fused=True)) the forward math and the backward math each run through torch.compile
(inductor): one or a few kernels each. It is the same formula, so the values are equal up to rounding. Measured at that
shape on an H100: 17,848 -> 20,383 tok/s (114.7 -> 100.5 ms a step) at the same peak memory
(`--variants flex+fused-loss+fused-wgrad,flex+fused-loss+fused-wgrad+fused-norms`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from eyrie.core.fused_pieces import FusedPieces, fuses_on_cuda


def _norm_forward(x, weight, eps):
    """(the normed output, rsqrt(mean(x^2) + eps) of each row (..., 1) float32)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


def _norm_backward(x, weight, rstd, grad_out, need_x: bool, need_weight: bool):
    """(grad_x or None, grad_weight or None) from the saved x and rstd; normed is recomputed (cheap next to keeping it)."""
    normed = x.float() * rstd
    grad_weight = None
    if need_weight:
        grad_weight = (grad_out * normed.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
    grad_x = None
    if need_x:
        grad_normed = (grad_out * weight).float()  # the .to(x.dtype) cast passes gradients through
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        grad_x = grad_x.to(x.dtype)
    return grad_x, grad_weight


PIECES = {"forward": _norm_forward, "backward": _norm_backward}


RECOMPILE_LIMIT = 32  # graphs per piece: rank 2 or 3 inputs, one row or many, bf16 or float32, which gradients are needed


@functools.cache
def _compiled(name: str):
    # Past dynamo's default of 8 graphs a piece would run eagerly without a word; the norms' variants come near it.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(PIECES[name], dynamic=True, fullgraph=True)


class NormKernels(FusedPieces):
    """The RMSNorm's forward and backward math, eager or fused by torch.compile (train.fused_norms).

    Inside an outer torch.compile (train.compile's pieces trace through the norms) the eager math runs: the outer
    graph fuses it. If compiling fails, a warning is issued, the reason kept in error, and every norm runs eagerly
    from then on.
    """

    def __init__(self, fused: bool):
        super().__init__(fused, PIECES, lambda name: _compiled(name), "train.fused_norms", "the norms run eagerly")


EAGER_NORMS = NormKernels(fused=False)
fuses_norms = fuses_on_cuda  # train.fused_norms settled for a device


class _RMSNormFunction(torch.autograd.Function):
    """The norm, saving only x and rsqrt for backward.

    Autograd on the plain formula keeps a float32 copy of x and the normalised x (three times the
    memory of a bf16 x) for every call: 4 norms x 7 TTT steps of a training step.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, kernels):
        out, rstd = kernels.run("forward", x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = ctx.kernels.run("backward", x, weight, rstd, grad_out, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_x, grad_weight, None, None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = EAGER_NORMS  # a plain attribute: no state of its own, so state_dict and checkpoints stay as they are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.kernels)


def use_norm_kernels(module: nn.Module, kernels: NormKernels) -> int:
    """Every RMSNorm in module runs its math through kernels; returns how many there are."""
    norms = [m for m in module.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.kernels = kernels
    return len(norms)
