"""The weights, model and tokenizer one of our checkpoints holds, read on one process: the fp32
weights from its states, the fp16 file for inference, its own tokenizer files; every file verified
against the manifest first (docs/design.md I10, I14)."""
from __future__ import annotations

from pathlib import Path

import torch

from checkpoint import storage
from data import tokenizer
from model import MiniMindLM
from model.formats import WeightsError, check_fits
from model.lora import attach

from .sources import _safetensors, checkpoint_base, lora_of, model_config


def tokenizer_files(folder: Path, manifest: dict) -> dict[str, bytes]:
    """The tokenizer files a verified checkpoint folder lists, each read once and checked against its sha256."""
    return {name: storage.read_verified(folder, name, manifest) for name in storage.TOKENIZER_FILES if name in manifest["files"]}


def load_tokenizer(path: Path):
    """The tokenizer a checkpoint (or a run folder's newest) carries: its own tokenizer.json, read
    verified, or the byte tokenizer when it has none."""
    folder, manifest, _ = storage.find_checkpoint(path)
    try:
        return tokenizer.from_files(tokenizer_files(folder, manifest), str(folder))
    except tokenizer.TokenizerError as e:
        raise storage.CheckpointError(str(e)) from None


def load_model_and_tokenizer(path: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                             fp32: bool = False) -> tuple[MiniMindLM, object]:
    """A tool's model and tokenizer from one checkpoint: a run folder's newest is found once (and named
    once in the log), so both come from the same step even while the run publishes a newer one."""
    folder = storage.find_checkpoint(path)[0]
    return load_model(folder, device, dtype, fp32), load_tokenizer(folder)


def fp16_weights(folder: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's fp16 weights file, read once and verified: the safetensors file (format 3; a
    tensor written once under two names given back under both) or a format-2 checkpoint's
    torch.save file (weights_only)."""
    if storage.WEIGHTS_FILE not in manifest["files"] and storage.OLD_WEIGHTS_FILE in manifest["files"]:
        name = storage.OLD_WEIGHTS_FILE
        return storage.safe_load_bytes(storage.read_verified(folder, name, manifest), folder / name)
    try:
        return _safetensors(storage.read_verified(folder, storage.WEIGHTS_FILE, manifest), folder / storage.WEIGHTS_FILE)
    except WeightsError as e:  # a verified file that a forged manifest vouches for
        raise storage.CheckpointError(str(e)) from None


def load_model(path: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, fp32: bool = False) -> MiniMindLM:
    """The model of a checkpoint (or a run folder's newest), from its fp16 weights file (`fp32`: from
    its fp32 states, the weights as trained).

    The folder is verified against its manifest first, the model's shape comes from the manifest's
    config, and the weights are read once, hashed, and deserialized with `weights_only=True`:
    nothing in the files can run. A LoRA run's model is its base (verified, fp32) with the
    checkpoint's adapters on it (the fp16 file holds them alone)."""
    folder, manifest, _ = storage.find_checkpoint(path)
    cfg = model_config(folder, manifest)
    if fp32:
        weights = storage.read_tensors(folder, manifest, "model.")
    else:
        weights = fp16_weights(folder, manifest)
    model = MiniMindLM(cfg)
    lora = lora_of(manifest)
    if lora.rank:
        attach(model, lora, 0)  # the adapters' init is replaced below
        base, _ = checkpoint_base(folder, manifest, cfg)
        model.load_state_dict(base, strict=False)
    expected = {k: v for k, v in model.state_dict().items() if not lora.rank or ".lora_" in k}
    try:  # a manifest whose config was edited describes another model than the weights hold
        check_fits(weights, expected, str(folder / storage.WEIGHTS_FILE))
    except WeightsError as e:
        raise storage.CheckpointError(f"{e}; the model is the one {folder / storage.MANIFEST}'s config describes") from None
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=not lora.rank)
    return model.to(device=device, dtype=dtype).eval()
