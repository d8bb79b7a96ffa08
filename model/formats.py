"""Our weights under other projects' names: MiniMind's state dicts and Hugging Face's Llama, Qwen3
and Qwen3-MoE (docs/weights.md, docs/models.md).

MiniMind2's and MiniMind-3's `MiniMindForCausalLM` and transformers' `LlamaForCausalLM`,
`Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` use the same key names (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, `...self_attn.q_norm`, `...mlp.gate_proj`, for an MoE
`...mlp.gate` and `...mlp.experts.E.gate_proj`, `model.norm`, `lm_head`), the same rotate-half RoPE,
RMSNorm in fp32, SwiGLU and GQA head grouping as our model, so the conversion is a renaming: no
tensor is permuted or changed. Two exceptions, both read here: transformers 5.x saves an MoE's
experts fused (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]), split
into our experts on the way in; and our output head is tied to the embedding: MiniMind's state dict
lists both keys (one tensor), a Hugging Face folder only the embedding (`tie_word_embeddings`).
"""
from __future__ import annotations

import math

import re

import torch

from common.outcome import BadInput

from .config import ModelConfig

# ours (per layer, after "layers.N.") -> Llama / Qwen3 / MiniMind (after "model.layers.N.")
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.gate.weight": "mlp.gate.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_OURS_EXPERT = re.compile(r"^feed_forward\.experts\.(\d+)\.(w[123])\.weight$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_BACK_LAYER = {v: k for k, v in _LAYER.items()}
_BACK_EXPERT = {v: k for k, v in _EXPERT.items()}
_BACK_TOP = {v: k for k, v in _TOP.items()}


class WeightsError(BadInput, ValueError):
    """Weights that do not fit the model; the message lists every missing, unexpected and misshapen key."""


def _ours_to_hf(rest: str) -> str:
    if m := _OURS_EXPERT.match(rest):
        return f"mlp.experts.{m.group(1)}.{_EXPERT[m.group(2)]}.weight"
    return _LAYER.get(rest, rest)


def to_llama(state: dict[str, torch.Tensor], lm_head: bool = True) -> dict[str, torch.Tensor]:
    """Our state dict under MiniMind's / Hugging Face's names, an MoE's experts one by one (the layout
    transformers 4.x reads and 5.x converts on load); `lm_head.weight` left out when not `lm_head`."""
    out = {}
    for key, t in state.items():
        if m := _OURS_LAYER.match(key):
            out[f"model.layers.{m.group(1)}.{_ours_to_hf(m.group(2))}"] = t
        elif key == "output.weight" and not lm_head:
            continue
        else:
            out[_TOP[key]] = t
    return out


def from_llama(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MiniMind / Hugging Face state dict under our names; keys it does not know keep their names
    (so that the check against the model reports them as unexpected). transformers 5.x's fused
    experts are split into ours (a shape that does not split is reported by the check). A missing
    `lm_head.weight` is the tied embedding."""
    out = {}
    for key, t in state.items():
        if (m := _HF_FUSED.match(key)) and t.dim() == 3:
            layer = m.group(1)
            if m.group(2) == "gate_up_proj":
                if t.shape[1] % 2:
                    out[key] = t  # does not split in two: reported, with its shape, as unexpected
                    continue
                gate, up = t.chunk(2, dim=1)
                for e in range(t.shape[0]):
                    out[f"layers.{layer}.feed_forward.experts.{e}.w1.weight"] = gate[e]
                    out[f"layers.{layer}.feed_forward.experts.{e}.w3.weight"] = up[e]
            else:
                for e in range(t.shape[0]):
                    out[f"layers.{layer}.feed_forward.experts.{e}.w2.weight"] = t[e]
        elif m := _HF_LAYER.match(key):
            rest = m.group(2)
            if e := _HF_EXPERT.match(rest):
                out[f"layers.{m.group(1)}.feed_forward.experts.{e.group(1)}.{_BACK_EXPERT[e.group(2)]}.weight"] = t
            elif rest in _BACK_LAYER:
                out[f"layers.{m.group(1)}.{_BACK_LAYER[rest]}"] = t
            else:
                out[key] = t
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
        hint = ""
        if any(".q_norm." in k or ".k_norm." in k for k in [*missing, *unexpected]):
            hint = " (q/k norms on one side only: MiniMind-3 / Qwen3 weights have them, MiniMind2 / Llama's do not: model.qk_norm)"
        elif any(".experts." in k or ".mlp.gate." in k for k in [*missing, *unexpected]):
            hint = " (experts on one side only, or another count: model.moe.experts)"
        raise WeightsError(f"{source}: does not fit the model ({'; '.join(parts)}){hint}")
    if "output.weight" in state and "tok_embeddings.weight" in state and state["output.weight"] is not state["tok_embeddings.weight"] \
            and not torch.equal(state["output.weight"], state["tok_embeddings.weight"]):
        raise WeightsError(f"{source}: the output head differs from the token embedding, but this model ties them")


def llama_name(key: str) -> str:
    """MiniMind's / Hugging Face's name of one of our keys."""
    if m := _OURS_LAYER.match(key):
        return f"model.layers.{m.group(1)}.{_ours_to_hf(m.group(2))}"
    return _TOP.get(key, key)


def architecture(cfg: ModelConfig) -> tuple[str, str]:
    """(model_type, architecture) of the transformers class that computes what `cfg` does."""
    if cfg.moe.experts:
        if not cfg.qk_norm:
            raise WeightsError("model.moe.experts without model.qk_norm: no transformers architecture computes this model "
                               "(Qwen3-MoE has q/k norms); export it with --format minimind")
        return "qwen3_moe", "Qwen3MoeForCausalLM"
    return ("qwen3", "Qwen3ForCausalLM") if cfg.qk_norm else ("llama", "LlamaForCausalLM")


def hf_differences(hf: dict, cfg: ModelConfig) -> list[str]:
    """Every architectural field of a Hugging Face `config.json` (Llama, Qwen3, Qwen3-MoE) that
    describes another model than `cfg`, as "field X there, model.Y=Z here" (empty: the same
    computation). Absent fields take transformers' defaults, as transformers would read them.
    `max_position_embeddings` must cover model.seq_len (a longer context in the source changes
    nothing at the positions used)."""
    heads, hidden, model_type = hf.get("num_attention_heads"), hf.get("hidden_size"), hf.get("model_type", "llama")
    rope = hf.get("rope_parameters") or {}
    diffs = []
    families = {"llama": (False, False), "qwen3": (True, False), "qwen3_moe": (True, True)}
    if model_type not in families:
        return [f"model_type {model_type!r} there, one of {', '.join(families)} here (MiniMind2 is Llama-shaped, MiniMind-3 Qwen3-shaped)"]
    qk, moe = families[model_type]
    if qk != cfg.qk_norm:
        diffs.append(f"model_type {model_type!r} there ({'with' if qk else 'without'} q/k norms), model.qk_norm={cfg.qk_norm} here")
    if moe != bool(cfg.moe.experts):
        diffs.append(f"model_type {model_type!r} there ({'an MoE' if moe else 'dense'}), model.moe.experts={cfg.moe.experts} here")
    theirs = {
        "hidden_size": (hidden, "dim", cfg.dim),
        "num_hidden_layers": (hf.get("num_hidden_layers"), "n_layers", cfg.n_layers),
        "num_attention_heads": (heads, "n_heads", cfg.n_heads),
        "num_key_value_heads": (hf.get("num_key_value_heads", heads), "n_kv_heads", cfg.n_kv_heads),
        "head_dim": (hf.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None),
                     "head_dim" if cfg.head_dim else "dim / model.n_heads", cfg.head_size),
        "vocab_size": (hf.get("vocab_size"), "vocab_size", cfg.vocab_size),
        "rope_theta": (rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta", cfg.rope_theta),
        "rms_norm_eps": (hf.get("rms_norm_eps", 1e-6), "norm_eps", cfg.norm_eps),
    }
    if moe and cfg.moe.experts:
        theirs.update({
            "num_experts": (hf.get("num_experts"), "moe.experts", cfg.moe.experts),
            "num_experts_per_tok": (hf.get("num_experts_per_tok"), "moe.top_k", cfg.moe.top_k),
            "moe_intermediate_size": (hf.get("moe_intermediate_size"), "moe.hidden_dim (derived)", cfg.expert_dim),
        })
        if bool(hf.get("norm_topk_prob", False)) != cfg.moe.norm_topk_prob:
            diffs.append(f"norm_topk_prob {hf.get('norm_topk_prob', False)!r} there, model.moe.norm_topk_prob={cfg.moe.norm_topk_prob} here")
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            diffs.append(f"decoder_sparse_step {hf.get('decoder_sparse_step', 1)!r} and mlp_only_layers {hf.get('mlp_only_layers')!r} "
                         f"there: every block an MoE here")
    else:
        theirs["intermediate_size"] = (hf.get("intermediate_size"), "hidden_dim (derived)", cfg.ffn_dim)
    for field, (value, key, ours) in theirs.items():
        same = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == float(ours)
        if not same:
            diffs.append(f"{field} {value!r} there, model.{key}={ours} here")
    positions = hf.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < cfg.seq_len:
        diffs.append(f"max_position_embeddings {positions!r} there, fewer than model.seq_len={cfg.seq_len} here")
    scaling, ours = hf_rope_scaling(hf), cfg.rope_scaling.act()
    if scaling != ours and not (scaling and ours and scaling.get("type") == "yarn" and all(float(scaling[k]) == float(ours[k]) for k in _YARN)):
        raw = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        diffs.append(f"rope scaling {raw!r} there, model.rope_scaling={ours or 'none'} here (YaRN is implemented, with every "
                     f"parameter given: factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor)")
    if hf.get("tie_word_embeddings", False) is not True:
        diffs.append(f"tie_word_embeddings {hf.get('tie_word_embeddings', False)!r} there (transformers' default when absent: false), "
                     "tied here (this model's output head is its embedding)")
    if hf.get("hidden_act", "silu") != "silu":
        diffs.append(f"hidden_act {hf.get('hidden_act')!r} there, silu (SwiGLU) here")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            diffs.append(f"{flag} true there, no biases here")
    if hf.get("use_sliding_window", False):
        diffs.append("use_sliding_window true there, full attention here")
    return diffs


_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor")


def hf_rope_scaling(hf: dict) -> dict | None:
    """The rope scaling a Hugging Face `config.json` asks for, as model.rope_scaling (type yarn and
    its five parameters; a missing attention_factor is transformers' 0.1 ln(factor) + 1, missing
    betas 32 and 1), None for plain RoPE, or the raw dict of a type we do not implement."""
    rope = hf.get("rope_parameters") or {}
    raw = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} if rope else None)
    kind = (raw or {}).get("rope_type", (raw or {}).get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn" or not isinstance(raw.get("factor"), (int, float)) or "original_max_position_embeddings" not in raw:
        return dict(raw)
    factor = float(raw["factor"])
    default_attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": int(raw["original_max_position_embeddings"]),
            "beta_fast": float(raw.get("beta_fast") or 32.0), "beta_slow": float(raw.get("beta_slow") or 1.0),
            "attention_factor": float(raw["attention_factor"] if raw.get("attention_factor") is not None else default_attention)}


def hf_model_keys(hf: dict) -> dict:
    """The `model.*` keys of the model a Hugging Face `config.json` (Llama, Qwen3, Qwen3-MoE) describes,
    absent fields at transformers' defaults (the inverse of `hf_config`; `hf_differences` against the
    result lists what it cannot say, e.g. rope scaling). Not seq_len: the reader gives its own."""
    model_type = hf.get("model_type", "llama")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    if model_type not in ("llama", "qwen3", "qwen3_moe") or not all(isinstance(v, int) and v > 0 for v in (heads, hidden)):
        raise WeightsError(f"config.json: model_type {model_type!r} with hidden_size {hidden!r} and num_attention_heads {heads!r}: "
                           f"expected llama, qwen3 or qwen3_moe with positive sizes")
    rope = hf.get("rope_parameters") or {}
    head_dim = hf.get("head_dim") or hidden // heads
    keys = {"dim": hidden, "n_layers": hf.get("num_hidden_layers"), "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads", heads), "head_dim": 0 if head_dim * heads == hidden else head_dim,
            "qk_norm": model_type != "llama", "vocab_size": hf.get("vocab_size"), "hidden_dim": hf.get("intermediate_size"),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    scaling = hf_rope_scaling(hf)
    if scaling and scaling.get("type") == "yarn":
        keys["rope_scaling"] = scaling
    if model_type == "qwen3_moe":
        keys["moe"] = {"experts": hf.get("num_experts"), "top_k": hf.get("num_experts_per_tok"),
                       "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "hidden_dim": hf.get("moe_intermediate_size")}
    return keys


def check_tensors(state: dict[str, torch.Tensor], source: str, names=lambda k: k) -> None:
    """Every tensor floating point and finite; else a WeightsError naming each that is not."""
    bad = [f"{names(k)} ({t.dtype})" for k, t in state.items() if not t.is_floating_point()]
    bad += [f"{names(k)} (holds NaN or inf)" for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise WeightsError(f"{source}: tensors that cannot be weights of this model: {', '.join(bad)}")


def hf_yarn(cfg: ModelConfig) -> dict:
    """model.rope_scaling as transformers 5.x (`rope_parameters`) and 4.x (`rope_scaling`) read it ({}: plain RoPE)."""
    scaling = cfg.rope_scaling.act()
    if not scaling:
        return {}
    params = {"rope_type": "yarn", **{k: scaling[k] for k in _YARN}, "truncate": True}
    return {"rope_scaling": params, "rope_parameters": {**params, "rope_theta": cfg.rope_theta}}


def hf_config(cfg: ModelConfig, bos: int, eos: int, pad: int) -> dict:
    """`config.json` of the transformers model equal to ours (Llama, Qwen3 or Qwen3-MoE), read alike
    by transformers 5.x (`rope_parameters`) and 4.x (`rope_theta`, `rope_scaling`)."""
    model_type, arch = architecture(cfg)
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **hf_yarn(cfg),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if model_type == "llama":
        out["mlp_bias"] = False
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                   layer_types=["full_attention"] * cfg.n_layers)
    if model_type == "qwen3_moe":
        out.update(num_experts=cfg.moe.experts, num_experts_per_tok=cfg.moe.top_k, moe_intermediate_size=cfg.expert_dim,
                   norm_topk_prob=cfg.moe.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=cfg.moe.aux_loss_coef, output_router_logits=False)
    return out
