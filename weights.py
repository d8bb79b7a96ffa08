"""Weights in and out: start a run from existing weights (`model.init_from`), and export a
checkpoint for MiniMind or for Hugging Face (`python -m checkpoint export`).

Sources `model.init_from` reads, each read once and hashed from the same bytes (nothing pickled
runs: `weights_only=True` or safetensors):
  - one of our checkpoint folders, or a run folder (its newest valid checkpoint): the fp32 weights
    of the resume file, verified against the manifest;
  - one of our fp16 weights files (`weights_fp16.pth`);
  - a MiniMind2 state dict (`.pth`, MiniMind2's key names: `model.embed_tokens`, ...);
  - a Hugging Face Llama folder (`config.json` + `model.safetensors`), as `export --format hf` writes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from checkpoint import sharded, storage
from checkpoint.files import atomic_file, durable_tree, fsync_path
from checkpoint.manager import half_weights
from data import tokenizer as tokenizers
from inference import tokenizer_files
from model import MiniMindLM, ModelConfig
from model.formats import (WeightsError, check_fits, check_tensors, from_llama, hf_config, hf_differences, is_llama, llama_name,
                           to_llama)

FORMATS = ("minimind", "hf")
HF_WEIGHTS, HF_CONFIG, HF_GENERATION = "model.safetensors", "config.json", "generation_config.json"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise WeightsError(f"model.init_from: {path} does not exist") from None
    except OSError as e:
        raise storage.CheckpointError(f"{path}: cannot be read ({e.strerror})") from None


def _safetensors(data: bytes, path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, ValueError) as e:
        raise WeightsError(f"{path}: not a safetensors file ({e})") from None


def read_source(path: str | Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """(the weights under our key names, the record of where they came from: path, sha256, format)."""
    path = Path(path)
    if path.is_dir() and (path / HF_CONFIG).is_file():
        config_bytes, data = _read(path / HF_CONFIG), _read(path / HF_WEIGHTS)
        try:
            hf = json.loads(config_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path / HF_CONFIG}: does not parse ({e})") from None
        if not isinstance(hf, dict):
            raise WeightsError(f"{path / HF_CONFIG}: not a mapping of config fields")
        # Shapes alone do not tell 8 heads of 4 from 4 heads of 8: every architectural field is compared.
        diffs = hf_differences(hf, cfg)
        if diffs:
            raise WeightsError(f"{path / HF_CONFIG}: describes another model than model.* ({'; '.join(diffs)})")
        state = _safetensors(data, path / HF_WEIGHTS)
        # The source's identity is both files: another config.json over the same tensors is another model.
        files = {HF_CONFIG: hashlib.sha256(config_bytes).hexdigest(), HF_WEIGHTS: hashlib.sha256(data).hexdigest()}
        combined = hashlib.sha256("".join(f"{name}:{sha}\n" for name, sha in files.items()).encode()).hexdigest()
        record = {"path": str(path.resolve()), "sha256": combined, "format": "hf", "files": files}
    elif path.is_dir():  # one of our checkpoints, or a run folder
        folder, manifest, _, state = checkpoint_weights(path)
        record = {"path": str(folder.resolve()), "sha256": manifest["files"][storage.RESUME_FILE]["sha256"], "format": "checkpoint",
                  "model_sha256": manifest.get("model_sha256")}
    else:
        data = _read(path)
        if path.suffix == ".safetensors":
            state = _safetensors(data, path)
        else:
            try:
                state = storage.deserialize(data, path, "cpu")
            except storage.CheckpointError as e:  # pickled code, or not a torch file: a source we refuse, bad input
                raise WeightsError(f"model.init_from: {e}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise WeightsError(f"{path}: not a state dict (a mapping of names to tensors)")
        record = {"path": str(path.resolve()), "sha256": hashlib.sha256(data).hexdigest(),
                  "format": "minimind" if is_llama(state) else "weights"}
    llama = is_llama(state)
    if llama:
        state = from_llama(state)
    record["keys"] = "llama" if llama else "ours"
    return state, record


def init_from(model: MiniMindLM, path: str | Path) -> dict:
    """Load the weights at `path` into `model` (fp32); keys and shapes must match exactly. Returns the source's record."""
    state, record = read_source(path, model.cfg)
    names = llama_name if record["keys"] == "llama" else (lambda k: k)
    check_fits(state, model.state_dict(), str(path), names)
    check_tensors(state, str(path), names)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return record


def checkpoint_weights(ckpt: Path) -> tuple[Path, dict, ModelConfig, dict[str, torch.Tensor]]:
    """(folder, manifest, model config, fp32 weights) of a verified checkpoint (or a run folder's newest)."""
    folder, manifest, _ = storage.find_checkpoint(ckpt)
    _, payload = storage.load_verified(folder)
    try:
        return folder, manifest, ModelConfig(**payload["config"]["model"]), sharded.model_state(folder, payload)
    except (KeyError, TypeError, ValueError) as e:
        raise storage.CheckpointError(f"{folder / storage.RESUME_FILE}: not a resume file of this trainer ({type(e).__name__}: {e})") from None


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
    """Write the checkpoint's weights as a MiniMind2 state dict (fp16 .pth) or a Hugging Face Llama folder (fp32)."""
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
