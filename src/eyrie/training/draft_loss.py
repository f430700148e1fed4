"""Memory-bounded soft cross-entropy of the draft head, one chunk of rows at a time.

For normed drafter outputs x [n, H], head W [Vd, H] and target probabilities p [n, Vd]:

    z = x @ W.T,   loss_row = sum(p) * logsumexp(z) - sum(p * z)     (= -sum p * log_softmax(z))
    dloss/dz = sum(p) * softmax(z) - p

Autograd on the plain formula keeps the [n, Vd] logits, their float32 copy and the log-softmax for
backward (at Vd = 32000 and n = 2048: about 650 MB for each of the 7 TTT steps). Here forward
keeps only x and logsumexp per row; backward recomputes each chunk's logits.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 25  # logits of one chunk: 32M float32 = 128 MB


def chunk_rows_for(vocab_size: int, elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    return max(1, elements // vocab_size)


def _stat_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in float32 at least (float64 stays float64: exact tests)."""
    return torch.promote_types(compute_dtype, torch.float32)


def _logits(x_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x_chunk @ weight.T).to(_stat_dtype(x_chunk.dtype))  # (c, Vd)


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, probs, rows, argmax, compute_dtype, chunk_rows):
        """(summed loss over the n rows, #rows whose logits' argmax == argmax). probs rows are probs[rows]."""
        w = weight.to(compute_dtype)
        xc = x.to(compute_dtype)
        n = xc.shape[0]
        lse = torch.empty(n, dtype=_stat_dtype(compute_dtype), device=x.device)
        loss = torch.zeros((), dtype=lse.dtype, device=x.device)
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        for a in range(0, n, chunk_rows):
            z = _logits(xc[a : a + chunk_rows], w)
            p = probs[rows[a : a + chunk_rows]]
            lse[a : a + chunk_rows] = torch.logsumexp(z, dim=-1)
            loss += (p.sum(-1) * lse[a : a + chunk_rows] - (p * z).sum(-1)).sum()
            correct += (z.argmax(-1) == argmax[a : a + chunk_rows]).sum()
            del z, p
        ctx.save_for_backward(xc, weight, probs, rows, lse)
        ctx.compute_dtype, ctx.chunk_rows, ctx.x_dtype = compute_dtype, chunk_rows, x.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        xc, weight, probs, rows, lse = ctx.saved_tensors
        w = weight.to(ctx.compute_dtype)
        grad_x = torch.empty_like(xc)
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)  # accumulated over chunks in fp32 (at least)
        step = ctx.chunk_rows
        for a in range(0, xc.shape[0], step):
            x_chunk = xc[a : a + step]
            z = _logits(x_chunk, w)
            p = probs[rows[a : a + step]]
            grad_z = p.sum(-1, keepdim=True) * torch.exp(z - lse[a : a + step, None]) - p
            grad_z = (grad_z * grad_loss).to(ctx.compute_dtype)  # (c, Vd)
            del z, p
            grad_x[a : a + step] = grad_z @ w
            grad_w += grad_z.T @ x_chunk
        grad_x = grad_x.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None, None, None


def chunked_soft_cross_entropy(x, weight, probs, rows, argmax, compute_dtype=None, chunk_rows=None):
    """(loss summed over rows, correct count) of logits x @ weight.T against probs[rows].

    x [n, H] (the normed drafter output at trained positions), weight [Vd, H], probs [N, Vd]
    float32, rows [n] long (row of probs for each x row), argmax [n] (the target's draft-vocab
    argmax: accuracy). The logits are computed in compute_dtype (default x's dtype; the
    autocast dtype under autocast), chunk_rows rows at a time, softmax statistics in float32.
    Gradients flow to x and weight only.
    """
    if compute_dtype is None:
        device_type = x.device.type
        compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    chunk_rows = chunk_rows or chunk_rows_for(weight.shape[0])
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _ChunkedSoftCrossEntropy.apply(x, weight, probs, rows, argmax, compute_dtype, chunk_rows)
