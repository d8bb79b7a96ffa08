"""Batch-invariant decoding: the next position of several sequences in one forward, each row's bits
the ones it gets alone, whoever shares the batch.

A matmul of M rows may take another kernel (another blocking, another order of the sums) than one of
M' rows: under MKL's default branch, a row's result changes with the number of rows beside it
(tests/test_serve.py measures it: `MKL_CBWR=AUTO`, 2 to 8 rows). So every linear layer here sees
exactly ROW_BLOCK rows: the batch's rows padded with zeros to a multiple of ROW_BLOCK and multiplied
one block at a time. A row's result then depends on nothing but itself (measured: equal bits at every
batch size and row position on a given thread count; across thread counts a wide layer may split its
sums otherwise). The rest of a step is row-wise already (embedding,
RMSNorm, the elementwise SwiGLU, and rotary: each row times its own position's cos and sin, all rows
in one elementwise op). Every sequence's keys and values sit in a slot of a KVPool, where one op per
layer appends the batch's new positions; attention then runs per sequence over its own slot's
positions so far, the very op a lone sequence runs (the batch's query heads of one KV head as rows of
one query, the pairing the prefill's repeat_interleave makes); an MoE block's experts run per sequence
(their row counts are the router's). A lone sequence decodes through the same function (a pool of
one), so `generate`, `chat` and every reply of `serve` are the same bits however many are generated
together.

        rows:   [a]                [a, b, c]
        padded: [a, 0, 0, 0, 0, 0, 0, 0]   [a, b, c, 0, 0, 0, 0, 0]   -> x @ W.T, 8 rows each time
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import KVCache, LayerCache, MiniMindLM, MoE, apply_rope

ROW_BLOCK = 8
"""The rows every linear layer of a decode step multiplies at once (a batch is padded to a multiple)."""


def blocked(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module` (a linear layer, LoRA's included) on the rows of `x` (R, d), ROW_BLOCK rows at a time."""
    r = x.shape[0]
    pad = -r % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == ROW_BLOCK:  # one block: no pieces to join
        return module(x)[:r]
    return torch.cat([module(x[i:i + ROW_BLOCK]) for i in range(0, x.shape[0], ROW_BLOCK)])[:r]


class KVPool:
    """The keys and values of up to `slots` sequences decoded together: per layer one tensor (slots, KV heads,
    `positions` (default model.seq_len), head_dim), a sequence's KVCache a view of its slot (take; release frees it), so a step
    appends every sequence's new key and value in one op per layer."""

    def __init__(self, model: MiniMindLM, slots: int = 1, positions: int | None = None) -> None:
        cfg, p = model.cfg, model.tok_embeddings.weight
        shape = (slots, cfg.n_kv_heads, positions or cfg.seq_len, cfg.head_size)  # a lone sequence's: just its own length
        self.k = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layers)]
        self.v = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layers)]
        self.free = list(range(slots - 1, -1, -1))

    def take(self) -> KVCache:
        """A sequence's cache in a free slot."""
        if not self.free:
            raise RuntimeError(f"all {self.k[0].shape[0]} slots of the KV pool are in use")
        cache = KVCache.__new__(KVCache)
        cache.pool, cache.slot = self, self.free.pop()
        cache.layers = [LayerCache(k[cache.slot:cache.slot + 1], v[cache.slot:cache.slot + 1]) for k, v in zip(self.k, self.v)]
        return cache

    def release(self, cache: KVCache) -> None:
        """Free `cache`'s slot for the next sequence."""
        if cache.pool is self:
            self.free.append(cache.slot)
            cache.pool = cache.slot = None


@torch.inference_mode()
def decode(model: MiniMindLM, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
    """The logits (R, vocab) after each sequence's last id `tokens[r]`, whose keys and values are
    appended to `caches[r]` (slots of one KVPool, each sequence at its own length)."""
    pool = caches[0].pool
    if pool is None or any(c.pool is not pool for c in caches):
        raise ValueError("decode: the caches must be slots of one KVPool")
    r, device = len(tokens), model.tok_embeddings.weight.device
    slots, ends = [c.slot for c in caches], [c.length + 1 for c in caches]
    at = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)  # each sequence's next position
    where = torch.tensor(slots, dtype=torch.long, device=device)
    h = model.tok_embeddings(torch.tensor(tokens, dtype=torch.long, device=device))  # (R, dim)
    cos, sin = model.rope_cos[at][:, None, None], model.rope_sin[at][:, None, None]  # (R, 1, 1, D): elementwise, row by row
    for i, layer in enumerate(model.layers):
        a = layer.attention
        x = layer.attention_norm(h)
        q = blocked(a.wq, x).view(r, 1, a.n_heads, a.head_dim).transpose(1, 2)  # (R, H, 1, D)
        k = blocked(a.wk, x).view(r, 1, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = blocked(a.wv, x).view(r, 1, a.n_kv_heads, a.head_dim).transpose(1, 2)
        if a.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = pool.k[i], pool.v[i]
        keys[where, :, at], values[where, :, at] = k[:, :, 0], v[:, :, 0]  # every sequence's new position, one op
        # Each sequence over its own keys, as alone; grouped heads as the prefill's repeat_interleave pairs
        # them (query head j reads KV head j // rep): the rep queries of a KV head as rep rows of one query.
        q = q.reshape(r, a.n_kv_heads, a.n_heads // a.n_kv_heads, a.head_dim).split(1)
        y = torch.cat([F.scaled_dot_product_attention(q[s], keys[slot:slot + 1, :, :n], values[slot:slot + 1, :, :n])
                       for s, (slot, n) in enumerate(zip(slots, ends))])
        h = h + blocked(a.wo, y.reshape(r, a.n_heads * a.head_dim))
        x = layer.ffn_norm(h)
        ff = layer.feed_forward
        if isinstance(ff, MoE):
            h = h + torch.cat([ff(x[s:s + 1].view(1, 1, -1)).view(1, -1) for s in range(r)])
        else:
            h = h + blocked(ff.w2, F.silu(blocked(ff.w1, x)) * blocked(ff.w3, x))
    for c in caches:
        for layer in c.layers:
            layer.length += 1
    return blocked(model.output, model.norm(h))
