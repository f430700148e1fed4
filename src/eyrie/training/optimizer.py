"""The optimizer of drafter training: AdamW over the float32 master weights, and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from eyrie.drafter.model import Eagle3Drafter


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
