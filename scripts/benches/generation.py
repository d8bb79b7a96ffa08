"""Generation with the KV cache against recomputing the prefix."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from configs import load_config
from model import MiniMindLM, ModelConfig

from . import section
from .helpers import ROOT


AIMS = {
    "generation, KV cache / recompute": (">=", 1.0),
}


def generation_rows(new_tokens: int = 256) -> list[dict]:
    """Tokens per second generating `new_tokens` greedily after a 4-token prompt, with the KV cache
    against recomputing the whole sequence per token (model/generate.py generate_ids), tiny and 26M
    shapes (random weights, seq_len 512; EOS ignored)."""
    from model.generate import generate_ids

    rows = []
    tiny = load_config(ROOT / "configs" / "tiny.yaml").model
    shapes = {"tiny": ModelConfig(dim=tiny.dim, n_layers=tiny.n_layers, n_heads=tiny.n_heads, n_kv_heads=tiny.n_kv_heads, seq_len=512),
              "26M": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, hidden_dim=1664, qk_norm=True, vocab_size=6400,
                                 seq_len=512)}
    for label, mcfg in shapes.items():
        torch.manual_seed(0)
        model = MiniMindLM(mcfg).eval()
        seconds, tokens = {}, {}
        for cached in (True, False):
            t0 = time.perf_counter()
            tokens[cached] = generate_ids(model, [1, 2, 3, 4], new_tokens, temperature=0.0, eos=None, use_cache=cached)
            seconds[cached] = time.perf_counter() - t0
        same = tokens[True] == tokens[False]
        rows.append({"row": f"generation, {label}, {new_tokens} new tokens, 1 process", "what": "KV cache / recompute (tokens/s)",
                     "value": seconds[False] / seconds[True],
                     "detail": f"{new_tokens / seconds[True]:.0f} tok/s cached / {new_tokens / seconds[False]:.0f} tok/s recomputed; "
                               f"greedy tokens {'identical' if same else 'DIFFER'}", "aim": "generation, KV cache / recompute"})
    return rows


@section("generation", order=140, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return generation_rows(64 if q else 256)
