"""The model's configuration: the `model.*` keys of a run's YAML."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Shape of the MiniMind-style causal LM.

    The defaults are the CPU `tiny` model (about 1M parameters); MiniMind2-small is
    dim 512, n_layers 8, n_heads 8, n_kv_heads 2.
    """

    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 5
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; dim must divide by it."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); n_heads must divide by it."""
    vocab_size: int = 259
    """Token ids the embedding holds: the tokenizer's (set from data.tokenizer; the byte tokenizer has 259)."""
    seq_len: int = 128
    """Tokens per sample (the packed data is cut into seq_len + 1 tokens)."""
    hidden_dim: int = 0
    """SwiGLU hidden width; 0 derives MiniMind's 8/3 * dim rounded up to multiple_of."""
    multiple_of: int = 64
    """Rounding of the derived hidden width."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 1e6
    """Rotary embedding base (MiniMind2 uses 1e6)."""
    dropout: float = 0.0
    """Dropout on attention weights, attention output and MLP output."""
    init_from: str = ""
    """Start a new run from these weights (fresh optimizer, LR schedule and data position): one of our checkpoint
    or run folders, our fp16 weights file, a MiniMind2 state dict (.pth) or a Hugging Face Llama folder. Keys and
    shapes must match model.*. A resume never reads it again ('' : the seeded random init)."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len", "multiple_of"):
            need(getattr(self, key) > 0, f"model.{key} must be a positive integer, got {getattr(self, key)}")
        need(self.dim % self.n_heads == 0, f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        need((self.dim // self.n_heads) % 2 == 0, f"model.dim / model.n_heads ({self.dim // self.n_heads}) must be even for rotary embeddings")
        need(self.n_heads % self.n_kv_heads == 0, f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        need(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        need(self.hidden_dim >= 0, f"model.hidden_dim must be >= 0 (0 = derived), got {self.hidden_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.hidden_dim:
            return self.hidden_dim
        h = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)
