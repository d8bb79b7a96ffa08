"""PPO's terms as MiniMind's trainer/train_ppo.py computes them (GAE, whitened advantages, the clipped
policy loss with its k3 KL to the reference, the clipped value loss, the approximate KL that stops a
rollout's updates early), each over the global batch: sums a micro-batch adds, divided by the global
batch's counts, so that the world size and the micro-batch split do not matter.

Not yet a train.objective (issue 45 item 1 is open): the rollout, the critic's optimizer in the
checkpoint and the early stop's agreement are to come; these are the arithmetic they will call,
refereed against MiniMind's own code (tests/test_ppo.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PPOConfig:
    """train.ppo: MiniMind's names and defaults (train_ppo.py's arguments)."""

    critic: str = ""
    """The critic's weights: any model.init_from source ('': the policy's, as MiniMind), a value head added."""
    critic_lr: float = 5e-7
    """The critic's learning rate (MiniMind's critic_learning_rate)."""
    gamma: float = 1.0
    """GAE's discount, in [0, 1]."""
    lam: float = 0.95
    """GAE's lambda, in [0, 1]."""
    clip: float = 0.2
    """The policy ratio's clip range (MiniMind's clip_epsilon)."""
    cliprange_value: float = 0.2
    """The value's clip range around the rollout's values."""
    vf_coef: float = 0.5
    """The value loss's weight."""
    kl_coef: float = 0.02
    """The k3 KL to the reference's weight."""
    updates_per_rollout: int = 2
    """Optimizer passes over each rollout (MiniMind's ppo_update_iters)."""
    early_stop_kl: float = 0.25
    """A rollout's updates stop once the approximate KL to the rollout's policy passes it."""

    def __post_init__(self) -> None:
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"train.ppo.{key} must be in [0, 1], got {getattr(self, key)}")
        if not (self.clip > 0 and self.cliprange_value > 0 and self.vf_coef >= 0 and self.kl_coef >= 0 and self.critic_lr > 0):
            raise ValueError("train.ppo: clip > 0, cliprange_value > 0, vf_coef >= 0, kl_coef >= 0, critic_lr > 0 expected")
        if self.updates_per_rollout < 1 or not self.early_stop_kl > 0:
            raise ValueError("train.ppo.updates_per_rollout must be >= 1 and train.ppo.early_stop_kl > 0")


def token_rewards(rewards: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, R): each sequence's reward at its last response token (lengths >= 1), zero elsewhere."""
    out = torch.zeros(len(rewards), width, dtype=rewards.dtype)
    out[torch.arange(len(rewards)), lengths - 1] = rewards
    return out


def gae(values: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the response tokens (values zero past each response, the
    value after the last position 0): (advantages, returns = advantages + values), both (B, R)."""
    width = values.shape[1]
    last = torch.zeros(values.shape[0], dtype=values.dtype)
    out = []
    for t in reversed(range(width)):
        nxt = values[:, t + 1] if t < width - 1 else 0.0
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def whiten(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(adv - mean) / sqrt(var + 1e-8) over the masked tokens of the batch given (the global batch's: all
    of it, in micro-batch order), zero where masked."""
    n = mask.sum().clamp(min=1)
    mean = (adv * mask).sum() / n
    var = ((adv - mean) ** 2 * mask).sum() / n
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask


def policy_terms(logp, old, ref, adv, mask, cfg: PPOConfig, tokens: float) -> dict[str, torch.Tensor]:
    """A micro-batch's sums over its masked tokens divided by `tokens` (the global batch's count): the
    clipped policy loss plus kl_coef times the k3 KL to the reference ("policy"), the KL ("kl_ref"),
    the approximate KL 0.5 * log_ratio^2 ("approx_kl") and the clip fraction ("clipfrac")."""
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    kl = torch.exp(ref - logp) - (ref - logp) - 1.0
    clipped = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - cfg.clip, 1.0 + cfg.clip))
    kl_ref = (kl * mask).sum() / tokens
    return {"policy": (clipped * mask).sum() / tokens + cfg.kl_coef * kl_ref, "kl_ref": kl_ref,
            "approx_kl": (0.5 * log_ratio ** 2 * mask).sum().detach() / tokens,
            "clipfrac": (((ratio - 1.0).abs() > cfg.clip).float() * mask).sum().detach() / tokens}


def value_loss(values, old_values, returns, mask, cliprange: float, tokens: float) -> torch.Tensor:
    """0.5 * max((v - R)^2, (clamp(v, old - c, old + c) - R)^2) summed over the masked tokens / `tokens`."""
    clipped = torch.clamp(values, old_values - cliprange, old_values + cliprange)
    return 0.5 * (torch.max((values - returns) ** 2, (clipped - returns) ** 2) * mask).sum() / tokens
