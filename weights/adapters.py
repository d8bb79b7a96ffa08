"""LoRA adapters in and out (docs/lora.md): PEFT's folder (adapter_config.json +
adapter_model.safetensors) both ways, MiniMind's LoRA .pth in; each checked against the run's
train.lora and model.* before a tensor is used, every difference named."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from checkpoint import storage
from model.formats import WeightsError, check_fits, check_tensors
from model.lora import LoRAConfig, is_adapter, minimind_name, peft_name, target_names

from .sources import base_weights, pin, read_bytes_of, verified_base

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
LORA_KEY = "train.lora.init_from"


def peft_config(lora: LoRAConfig, targets: list[str], base: str | None) -> dict:
    """The adapter_config.json PEFT writes for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha or lora.rank,
            "lora_dropout": lora.dropout, "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": base, "inference_mode": True}


def _peft_differences(config: dict, lora: LoRAConfig, targets: list[str]) -> list[str]:
    diffs = []
    if config.get("peft_type") != "LORA":
        diffs.append(f"peft_type {config.get('peft_type')!r} there, LORA here")
    if config.get("r") != lora.rank:
        diffs.append(f"r {config.get('r')!r} there, train.lora.rank={lora.rank} here")
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, (int, float)) or float(alpha) != float(lora.alpha or lora.rank):
        diffs.append(f"lora_alpha {alpha!r} there, train.lora.alpha={lora.alpha or lora.rank:g} here")
    theirs = config.get("target_modules")
    theirs = sorted([theirs] if isinstance(theirs, str) else theirs or [])
    if theirs != sorted(targets):
        diffs.append(f"target_modules {theirs} there, train.lora.targets={lora.targets} ({', '.join(sorted(targets))}) here")
    for key, ours in (("bias", "none"), ("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False)):
        if config.get(key, ours) != ours:
            diffs.append(f"{key} {config.get(key)!r} there, {ours!r} here")
    for key in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            diffs.append(f"{key} {config.get(key)!r} there: not supported here")
    return diffs


def read_adapters(path: str | Path, expected: dict[str, torch.Tensor], lora: LoRAConfig, cfg) -> tuple[dict[str, torch.Tensor], dict]:
    """Adapters to continue from, under our keys, fp32: a PEFT folder or a MiniMind LoRA .pth, checked
    against `expected` (the model's adapter tensors: keys and shapes) and train.lora. Returns (the
    adapters, the source's record: path, sha256, format)."""
    path, targets = Path(path), target_names(lora, cfg)
    expected = {k: v for k, v in expected.items() if is_adapter(k)}
    if path.is_dir():
        config_bytes, data = read_bytes_of(path / PEFT_CONFIG, LORA_KEY), read_bytes_of(path / PEFT_WEIGHTS, LORA_KEY)
        try:
            config = json.loads(config_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path / PEFT_CONFIG}: does not parse ({e})") from None
        if not isinstance(config, dict):
            raise WeightsError(f"{path / PEFT_CONFIG}: not a mapping of PEFT's config fields")
        if diffs := _peft_differences(config, lora, targets):
            raise WeightsError(f"{path / PEFT_CONFIG}: other adapters than train.lora describes ({'; '.join(diffs)})")
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            theirs = load(data)
        except (SafetensorError, ValueError) as e:
            raise WeightsError(f"{path / PEFT_WEIGHTS}: not a safetensors file ({e})") from None
        names, fmt = peft_name, "peft"
        files = {PEFT_CONFIG: hashlib.sha256(config_bytes).hexdigest(), PEFT_WEIGHTS: hashlib.sha256(data).hexdigest()}
        sha = hashlib.sha256("".join(f"{n}:{h}\n" for n, h in files.items()).encode()).hexdigest()
    else:
        data = read_bytes_of(path, LORA_KEY)
        try:
            theirs = storage.safe_load_bytes(data, path)
        except storage.CheckpointError as e:
            raise WeightsError(f"train.lora.init_from: {e}") from None
        if not isinstance(theirs, dict) or not all(isinstance(v, torch.Tensor) for v in theirs.values()):
            raise WeightsError(f"{path}: not a state dict of adapters (a mapping of names to tensors)")
        theirs = {k.removeprefix("module."): v for k, v in theirs.items()}  # as MiniMind's load_lora strips DDP's prefix
        if lora.scale != 1.0:
            raise WeightsError(f"train.lora.alpha={lora.alpha:g} with rank {lora.rank} (scale {lora.scale:g}): MiniMind's adapters "
                               f"have no scaling; give train.lora.alpha=0 (alpha = rank) to use {path}")
        names, fmt, sha = minimind_name, "minimind", hashlib.sha256(data).hexdigest()
    back = {names(k): k for k in expected}
    state = {back.get(k, k): v for k, v in theirs.items()}
    check_fits(state, expected, str(path), lambda k: names(k) if is_adapter(k) and k in expected else k)
    check_tensors(state, str(path), lambda k: names(k) if k in expected else k)
    return {k: v.to(torch.float32) for k, v in state.items()}, {"path": str(path.resolve()), "sha256": sha, "format": fmt}


def write_peft(tmp: Path, adapters: dict[str, torch.Tensor], lora: LoRAConfig, cfg, base: str | None) -> None:
    """A PEFT adapter folder in `tmp` (fp32 tensors under PEFT's names)."""
    from safetensors.torch import save_file

    tmp.mkdir()
    tensors = {peft_name(k): v.detach().to(torch.float32).contiguous() for k, v in adapters.items()}
    save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
    (tmp / PEFT_CONFIG).write_text(json.dumps(peft_config(lora, target_names(lora, cfg), base), indent=1) + "\n")


def lora_start(cfg, seed: int, lora: LoRAConfig, path: str, base: dict | None, resumed_from: Path | None,
               expected: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict | None, dict | None, str]:
    """What a LoRA run loads into its model before training: the base at `path` (the seeded init
    with none), on a resume (`base`: the checkpoint's record) refused unless it is the one the
    adapters were trained over, and a fresh run's adapters from train.lora.init_from. Returns (the
    tensors to load, the base's source record, the adapters' record, the base's pin: its identity)."""
    if base is not None:
        state, record = verified_base(cfg, seed, path, base, f"the adapters of {resumed_from}")
    else:
        state, record = base_weights(cfg, seed, path)
    adapters, source = read_adapters(lora.init_from, expected, lora, cfg) if lora.init_from and base is None else ({}, None)
    return state | adapters, record, source, pin(state, cfg)
