"""MiniMind's causal language models (docs/models.md).

Pre-norm blocks of RMSNorm -> grouped-query attention with rotary embeddings -> RMSNorm -> SwiGLU,
token embedding tied to the output head: MiniMind2's shape (Llama's). With `qk_norm` each query and
key head is RMSNorm-ed before the rotary embedding, and `head_dim` may differ from dim / n_heads:
MiniMind-3's shape (Qwen3's). With `moe.experts` > 0 each feed-forward is a mixture of experts
(MiniMind-3's MoE, Qwen3-MoE's shape): a softmax router, the top-k experts per token (their
probabilities renormalized with `norm_topk_prob`), and in training MiniMind's load-balancing loss.
Attention runs through `scaled_dot_product_attention(is_causal=True)`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under autocast, as MiniMind does.
        xf = x.float()
        if xf.is_cuda and not torch.compiler.is_compiling():
            # The same formula in torch's fused kernel, one pass each way instead of seven (eager CUDA only: on
            # the CPU the composite keeps every recorded bit, and Inductor fuses the composite itself).
            return self.weight * F.rms_norm(xf, (xf.shape[-1],), eps=self.eps).type_as(x)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def rope_tables(head_dim: int, seq_len: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) for the rotate-half formulation; `scaling`
    (model.rope_scaling's YaRN) stretches them with MiniMind-3's formulas (precompute_freqs_cis),
    whatever seq_len (MiniMind applies them when its table, max_position_embeddings, is longer than
    the original context, as it is at its 32768; transformers' Qwen3 always)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling:
        orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        inv_dim = lambda b: (head_dim * math.log(orig / (b * 2 * math.pi))) / (2 * math.log(theta))  # noqa: E731
        low, high = max(math.floor(inv_dim(scaling["beta_fast"])), 0), min(math.ceil(inv_dim(scaling["beta_slow"])), head_dim // 2 - 1)
        ramp = torch.clamp((torch.arange(head_dim // 2).float() - low) / max(high - low, 0.001), 0, 1)
        inv = inv * (1 - ramp + ramp / factor)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    if scaling:
        return emb.cos() * scaling["attention_factor"], emb.sin() * scaling["attention_factor"]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:  # per head, over head_dim, before the rotary embedding (MiniMind-3, Qwen3)
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps), RMSNorm(self.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # generation: keys and values of the earlier positions come from the cache
            start = cache.length
            k, v = cache.append(k, v)
            if t > 1 and start > 0:  # several new positions after cached ones: each sees the cache and its past
                mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(diagonal=start)
        if self.n_kv_heads != self.n_heads:
            # Repeat rather than SDPA's enable_gqa: the arithmetic every recorded sha256 and test was made with.
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None and q.shape[2] == k.shape[2] and q.shape[2] > 1,
        )
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or cfg.ffn_dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)  # down
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class MoE(nn.Module):
    """A mixture of SwiGLU experts: a linear router over `experts`, softmax in fp32, the top-k per
    token (renormalized with norm_topk_prob), each expert applied to its tokens and its output,
    weighted, added in expert order (as MiniMind and transformers' Qwen3-MoE compute it).

    Every expert runs on its tokens, however few: with none it runs on an empty batch, so that its
    parameters get a gradient of exact zeros like any other (DDP's buckets and the canonical sum
    need every gradient; MiniMind adds `0 * sum(p)` for the same reason). In training it leaves
    MiniMind's load-balancing loss `(load_e * mean_score_e).sum() * experts * coef` in `aux_loss`
    and each expert's share of the token slots in `load`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.experts_n, self.top_k, self.norm_topk_prob, self.coef = cfg.moe.experts, cfg.moe.top_k, cfg.moe.norm_topk_prob, cfg.moe.aux_loss_coef
        self.gate = nn.Linear(cfg.dim, cfg.moe.experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(cfg, cfg.expert_dim) for _ in range(cfg.moe.experts))
        self.aux_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        scores = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)  # sorted: transformers' order of the k
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        picked = F.one_hot(chosen, self.experts_n)  # (N, k, E)
        out = self._dispatch(flat, picked, weights.to(flat.dtype))
        if self.training:
            load = picked.float().mean(0)  # (k, E): MiniMind's load
            self.aux_loss = (load * scores.mean(0)).sum() * self.experts_n * self.coef
            self.load = picked.float().sum((0, 1)) / picked.shape[0] / self.top_k  # each expert's share of the token slots
        return out.view(b, t, d)

    def _dispatch(self, flat: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert on the tokens routed to it (every expert runs, on no token if none chose it),
        its output scaled by their weights and added at their rows. Its shapes are the router's
        choice: under train.compile it runs eagerly (runtime/speed.py wraps it in torch.compiler.disable)."""
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(picked[:, :, e].T.bool())  # in (slot, token) order, transformers' order
            out.index_add_(0, token, (expert(flat[token]) * weights[token, slot, None]).to(out.dtype))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.moe.experts else FeedForward(cfg)
        self.checkpointed = False
        """Recompute this block's activations in the backward instead of keeping them (runtime/speed.py)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, x, cos, sin, cache, mask, use_reentrant=False)
        return self._forward(x, cos, sin, cache, mask)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None,
                 mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class LayerCache:
    """One layer's keys and values of the positions generated so far, in tensors allocated once (B, KV heads,
    positions, head_dim): its own, or a slot of a pool's (model/decode.py's KVPool)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v, self.length = k, v, 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for generation, up to `max_len` positions (at most model.seq_len)."""

    def __init__(self, model: "MiniMindLM", batch: int = 1, max_len: int | None = None) -> None:
        cfg, p = model.cfg, model.tok_embeddings.weight
        shape = (batch, cfg.n_kv_heads, max_len or cfg.seq_len, cfg.head_size)
        self.layers = [LayerCache(torch.empty(shape, dtype=p.dtype, device=p.device), torch.empty(shape, dtype=p.dtype, device=p.device))
                       for _ in range(cfg.n_layers)]
        self.pool, self.slot = None, None  # a KVPool's slot (model/decode.py) or a cache of its own

    @property
    def length(self) -> int:
        return self.layers[0].length


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Cross-entropy in fp32 over the targets that are not IGNORE_INDEX (their mean, or their sum)."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction)


class MiniMindLM(nn.Module):
    """Causal LM; `forward(tokens, targets)` returns (logits, mean cross-entropy or None)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Tied embeddings, as MiniMind: one tensor under two state_dict keys.
        self.output.weight = self.tok_embeddings.weight
        self.loss_fn = lm_loss  # compiled by train.compile (runtime/speed.py)
        cos, sin = rope_tables(cfg.head_size, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling.act())
        # Derived from the config, so not part of the state_dict (and not of model_sha256).
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init for the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith("wo.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Unique parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def moe_layers(self) -> list[MoE]:
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoE)]

    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward in training (summed over the MoE blocks), or
        None for a dense model: the objective adds it to the step's loss (objectives/next_token.py)."""
        layers = self.moe_layers()
        return sum(layer.aux_loss for layer in layers) if layers else None

    def expert_load(self) -> torch.Tensor | None:
        """Each expert's share of the token slots in the last forward in training, averaged over the blocks."""
        layers = self.moe_layers()
        return torch.stack([layer.load for layer in layers]).mean(0) if layers else None

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
        positions: torch.Tensor | None = None, reduction: str = "mean",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (and the loss when `targets` are given: the mean over the targets that are not
        -100, or their sum with reduction="sum"). With a `cache` (generation), `tokens` continue the
        positions already in it, and their keys and values are appended to it. With `positions`
        (B, T) - packed conversations, each restarting at 0 - the rotary phases follow them and a
        position attends only to earlier positions of its own conversation (a block-diagonal causal
        mask: docs/sft.md)."""
        t = tokens.shape[1]
        start = cache.length if cache is not None else 0
        if start + t > self.cfg.seq_len:
            raise ValueError(f"positions {start}..{start + t - 1} are past the {self.cfg.seq_len} positions the rotary "
                             f"tables cover (model.seq_len={self.cfg.seq_len})")
        mask = None
        if positions is not None:
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)  # (B, 1, T, D)
            seg = (positions == 0).cumsum(-1)
            causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
            mask = ((seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal).unsqueeze(1)  # (B, 1, T, T)
        else:
            cos, sin = self.rope_cos[start:start + t], self.rope_sin[start:start + t]
        h = self.dropout(self.tok_embeddings(tokens))
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.layers[i] if cache is not None else None, mask)
        logits = self.output(self.norm(h))
        loss = self.loss_fn(logits, targets, reduction) if targets is not None else None
        return logits, loss
