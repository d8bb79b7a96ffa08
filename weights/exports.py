"""A checkpoint's weights for others: MiniMind's state dict (fp16 .pth, MiniMind2's key names), a
Hugging Face folder (config.json, model.safetensors, generation_config.json and the run's tokenizer
files), or a LoRA run's adapters as a PEFT folder; written atomically; an existing output is refused
(`python -m checkpoint export`). A LoRA run's minimind and hf exports are merged: W + scale * B @ A."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from checkpoint import half_weights
from common.files import atomic_file, durable_tree, fsync_path
from data import tokenizer as tokenizers
from model.formats import WeightsError, hf_config, to_llama

from .ours import tokenizer_files
from .sources import HF_CONFIG, HF_GENERATION, HF_WEIGHTS, checkpoint_weights, lora_of, model_config

FORMATS = ("minimind", "hf", "peft")


def _refuse_existing(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise WeightsError(f"--out {out}: exists; choose another path or remove it first (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)


def _atomic_folder(out: Path, write) -> Path:
    """Run `write(tmp)` into a temporary folder beside `out`, make every file in it durable with an
    ordinary mode, then rename it to `out` and fsync the parent; an existing `out` is refused."""
    _refuse_existing(out)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        durable_tree(tmp)
        os.replace(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export(ckpt: str | Path, fmt: str, out: str | Path) -> Path:
    """Write the checkpoint's weights as a MiniMind2 state dict (fp16 .pth), a Hugging Face folder
    (fp32), or a LoRA run's adapters as a PEFT folder (fp32, for the Hugging Face export of its base)."""
    if fmt == "peft":
        return _export_peft(Path(ckpt), Path(out))
    folder, manifest, cfg, state = checkpoint_weights(Path(ckpt))
    files = tokenizer_files(folder, manifest)
    out = Path(out)
    if fmt == "minimind":
        halves = half_weights(state)  # tied tensors stay one tensor, as in MiniMind's own state dict
        _refuse_existing(out)
        with atomic_file(out) as f:
            torch.save(to_llama(halves, lm_head=True), f)
        return out
    if fmt != "hf":
        raise WeightsError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    tok = tokenizers.from_files(files, str(folder))

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        tmp.mkdir()
        tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in to_llama(state, lm_head=False).items()}
        save_file(tensors, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
        (tmp / HF_CONFIG).write_text(json.dumps(hf_config(cfg, tok.bos, tok.eos, tok.pad), indent=1) + "\n")
        generation = {"bos_token_id": tok.bos, "eos_token_id": tok.eos, "pad_token_id": tok.pad, "max_length": cfg.seq_len}
        (tmp / HF_GENERATION).write_text(json.dumps(generation, indent=1) + "\n")
        for name, data in files.items():
            (tmp / name).write_bytes(data)

    return _atomic_folder(out, write)


def _export_peft(ckpt: Path, out: Path) -> Path:
    from checkpoint import storage

    from .adapters import write_peft

    folder, manifest, _ = storage.find_checkpoint(ckpt)
    lora = lora_of(manifest)
    if not lora.rank:
        raise WeightsError(f"--format peft: {folder} holds a whole model, not adapters (train.lora.rank was 0): export it "
                           f"with --format hf")
    cfg, adapters = model_config(folder, manifest), storage.read_tensors(folder, manifest, "model.")
    base = ((manifest.get("base") or {}).get("init_from") or {}).get("path")
    return _atomic_folder(out, lambda tmp: write_peft(tmp, adapters, lora, cfg, base))
