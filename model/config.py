"""The model's configuration: the `model.*` keys of a run's YAML (docs/models.md)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass
class MoEConfig:
    """A mixture of experts in place of each block's feed-forward (MiniMind-3's MoE, Qwen3-MoE's shape)."""

    experts: int = 0
    """Experts per block (0: a dense feed-forward, MiniMind2's and MiniMind-3's dense model)."""
    top_k: int = 1
    """Experts each token goes through (MiniMind: num_experts_per_tok)."""
    norm_topk_prob: bool = True
    """Renormalize the chosen experts' router probabilities to sum to 1."""
    hidden_dim: int = 0
    """Each expert's SwiGLU width (0: the dense feed-forward's, as MiniMind's moe_intermediate_size defaults)."""
    aux_loss_coef: float = 5e-4
    """Weight of MiniMind's load-balancing loss, sum_e(load_e * mean_score_e) * experts * coef, added in training."""

    def __post_init__(self) -> None:
        _need(self.experts >= 0, f"model.moe.experts must be >= 0 (0: dense), got {self.experts}")
        if self.experts:
            _need(1 <= self.top_k <= self.experts,
                  f"model.moe.top_k must be between 1 and model.moe.experts={self.experts}, got {self.top_k}")
        for f in dataclasses.fields(self):  # a dense model has no experts to route to: an experts' key set alone would be ignored
            _need(self.experts or f.name == "experts" or getattr(self, f.name) == f.default,
                  f"model.moe.{f.name}={getattr(self, f.name)!r} needs model.moe.experts > 0 (0, the default, is a dense "
                  f"feed-forward: no experts for it to act on)")
        _need(self.hidden_dim >= 0, f"model.moe.hidden_dim must be >= 0 (0: model.hidden_dim), got {self.hidden_dim}")
        _need(self.aux_loss_coef >= 0, f"model.moe.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


@dataclass
class RopeScaling:
    """Rotary embeddings stretched to a longer context (MiniMind-3's `inference_rope_scaling`, Qwen3's
    `rope_scaling`): YaRN scales each frequency by (1 - r) + r / factor, r a ramp from 0 at the
    dimensions that turn more than beta_fast times in the original context to 1 at those that turn
    fewer than beta_slow times, and multiplies cos and sin by attention_factor (docs/models.md)."""

    type: str = "none"
    """none (plain RoPE) | yarn."""
    factor: float = 1.0
    """How much longer the context is than original_max_position_embeddings (MiniMind: 16)."""
    original_max_position_embeddings: int = 2048
    """The context the model was trained at before the extension."""
    beta_fast: float = 32.0
    """Dimensions turning more than this many times in the original context keep their frequency."""
    beta_slow: float = 1.0
    """Dimensions turning fewer than this many times are divided by factor."""
    attention_factor: float = 1.0
    """cos and sin multiplied by it (MiniMind: 1.0; the YaRN paper: 0.1 ln(factor) + 1)."""

    def __post_init__(self) -> None:
        _need(self.type in ("none", "yarn"), f"model.rope_scaling.type: expected none or yarn (MiniMind-3's and Qwen3's "
                                             f"YaRN), got {self.type!r}")
        _need(self.factor >= 1, f"model.rope_scaling.factor: expected a number >= 1 (how much longer the context is), got {self.factor}")
        _need(self.type != "yarn" or self.factor > 1, "model.rope_scaling.factor: type yarn needs a factor > 1 (how much longer the "
                                                       f"context is; at {self.factor} YaRN changes nothing)")
        _need(self.original_max_position_embeddings > 0, f"model.rope_scaling.original_max_position_embeddings: expected a "
                                                         f"positive integer, got {self.original_max_position_embeddings}")
        _need(self.beta_fast > 0 and self.beta_slow > 0 and self.attention_factor > 0,
              f"model.rope_scaling: beta_fast ({self.beta_fast}), beta_slow ({self.beta_slow}) and attention_factor "
              f"({self.attention_factor}) must be positive")

    def act(self) -> dict | None:
        """What changes the function: the YaRN parameters, or None for plain RoPE."""
        return None if self.type == "none" else dataclasses.asdict(self)


@dataclass
class ModelConfig:
    """Shape of the MiniMind-style causal LM: MiniMind2's (Llama-shaped) by default; MiniMind-3's
    (Qwen3-shaped) with `qk_norm`, and its MoE with `moe.experts` > 0.

    The defaults are the CPU `tiny` model (about 1M parameters); MiniMind2-small is
    dim 512, n_layers 8, n_heads 8, n_kv_heads 2.
    """

    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 5
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); n_heads must divide by it."""
    head_dim: int = 0
    """Width of each head (0: dim / n_heads, which dim must then divide into)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotary embedding (MiniMind-3, Qwen3)."""
    vocab_size: int = 259
    """Token ids the embedding holds: the tokenizer's (set from data.tokenizer; the byte tokenizer has 259)."""
    seq_len: int = 128
    """Tokens per sample (the packed data is cut into seq_len + 1 tokens)."""
    hidden_dim: int = 0
    """SwiGLU hidden width; 0 derives MiniMind2's 8/3 * dim rounded up to multiple_of (MiniMind-3 uses
    ceil(dim * pi / 64) * 64: give it here)."""
    multiple_of: int = 64
    """Rounding of the derived hidden width."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (MiniMind2 1e-5, MiniMind-3 1e-6)."""
    rope_theta: float = 1e6
    """Rotary embedding base (MiniMind2 and MiniMind-3 use 1e6)."""
    dropout: float = 0.0
    """Dropout on attention weights, attention output and MLP output."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    init_from: str = ""
    """Start a new run from these weights (fresh optimizer, LR schedule and data position): one of our checkpoint
    or run folders, our fp16 weights file, a MiniMind state dict (.pth: MiniMind2's or MiniMind-3's) or a Hugging
    Face folder (Llama, Qwen3, Qwen3-MoE). Keys and shapes must match model.*. A resume never reads it again
    ('' : the seeded random init)."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # a config read back from a manifest
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len", "multiple_of"):
            _need(getattr(self, key) > 0, f"model.{key} must be a positive integer, got {getattr(self, key)}")
        _need(self.head_dim >= 0, f"model.head_dim must be >= 0 (0: dim / n_heads), got {self.head_dim}")
        if not self.head_dim:
            _need(self.dim % self.n_heads == 0, f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}), "
                                                f"or give model.head_dim")
        _need(self.head_size % 2 == 0, f"model.head_dim ({self.head_size}) must be even for rotary embeddings")
        _need(self.n_heads % self.n_kv_heads == 0, f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        _need(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        _need(self.hidden_dim >= 0, f"model.hidden_dim must be >= 0 (0 = derived), got {self.hidden_dim}")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The config a manifest (or a config.yaml) records; keys of a later release are refused by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TypeError(f"unknown model keys {unknown}")
        return cls(**d)

    def architecture(self) -> dict:
        """The fields that change the function the weights compute, as they act (the derived head and
        feed-forward widths, not how they were given): part of the model's identity (docs/design.md
        "One model identity"). Not seq_len, dropout, the MoE's aux-loss weight or init_from."""
        moe = self.moe
        return {"dim": self.dim, "n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                "head_size": self.head_size, "qk_norm": self.qk_norm, "vocab_size": self.vocab_size, "ffn_dim": self.ffn_dim,
                "norm_eps": self.norm_eps, "rope_theta": self.rope_theta,
                "moe": {"experts": moe.experts, "top_k": moe.top_k, "norm_topk_prob": moe.norm_topk_prob,
                        "expert_dim": self.expert_dim} if moe.experts else None,
                **({"rope_scaling": self.rope_scaling.act()} if self.rope_scaling.act() else {})}  # absent: plain RoPE, as before the key

    @property
    def head_size(self) -> int:
        """The width of each head: model.head_dim, or dim / n_heads."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.hidden_dim:
            return self.hidden_dim
        h = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    @property
    def expert_dim(self) -> int:
        """Each expert's SwiGLU width (an MoE model's)."""
        return self.moe.hidden_dim or self.ffn_dim
