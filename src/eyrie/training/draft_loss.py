"""Memory-bounded soft cross-entropy of the draft head, one chunk of rows at a time.

For normed drafter outputs x [n, H], head W [Vd, H] and target probabilities p [n, Vd]:

    z = x @ W.T,   loss_row = sum(p) * logsumexp(z) - sum(p * z)     (= -sum p * log_softmax(z))
    dloss/dz = sum(p) * softmax(z) - p

Autograd on the plain formula keeps the [n, Vd] logits, their float32 copy and the log-softmax for
backward (at Vd = 32000 and n = 2048: about 650 MB for each of the 7 TTT steps). Here forward
keeps only x and logsumexp per row; backward recomputes each chunk's logits.
"""

from __future__ import annotations

import functools

import torch

from eyrie.core.fused_pieces import FusedPieces, fuses_on_cuda

DEFAULT_CHUNK_ELEMENTS = 1 << 25  # logits of one eager chunk: 32M, each float32 intermediate 128 MB
# Fused, a chunk's only [c, Vd] tensors are its logits and their gradient in the compute dtype (bf16 on CUDA: 128 MB
# each at 64M), so twice the rows fit the same memory: one chunk for a whole step of 2,048 rows at Vd 32000, one
# weight-gradient product (K = 2,048) into the head's float32 sum a step instead of two (each reads and writes it).
FUSED_CHUNK_ELEMENTS = 1 << 26


def chunk_rows_for(vocab_size: int, elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    return max(1, elements // vocab_size)


def _stat_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in float32 at least (float64 stays float64: exact tests)."""
    return torch.promote_types(compute_dtype, torch.float32)


def _chunk_forward(z, probs, rows, argmax):
    """(logsumexp [c], loss summed over the chunk, #rows whose argmax hits) of logits z [c, Vd] against probs[rows]."""
    z = z.to(_stat_dtype(z.dtype))
    p = probs[rows]
    lse = torch.logsumexp(z, dim=-1)
    return lse, (p.sum(-1) * lse - (p * z).sum(-1)).sum(), (z.argmax(-1) == argmax).sum()


def _chunk_grad(z, probs, rows, lse, grad_loss, dtype):
    """dloss/dz of one chunk, times grad_loss, in dtype (the matrix products' input dtype)."""
    z = z.to(lse.dtype)
    p = probs[rows]
    return ((p.sum(-1, keepdim=True) * torch.exp(z - lse[:, None]) - p) * grad_loss).to(dtype)


PIECES = {"forward": _chunk_forward, "grad": _chunk_grad}


@functools.cache
def _compiled(name: str):
    return torch.compile(PIECES[name], dynamic=True, fullgraph=True)


class LossChunks(FusedPieces):
    """The per-chunk elementwise work of the loss, eager or fused by torch.compile (train.fused_loss).

    Eagerly, each chunk's float32 [c, Vd] logits go through about a dozen kernels in forward and backward
    (cast, gather of the target rows, logsumexp, products, sums, exp, subtraction, cast): at the pipeline's
    drafter shape on an H200 that was two thirds of a training step's kernel time, the matrix products 14%
    (`benchmarks/train_throughput.py --shape pipeline` with `--profile`; docs/RESULTS.md). Compiled, forward is one reduction over each row and backward one pointwise
    kernel that writes the gradient in the products' dtype. The values are the same formulas.
    If compiling fails, a warning is issued, the reason kept in error, and every chunk runs eagerly from then on.
    """

    def __init__(self, fused: bool, chunk_elements: int | None = None):
        super().__init__(fused, PIECES, lambda name: _compiled(name), "train.fused_loss", "the loss runs eagerly")
        self.chosen_chunk_elements = chunk_elements

    @property
    def chunk_elements(self) -> int:
        """Elements of one chunk's [rows, Vd] logits: the chosen, else the fused or (also after a fallback) the eager size."""
        return self.chosen_chunk_elements or (FUSED_CHUNK_ELEMENTS if self.active else DEFAULT_CHUNK_ELEMENTS)

    def forward(self, z, probs, rows, argmax):
        return self.run("forward", z, probs, rows, argmax)

    def grad(self, z, probs, rows, lse, grad_loss, dtype):
        return self.run("grad", z, probs, rows, lse, grad_loss, dtype)


EAGER = LossChunks(fused=False)


fuses_loss = fuses_on_cuda  # train.fused_loss settled for a device


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, probs, rows, argmax, compute_dtype, chunk_rows, chunks, grad_sum):
        """(summed loss over the n rows, #rows whose logits' argmax == argmax). probs rows are probs[rows]."""
        w = weight.to(compute_dtype)  # weight itself when it is a step copy (train.fused_weight_grads)
        xc = x.to(compute_dtype)
        n = xc.shape[0]
        lse = torch.empty(n, dtype=_stat_dtype(compute_dtype), device=x.device)
        loss = torch.zeros((), dtype=lse.dtype, device=x.device)
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        for a in range(0, n, chunk_rows):
            lse_chunk, loss_chunk, correct_chunk = chunks.forward(xc[a : a + chunk_rows] @ w.T, probs, rows[a : a + chunk_rows], argmax[a : a + chunk_rows])
            lse[a : a + chunk_rows] = lse_chunk
            loss += loss_chunk
            correct += correct_chunk
        # A step copy (grad_sum) is not kept for backward: the head's TTT steps' backwards share one cast of grad_sum.weight,
        # made by the first of them and dropped after the last (GradSum.weight_for_backward), not held through backward.
        if grad_sum is not None:
            grad_sum.expect_backward()
        ctx.save_for_backward(xc, weight if grad_sum is None else None, probs, rows, lse)
        ctx.compute_dtype, ctx.chunk_rows, ctx.x_dtype, ctx.chunks, ctx.grad_sum = compute_dtype, chunk_rows, x.dtype, chunks, grad_sum
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        xc, weight, probs, rows, lse = ctx.saved_tensors
        grad_sum = ctx.grad_sum
        w = weight.to(ctx.compute_dtype) if grad_sum is None else grad_sum.weight_for_backward(ctx.compute_dtype)
        grad_x = torch.empty_like(xc)
        # Without a step's sum: accumulated over chunks in fp32 (at least) here, then by autograd over the TTT steps.
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if grad_sum is None else None
        step = ctx.chunk_rows
        for a in range(0, xc.shape[0], step):
            x_chunk = xc[a : a + step]
            grad_z = ctx.chunks.grad(x_chunk @ w.T, probs, rows[a : a + step], lse[a : a + step], grad_loss, ctx.compute_dtype)  # (c, Vd)
            grad_x[a : a + step] = grad_z @ w
            if grad_sum is None:
                grad_w += grad_z.T @ x_chunk
            else:  # one float32 product into the head's sum over the step (eyrie.training.weight_grads)
                grad_sum.add(grad_z, x_chunk)
        if grad_sum is not None:  # the last of the head's backwards frees the shared cast here, before grad_x's cast allocates
            del w
            grad_sum.backward_done()
        grad_x = grad_x.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] and grad_w is not None else None
        return grad_x, grad_w, None, None, None, None, None, None, None


def chunked_soft_cross_entropy(x, weight, probs, rows, argmax, compute_dtype=None, chunk_rows=None, chunks: LossChunks = EAGER,
                               grad_sum=None):
    """(loss summed over rows, correct count) of logits x @ weight.T against probs[rows].

    x [n, H] (the normed drafter output at trained positions), weight [Vd, H], probs [N, Vd]
    float32, rows [n] long (row of probs for each x row), argmax [n] (the target's draft-vocab
    argmax: accuracy). The logits are computed in compute_dtype (default x's dtype; the
    autocast dtype under autocast), chunk_rows rows at a time, softmax statistics in float32.
    Gradients flow to x and weight only. chunks: the per-chunk elementwise work, eager or fused (LossChunks).
    grad_sum: weight is the step's copy of the head (used in forward only; the backwards share one cast of grad_sum.weight) and its
    gradient goes into this sum, one product per chunk, not through autograd (a weight_grads.GradSum; train.fused_weight_grads).
    """
    if compute_dtype is None:
        device_type = x.device.type
        compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    chunk_rows = chunk_rows or chunk_rows_for(weight.shape[0], chunks.chunk_elements)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _ChunkedSoftCrossEntropy.apply(x, weight, probs, rows, argmax, compute_dtype, chunk_rows, chunks, grad_sum)
