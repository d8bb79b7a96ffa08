"""A checkpoint's weights for others: MiniMind's state dict (fp16 .pth, MiniMind2's key names), a
Hugging Face folder (config.json, model.safetensors, generation_config.json and a tokenizer that
transformers' AutoTokenizer loads: the run's own files, or the byte tokenizer written as a
byte-level model, each with its chat template), or a LoRA run's adapters as a PEFT folder (its
base named relative to the folder, by the user, or exported beside it); written atomically; an
existing output is refused (`python -m checkpoint export`). A LoRA run's minimind and hf exports
are merged: W + scale * B @ A."""
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
from .sources import HF_CONFIG, HF_GENERATION, HF_WEIGHTS, checkpoint_base, checkpoint_weights, lora_of, model_config

FORMATS = ("minimind", "hf", "peft")
BASE_FOLDER = "base"
"""Where `export --format peft --with-base` writes the base's Hugging Face export, inside the adapter folder."""


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


def hf_tokenizer_files(files: dict[str, bytes], seq_len: int) -> dict[str, bytes]:
    """The tokenizer files of a Hugging Face export: the checkpoint's own (`files`), or, for a run on
    the byte tokenizer (no files), the byte tokenizer written as a byte-level `tokenizers` model."""
    return dict(files) if tokenizers.TOKENIZER_FILE in files else tokenizers.byte_tokenizer_files(seq_len)


def _write_hf(tmp: Path, cfg, state: dict[str, torch.Tensor], files: dict[str, bytes], tok) -> None:
    """A Hugging Face folder in `tmp`: fp32 weights under Llama's (or Qwen3's) names, config.json,
    generation_config.json and the tokenizer (`files`: the checkpoint's own tokenizer files, `tok`
    the tokenizer they make)."""
    from safetensors.torch import save_file

    tmp.mkdir()
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in to_llama(state, lm_head=False).items()}
    save_file(tensors, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
    (tmp / HF_CONFIG).write_text(json.dumps(hf_config(cfg, tok.bos, tok.eos, tok.pad), indent=1) + "\n")
    generation = {"bos_token_id": tok.bos, "eos_token_id": tok.eos, "pad_token_id": tok.pad, "max_length": cfg.seq_len}
    (tmp / HF_GENERATION).write_text(json.dumps(generation, indent=1) + "\n")
    for name, data in hf_tokenizer_files(files, cfg.seq_len).items():
        (tmp / name).write_bytes(data)


def export(ckpt: str | Path, fmt: str, out: str | Path, base: str | None = None, with_base: bool = False) -> Path:
    """Write the checkpoint's weights as a MiniMind2 state dict (fp16 .pth), a Hugging Face folder
    (fp32, with a tokenizer), or a LoRA run's adapters as a PEFT folder (fp32, for the Hugging Face
    export of its base: `base` names it in adapter_config.json; `with_base` writes it inside the
    folder, in BASE_FOLDER)."""
    if fmt == "peft":
        return _export_peft(Path(ckpt), Path(out), base, with_base)
    if base is not None or with_base:
        raise WeightsError(f"--base and --with-base: only with --format peft (they name a LoRA adapter's base), not --format {fmt}")
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
    return _atomic_folder(out, lambda tmp: _write_hf(tmp, cfg, state, files, tok))


def peft_base_name(source: str | None, out: Path, base: str | None, with_base: bool) -> str | None:
    """adapter_config.json's base_model_name_or_path: the name the user gave, else BASE_FOLDER when
    the base is exported inside the folder, else the path of the base the run read, relative to the
    adapter folder (None for a base that was the seeded init). Never an absolute path of this
    machine: the folder travels."""
    if base is not None:
        return base
    if with_base:
        return BASE_FOLDER
    return os.path.relpath(source, os.path.abspath(out)) if source else None


def _export_peft(ckpt: Path, out: Path, base: str | None, with_base: bool) -> Path:
    from checkpoint import storage

    from .adapters import write_peft

    if base is not None and not base.strip():
        raise WeightsError("--base: empty; expected the base model's name or path as PEFT should load it (e.g. a Hub name)")
    folder, manifest, _ = storage.find_checkpoint(ckpt)
    lora = lora_of(manifest)
    if not lora.rank:
        raise WeightsError(f"--format peft: {folder} holds a whole model, not adapters (train.lora.rank was 0): export it "
                           f"with --format hf")
    cfg, adapters = model_config(folder, manifest), storage.read_tensors(folder, manifest, "model.")
    files = tokenizer_files(folder, manifest)
    tok = tokenizers.from_files(files, str(folder))
    source = ((manifest.get("base") or {}).get("init_from") or {}).get("path")
    base_state = checkpoint_base(folder, manifest, cfg)[0] if with_base else None  # verified against the pinned hash
    name = peft_base_name(source, out, base, with_base)

    def write(tmp: Path) -> None:
        write_peft(tmp, adapters, lora, cfg, name)
        for file, data in hf_tokenizer_files(files, cfg.seq_len).items():  # AutoPeftModel reads the tokenizer from here
            (tmp / file).write_bytes(data)
        if with_base:
            _write_hf(tmp / BASE_FOLDER, cfg, base_state, files, tok)

    return _atomic_folder(out, write)
