"""The weights, model and tokenizer one of our checkpoints holds, read on one process: the fp32
weights from its states, the fp16 file for inference, its own tokenizer files; every file verified
against the manifest first (docs/design.md I10, I14)."""
from __future__ import annotations

from pathlib import Path

import torch

from checkpoint import storage
from data import tokenizer
from model import MiniMindLM, ModelConfig
from model.formats import WeightsError, check_fits


def model_config(folder: Path, manifest: dict) -> ModelConfig:
    """The model a checkpoint's manifest describes."""
    try:
        return ModelConfig.from_dict(manifest["config"]["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise storage.CheckpointError(f"{folder / storage.MANIFEST}: no usable model config ({type(e).__name__}: {e})") from None


def checkpoint_weights(path: Path) -> tuple[Path, dict, ModelConfig, dict[str, torch.Tensor]]:
    """(folder, manifest, model config, fp32 weights) of a checkpoint folder (or a run folder's newest
    valid checkpoint); the weights assembled from every rank's state files, each verified."""
    folder, manifest, _ = storage.find_checkpoint(path)
    return folder, manifest, model_config(folder, manifest), storage.read_tensors(folder, manifest, "model.")


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


def load_model(path: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> MiniMindLM:
    """The model of a checkpoint (or a run folder's newest), from its fp16 weights file.

    The folder is verified against its manifest first, the model's shape comes from the manifest's
    config, and the weights are read once, hashed, and deserialized with `weights_only=True`:
    nothing in the files can run."""
    folder, manifest, _ = storage.find_checkpoint(path)
    cfg = model_config(folder, manifest)
    weights = storage.safe_load_bytes(storage.read_verified(folder, storage.WEIGHTS_FILE, manifest), folder / storage.WEIGHTS_FILE)
    model = MiniMindLM(cfg)
    try:  # a manifest whose config was edited describes another model than the weights hold
        check_fits(weights, model.state_dict(), str(folder / storage.WEIGHTS_FILE))
    except WeightsError as e:
        raise storage.CheckpointError(f"{e}; the model is the one {folder / storage.MANIFEST}'s config describes") from None
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.to(device=device, dtype=dtype).eval()
