"""Batch-invariant decoding: the next position of several sequences in one forward, each row's bits
the ones it gets alone, whoever shares the batch.

A matmul of M rows may take another kernel (another blocking, another order of the sums) than one of
M' rows: under MKL's default branch, a row's result changes with the number of rows beside it
(tests/test_serve.py measures it: `MKL_CBWR=AUTO`, 2 to 8 rows). So every linear layer here sees
exactly ROW_BLOCK rows: the batch's rows padded with zeros to a multiple of ROW_BLOCK and multiplied
one block at a time. A row's result then depends on nothing but itself (measured: equal bits at every
batch size, row position and thread count). The rest of a step is row-wise already (embedding,
RMSNorm, the elementwise SwiGLU, and rotary: each row times its own position's cos and sin, all rows
in one elementwise op), and attention runs per sequence over its own KV cache, the
very ops a lone sequence runs; an MoE block's experts run per sequence (their row counts are the
router's). A lone sequence decodes through the same function (a batch of one), so `generate`,
`chat` and every reply of `serve` are the same bits however many are generated together.

        rows:   [a]                [a, b, c]
        padded: [a, 0, 0, 0, 0, 0, 0, 0]   [a, b, c, 0, 0, 0, 0, 0]   -> x @ W.T, 8 rows each time
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import KVCache, MiniMindLM, MoE, apply_rope

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


@torch.inference_mode()
def decode(model: MiniMindLM, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
    """The logits (R, vocab) after each sequence's last id `tokens[r]`, whose keys and values are
    appended to `caches[r]` (one sequence's cache each, at its own length)."""
    r, device = len(tokens), model.tok_embeddings.weight.device
    h = model.tok_embeddings(torch.tensor(tokens, dtype=torch.long, device=device))  # (R, dim)
    at = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)  # each sequence's next position
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
        ys, rep = [], a.n_heads // a.n_kv_heads
        for s, (qs, ks, vs) in enumerate(zip(q.split(1), k.split(1), v.split(1))):  # each sequence over its own cache, as alone
            ks, vs = caches[s].layers[i].append(ks, vs)
            if rep > 1:
                ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
            ys.append(F.scaled_dot_product_attention(qs, ks, vs))  # (1, H, 1, D)
        h = h + blocked(a.wo, torch.cat(ys).transpose(1, 2).reshape(r, a.n_heads * a.head_dim))
        x = layer.ffn_norm(h)
        ff = layer.feed_forward
        if isinstance(ff, MoE):
            h = h + torch.cat([ff(x[s:s + 1].view(1, 1, -1)).view(1, -1) for s in range(r)])
        else:
            h = h + blocked(ff.w2, F.silu(blocked(ff.w1, x)) * blocked(ff.w3, x))
    return blocked(model.output, model.norm(h))
