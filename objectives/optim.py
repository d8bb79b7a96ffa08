"""The optimizer and its learning rate: AdamW with decay on matrices only, and a schedule that is a
pure function of the optimizer step (docs/design.md I5)."""
from __future__ import annotations

import math

import torch


def lr_at(step: int, t) -> float:
    """LR of optimizer step `step` (0-based) under train config `t`: linear warm-up, then cosine down
    to min_lr_ratio * lr. A pure function of the step (docs/design.md I5), so only the step is saved."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, t) -> torch.optim.AdamW:
    """AdamW over the parameters that train; weight decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))
