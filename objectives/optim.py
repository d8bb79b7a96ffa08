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


class AdamW(torch.optim.AdamW):
    """torch's AdamW, the same arithmetic, without the import of torch._dynamo that its methods make
    at their first call only to tell Dynamo not to trace them (about 1 s of CPU per process, at
    every launch, for an eager run). Nothing traces the optimizer here (train.compile compiles the
    blocks and the loss): the step runs under no_grad, as `_use_grad_for_differentiable` sets it for
    a non-differentiable optimizer, without its graph break; the methods wrapped in
    `torch._disable_dynamo` get the mark that wrapper caches after its first call, the function itself."""

    def __init__(self, *args, **kwargs) -> None:
        for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
            raw = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
            if raw is not None and getattr(raw, "__dynamo_disable", None) is None:
                setattr(raw, "__dynamo_disable", raw)  # setattr: a name in a class body would be mangled
        super().__init__(*args, **kwargs)

    _raw_step = getattr(torch.optim.AdamW.step, "__wrapped__", None)

    def step(self, closure=None):
        if self._raw_step is None or self.defaults.get("differentiable"):
            return super().step(closure)
        with torch.no_grad():
            return self._raw_step(closure)


def make_optimizer(model: torch.nn.Module, t) -> torch.optim.AdamW:
    """AdamW over the parameters that train; weight decay on matrices only (not on norms). torch's
    for-loop implementation, not its fused kernel: the fused CPU kernel, about 4x faster at 26M,
    computes a tensor's last elements past a multiple of the vector width another way than the
    rest, so an FSDP shard gave other bits than the whole tensor (a LoRA run on 3 ranks, 2e-10 off
    from step 2; measured, docs/performance.md): the exactness across strategies is worth more."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


def optimizer_step(opt: torch.optim.Optimizer, scaler, reducer, grad_clip: float, skip: bool = False) -> None:
    """The end of a step, after the reduction: unscale (float16's GradScaler), clip the global norm
    (through the reduction: FSDP's norm is over shards), step, and drop the gradients. `skip`: drop
    them without a step (PPO after its early stop, as MiniMind leaves its update loop)."""
    if scaler and not skip:
        scaler.unscale_(opt)
    if grad_clip and not skip:
        reducer.clip(grad_clip)
    if scaler and not skip:
        scaler.step(opt)
        scaler.update()
    elif not skip:
        opt.step()
    opt.zero_grad(set_to_none=True)
