"""The optimizer of drafter training: AdamW over the float32 master weights, and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from eyrie.drafter.model import Eagle3Drafter


def clipped_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_grad_norm: float) -> torch.Tensor:
    """Scale the gradients to a total norm of at most max_grad_norm, then step; returns the total norm before clipping,
    a device tensor (no host sync; a non-finite norm is the caller's to check).

    Fused AdamW clips inside its own kernel: the clip's factor goes in as its grad_scale, which the kernel divides each
    gradient by as it reads it (and stores the result, so .grad ends clipped as clip_grad_norm_ leaves it). That is one
    pass over the gradients fewer than scaling them first (1.7 GB of float32 gradients at the Llama-3.1-8B drafter shape).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if not (grads and all(group.get("fused") for group in optimizer.param_groups)):
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        optimizer.step()
        return norm
    factor = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s factor
    optimizer.grad_scale = factor.reciprocal().to(torch.float32)  # read by torch.optim.Adam(W).step, as GradScaler sets it
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm


def make_optimizer(model: Eagle3Drafter, learning_rate: float, weight_decay: float, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over the float32 master weights (decay on matrices only); fused kernels on CUDA unless fused=False."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if fused is None:
        fused = all(p.is_cuda for p in params)  # one kernel per group instead of several per tensor
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), **({"fused": True} if fused else {}))


LR_SCHEDULES = ("cosine", "linear", "constant")  # train.lr_schedule


def learning_rate(step: int, total_steps: int, base: float, warmup_ratio: float, schedule: str = "cosine") -> float:
    """Linear warmup over warmup_ratio of the steps, then (train.lr_schedule) cosine decay towards 0, linear decay
    towards 0, or constant at base; step is 0-based."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"train.lr_schedule is {schedule!r}, expected one of {', '.join(LR_SCHEDULES)}")
    warmup = int(warmup_ratio * total_steps)
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    if schedule == "constant":
        return base
    if schedule == "linear":
        return base * (1.0 - progress)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))
