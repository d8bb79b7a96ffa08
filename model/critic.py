"""A critic for PPO: a MiniMind language model's body with a scalar value head in place of its output (MiniMind's CriticModel)."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .model import MiniMindLM


class Critic(nn.Module):
    """values(tokens) (B, T): value_head(norm(h)) at every position, h the body's last hidden state.
    The body is a MiniMindLM (its output head unused, as MiniMind's CriticModel keeps lm_head);
    `from_policy` copies a policy's weights into it, as MiniMind initializes its critic."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.body = MiniMindLM(cfg)
        self.value_head = nn.Linear(cfg.dim, 1)

    @classmethod
    def from_policy(cls, policy: MiniMindLM) -> "Critic":
        critic = cls(policy.cfg)
        critic.body.load_state_dict(policy.state_dict())
        return critic

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b = self.body
        t = tokens.shape[1]
        cos, sin = b.rope_cos[:t], b.rope_sin[:t]
        h = b.dropout(b.tok_embeddings(tokens))
        for layer in b.layers:
            h = layer(h, cos, sin, None, None)
        return self.value_head(b.norm(h)).squeeze(-1)
