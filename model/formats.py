"""Our weights under other names: MiniMind2's state dict and Hugging Face's Llama.

MiniMind2's `MiniMindForCausalLM` and transformers' `LlamaForCausalLM` use the same key names
(`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ..., `model.norm`, `lm_head`), the same
rotate-half RoPE, RMSNorm in fp32, SwiGLU and GQA head grouping as our model, so the conversion
is a renaming: no tensor is permuted or changed. Our output head is tied to the embedding;
MiniMind's state dict lists both keys (one tensor), a Hugging Face folder lists only the embedding
(`tie_word_embeddings`).
"""
from __future__ import annotations

import re

import torch

from common.outcome import BadInput

from .config import ModelConfig

# ours (per layer, after "layers.N.") -> Llama / MiniMind (after "model.layers.N.")
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LLAMA_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BACK_LAYER = {v: k for k, v in _LAYER.items()}
_BACK_TOP = {v: k for k, v in _TOP.items()}


class WeightsError(BadInput, ValueError):
    """Weights that do not fit the model; the message lists every missing, unexpected and misshapen key."""


def to_llama(state: dict[str, torch.Tensor], lm_head: bool = True) -> dict[str, torch.Tensor]:
    """Our state dict under MiniMind2's / Llama's names (`lm_head.weight` left out when not `lm_head`)."""
    out = {}
    for key, t in state.items():
        if m := _OURS_LAYER.match(key):
            out[f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"] = t
        elif key == "output.weight" and not lm_head:
            continue
        else:
            out[_TOP[key]] = t
    return out


def from_llama(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MiniMind2 / Llama state dict under our names; keys it does not know keep their names (so
    that the check against the model reports them as unexpected). A missing `lm_head.weight` is the
    tied embedding."""
    out = {}
    for key, t in state.items():
        if (m := _LLAMA_LAYER.match(key)) and m.group(2) in _BACK_LAYER:
            out[f"layers.{m.group(1)}.{_BACK_LAYER[m.group(2)]}"] = t
        else:
            out[_BACK_TOP.get(key, key)] = t
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def is_llama(state: dict) -> bool:
    return any(k.startswith("model.") or k == "lm_head.weight" for k in state)


def check_fits(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str, names=lambda k: k) -> None:
    """Every key of `expected` present in `state` with its shape, and nothing else; else a
    WeightsError listing each missing key, unexpected key and shape that differs (in `names`' spelling)."""
    missing = [names(k) for k in expected if k not in state]
    unexpected = [names(k) for k in state if k not in expected]
    shapes = [f"{names(k)} is {tuple(state[k].shape)}, the model's is {tuple(v.shape)}"
              for k, v in expected.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or shapes:
        parts = ([f"missing keys: {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected keys: {', '.join(unexpected)}"] if unexpected else []) + \
                ([f"shapes that differ from model.*: {'; '.join(shapes)}"] if shapes else [])
        raise WeightsError(f"{source}: does not fit the model ({'; '.join(parts)})")
    if "output.weight" in state and "tok_embeddings.weight" in state and state["output.weight"] is not state["tok_embeddings.weight"] \
            and not torch.equal(state["output.weight"], state["tok_embeddings.weight"]):
        raise WeightsError(f"{source}: the output head differs from the token embedding, but this model ties them")


def llama_name(key: str) -> str:
    """MiniMind2's / Llama's name of one of our keys."""
    if m := _OURS_LAYER.match(key):
        return f"model.layers.{m.group(1)}.{_LAYER.get(m.group(2), m.group(2))}"
    return _TOP.get(key, key)


def hf_differences(hf: dict, cfg: ModelConfig) -> list[str]:
    """Every architectural field of a Hugging Face Llama `config.json` that describes another model
    than `cfg`, as "field X there, model.Y=Z here" (empty: the same computation). Absent fields take
    transformers' LlamaConfig defaults, as transformers would read them. `max_position_embeddings`
    must cover model.seq_len (a longer context in the source changes nothing at the positions used)."""
    heads = hf.get("num_attention_heads")
    hidden = hf.get("hidden_size")
    rope = hf.get("rope_parameters") or {}
    theirs = {
        "hidden_size": (hidden, "dim", cfg.dim),
        "num_hidden_layers": (hf.get("num_hidden_layers"), "n_layers", cfg.n_layers),
        "num_attention_heads": (heads, "n_heads", cfg.n_heads),
        "num_key_value_heads": (hf.get("num_key_value_heads", heads), "n_kv_heads", cfg.n_kv_heads),
        "head_dim": (hf.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None),
                     "dim / model.n_heads", cfg.head_dim),
        "intermediate_size": (hf.get("intermediate_size"), "hidden_dim (derived)", cfg.ffn_dim),
        "vocab_size": (hf.get("vocab_size"), "vocab_size", cfg.vocab_size),
        "rope_theta": (rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta", cfg.rope_theta),
        "rms_norm_eps": (hf.get("rms_norm_eps", 1e-6), "norm_eps", cfg.norm_eps),
    }
    diffs = []
    for field, (value, key, ours) in theirs.items():
        same = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == float(ours)
        if not same:
            diffs.append(f"{field} {value!r} there, model.{key}={ours} here")
    positions = hf.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < cfg.seq_len:
        diffs.append(f"max_position_embeddings {positions!r} there, fewer than model.seq_len={cfg.seq_len} here")
    scaling = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        diffs.append(f"rope scaling {scaling!r} there, none here (this model's RoPE is unscaled)")
    if hf.get("tie_word_embeddings", False) is not True:
        diffs.append(f"tie_word_embeddings {hf.get('tie_word_embeddings', False)!r} there (transformers' default when absent: false), "
                     "tied here (this model's output head is its embedding)")
    if hf.get("hidden_act", "silu") != "silu":
        diffs.append(f"hidden_act {hf.get('hidden_act')!r} there, silu (SwiGLU) here")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            diffs.append(f"{flag} true there, no biases here")
    return diffs


def check_tensors(state: dict[str, torch.Tensor], source: str, names=lambda k: k) -> None:
    """Every tensor floating point and finite; else a WeightsError naming each that is not."""
    bad = [f"{names(k)} ({t.dtype})" for k, t in state.items() if not t.is_floating_point()]
    bad += [f"{names(k)} (holds NaN or inf)" for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise WeightsError(f"{source}: tensors that cannot be weights of this model: {', '.join(bad)}")


def hf_config(cfg: ModelConfig, bos: int, eos: int, pad: int) -> dict:
    """`config.json` of a Llama model equal to ours, read alike by transformers 5.x (`rope_parameters`)
    and 4.x (`rope_theta`, `rope_scaling`)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "dtype": "float32",
    }

