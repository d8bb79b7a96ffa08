"""Low-rank adapters on the model's linears, as PEFT computes them (docs/lora.md).

A target linear `W` (in -> out) becomes `W x + scale * B(A(dropout(x)))`, A (rank x in) and B
(out x rank), scale = alpha / rank (PEFT's `lora_alpha / r`; alpha 0 means alpha = rank, scale 1,
MiniMind's adapters, which have no scaling). The adapted linear keeps its weight under its own
name, so the base's keys are the model's keys, and adds `lora_A.weight` and `lora_B.weight` beside
it. A is drawn Kaiming-uniform (PEFT's default) from a generator seeded by the run's seed alone, B is
zero, so that the adapted model starts as the base model. Every parameter but the adapters is
frozen: no gradient, no optimizer state, nothing in a checkpoint but the hash of the base.

Targets are named as transformers names the linears (q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj), or `minimind`: MiniMind's rule, every square linear (in practice q_proj and
o_proj, when dim = n_heads * head_dim).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.seeds import derive_seed

from .config import ModelConfig, _need

# transformers' name of a linear -> where it is in one of our blocks
TARGETS = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
           "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}
_HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
STREAM = 0x4C6F5241  # "LoRA": the adapters' init is derive_seed(seed, STREAM), apart from every other draw
ADAPTER = re.compile(r"^layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


@dataclass
class LoRAConfig:
    """train.lora: adapters on the named linears, everything else frozen (rank 0: off)."""

    rank: int = 0
    """The adapters' rank r (0: no adapters, the whole model trains)."""
    alpha: float = 0.0
    """PEFT's lora_alpha; the update is scaled by alpha / rank (0: alpha = rank, scale 1, as MiniMind's LoRA)."""
    targets: str = "minimind"
    """Comma-separated linears (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or minimind:
    every square linear, MiniMind's rule."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout)."""
    init_from: str = ""
    """Continue from existing adapters: a PEFT folder (adapter_config.json + adapter_model.safetensors) or a
    MiniMind LoRA .pth, over the base model.init_from names ('' : fresh adapters, B = 0)."""

    def __post_init__(self) -> None:
        _need(self.rank >= 0, f"train.lora.rank must be >= 0 (0: off), got {self.rank}")
        _need(self.alpha >= 0, f"train.lora.alpha must be >= 0 (0: alpha = rank), got {self.alpha}")
        _need(0.0 <= self.dropout < 1.0, f"train.lora.dropout must be in [0, 1), got {self.dropout}")
        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        _need(bool(names), "train.lora.targets: expected minimind or a comma-separated list of linears")
        if names != ["minimind"]:
            unknown = [t for t in names if t not in TARGETS]
            _need(not unknown, f"train.lora.targets: {', '.join(map(repr, unknown))} matches no linear "
                               f"(known: {', '.join(TARGETS)}, or minimind)")

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank

    @classmethod
    def of(cls, d: dict | None) -> "LoRAConfig":
        """The config a manifest records (config.train.lora), or off."""
        return cls(**d) if d else cls()


def target_names(lora: LoRAConfig, cfg: ModelConfig) -> list[str]:
    """The linears (transformers' names) the config targets in a model of `cfg`; ValueError naming
    the key when one cannot take adapters of that rank."""
    names = [t.strip() for t in lora.targets.split(",") if t.strip()]
    shapes = {"q_proj": (cfg.dim, cfg.n_heads * cfg.head_size), "k_proj": (cfg.dim, cfg.n_kv_heads * cfg.head_size),
              "v_proj": (cfg.dim, cfg.n_kv_heads * cfg.head_size), "o_proj": (cfg.n_heads * cfg.head_size, cfg.dim),
              "gate_proj": (cfg.dim, cfg.ffn_dim), "up_proj": (cfg.dim, cfg.ffn_dim), "down_proj": (cfg.ffn_dim, cfg.dim)}
    if names == ["minimind"]:
        names = [n for n, (i, o) in shapes.items() if i == o and not (cfg.moe.experts and _HF_PARENT[n] == "mlp")]
        _need(bool(names), f"train.lora.targets=minimind: this model has no square linear (dim {cfg.dim}, "
                           f"n_heads * head_dim {cfg.n_heads * cfg.head_size}): name the targets")
    ffn = [n for n in names if _HF_PARENT[n] == "mlp"]
    _need(not (ffn and cfg.moe.experts), f"train.lora.targets: {', '.join(ffn)} on an MoE model (model.moe.experts="
                                         f"{cfg.moe.experts}): adapters go on attention only here (transformers fuses the "
                                         f"experts' linears, which PEFT cannot target one by one)")
    for n in names:
        i, o = shapes[n]
        _need(lora.rank <= min(i, o), f"train.lora.rank={lora.rank} is larger than {n} ({i} -> {o}) allows (at most {min(i, o)})")
    return names


class LoRALinear(nn.Linear):
    """A linear with its frozen weight (the base's tensor, under the base's name) and an adapter."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = None
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PEFT's order of operations: the base's output, then the scaled update added to it.
        result = F.linear(x, self.weight)
        return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scale


def attach(model: nn.Module, lora: LoRAConfig, seed: int) -> list[str]:
    """Put adapters on the target linears of every block and freeze everything else; A is drawn from
    derive_seed(seed, STREAM), one generator over the adapters in layer order. Returns the targets."""
    names = target_names(lora, model.cfg)
    g = torch.Generator().manual_seed(derive_seed(seed, STREAM))
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global generator: not for the run to see
        _attach(model, names, lora, g)
    return names


def _attach(model: nn.Module, names: list[str], lora: LoRAConfig, g: torch.Generator) -> None:
    for block in model.layers:
        for n in names:
            parent_name, attr = TARGETS[n].split(".")
            parent = getattr(block, parent_name)
            adapted = LoRALinear(getattr(parent, attr), lora.rank, lora.scale, lora.dropout)
            with torch.no_grad():
                a = torch.empty_like(adapted.lora_A.weight, device="cpu")
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)  # PEFT's init_lora_weights=True
                adapted.lora_A.weight.copy_(a)
                adapted.lora_B.weight.zero_()
            setattr(parent, attr, adapted)


def is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def merged(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base's weights with each adapter folded in: W + scale * B @ A (fp32), under the base's keys."""
    out = dict(base)
    for key in adapters:
        if key.endswith(".lora_A.weight"):
            stem = key[: -len(".lora_A.weight")]
            a, b = adapters[key].float(), adapters[f"{stem}.lora_B.weight"].float()
            out[f"{stem}.weight"] = base[f"{stem}.weight"].float() + scale * (b @ a)
    return out


def peft_name(key: str) -> str:
    """PEFT's name of one of our adapter keys: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight."""
    m = ADAPTER.match(key)
    if not m:
        raise KeyError(key)
    hf = {v: k for k, v in TARGETS.items()}[m.group(2)]
    return f"base_model.model.model.layers.{m.group(1)}.{_HF_PARENT[hf]}.{hf}.lora_{m.group(3)}.weight"


def minimind_name(key: str) -> str:
    """MiniMind's name of one of our adapter keys: model.layers.N.self_attn.q_proj.lora.A.weight."""
    m = ADAPTER.match(key)
    if not m:
        raise KeyError(key)
    hf = {v: k for k, v in TARGETS.items()}[m.group(2)]
    return f"model.layers.{m.group(1)}.{_HF_PARENT[hf]}.{hf}.lora.{m.group(3)}.weight"
