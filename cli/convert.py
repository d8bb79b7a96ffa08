"""`python -m checkpoint convert RUN`: checkpoints of the earlier layout (manifest format 1: a
resume.pth file beside the fp16 weights, or shards/ of DCP files for an fsdp run) rewritten in this
one, in place, through the one save path (checkpoint/manager.py). The same step, weights (the same
model_sha256), optimizer state, data position, every rank's generator states and the run's record;
the old folder is moved to checkpoints/moved_aside/, never deleted. Each old file is read once and
used only when its sha256 is its manifest's, with nothing pickled run."""
from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from checkpoint import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, RunMeta, format, storage

OLD_NAMES = re.compile(r"^(resume\.pth|weights_fp16\.pth|tokenizer\.json|tokenizer_config\.json|shards/(__\d{1,6}_\d{1,6}\.distcp|\.metadata))$")


def _old_manifest(folder: Path) -> dict | None:
    """The manifest of `folder` when it is of the earlier layout, else None."""
    try:
        body = json.loads((folder / storage.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and body.get("format") == 1 and isinstance(body.get("files"), dict) else None


def _verified(folder: Path, body: dict) -> dict[str, bytes]:
    """Every file the old manifest lists, read once, its name one the old layout writes and its sha256 the manifest's."""
    from . import CommandError

    out = {}
    for name, entry in body["files"].items():
        if not OLD_NAMES.match(name):
            raise CommandError(f"{folder / storage.MANIFEST}: lists {name!r}, not a file of the earlier layout; not converted")
        data = (folder / name).read_bytes()
        if len(data) != entry.get("bytes") or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CommandError(f"{folder / name}: does not match its manifest (damaged); not converted")
        out[name] = data
    if "resume.pth" not in out:
        raise CommandError(f"{folder}: no resume.pth; not a checkpoint of the earlier layout")
    return out


def states_of(config: dict) -> tuple[dict, object, object]:
    """The states a run of `config` (a resolved config, as a manifest records it) checkpoints, built
    on one process: ({"model", "optimizer", "train"}, the model, the optimizer)."""
    from model import MiniMindLM, ModelConfig
    from objectives.optim import make_optimizer
    from run.state import TrainState

    model = MiniMindLM(ModelConfig.from_dict(config["model"]))
    opt = make_optimizer(model, SimpleNamespace(**config["train"]))
    return {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": TrainState()}, model, opt


def convert_folder(folder: Path) -> Path:
    """Rewrite one checkpoint of the earlier layout in this one; returns the new folder (same name)."""
    from runtime import Runtime

    from . import CommandError

    if folder.parent.name != storage.CHECKPOINTS:
        raise CommandError(f"{folder}: not in a run folder's {storage.CHECKPOINTS}/ (convert it where its run keeps it)")
    files = _verified(folder, _old_manifest(folder))
    payload = storage.safe_load_bytes(files["resume.pth"], folder / "resume.pth")
    from configs import to_dict
    from model import ModelConfig

    config, sharded = payload["config"], bool(payload.get("sharded"))
    # keys this layout's model has and the earlier one did not take their defaults (the same model), recorded
    config = {**config, "model": to_dict(ModelConfig.from_dict(config["model"]))}
    states, model, opt = states_of(config)
    if sharded:  # the model and optimizer are DCP files already, under the same names this layout uses
        entries = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}
        metadata = format.read_metadata(files["shards/.metadata"], folder / "shards/.metadata")
        target = {"model": states["model"].state_dict(), "optimizer": states["optimizer"].state_dict()}
        format.load(target, folder, entries, metadata, no_dist=True, sub="shards")
        states["model"].load_state_dict(target["model"])
        states["optimizer"].load_state_dict(target["optimizer"])
    else:
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
    states["train"].load_state_dict(payload["train"])
    if "scaler" in payload:
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(payload["scaler"])
        states["scaler"] = scaler
    blobs = []
    for state in payload.get("rng") or []:
        buf = io.BytesIO()
        torch.save(state, buf)
        blobs.append(buf.getvalue())
    meta = RunMeta(world_size=payload["world_size"], global_batch=payload["global_batch"], micro_batch=payload["micro_batch"],
                   accum=payload["accum"], threads=payload.get("threads", 1), reduce=payload.get("reduce", "ddp"),
                   strategy="fsdp" if sharded else "ddp", config=config, data_fingerprint=payload["data_fingerprint"],
                   run_id=payload.get("run_id", ""), init_from=payload.get("init_from"),
                   files={k: v for k, v in files.items() if k in storage.TOKENIZER_FILES})
    run = folder.parent.parent
    manager = CheckpointManager(CheckpointConfig(interval=0, keep=1 << 30), run, Runtime(), meta)
    try:
        manager.save(int(payload["train"]["step"]), states, background=False, rng_states=blobs)
    finally:
        manager.close()
    return folder


def convert(path: Path) -> int:
    """Convert every checkpoint of the earlier layout in a run folder (or the one checkpoint folder given)."""
    from . import CommandError

    path = Path(path)
    if (path / storage.MANIFEST).exists():
        folders = [path]
    elif (path / storage.CHECKPOINTS).is_dir():
        folders = [f for _, f in sorted(storage.list_checkpoints(path / storage.CHECKPOINTS))]
    else:
        raise CommandError(f"{path}: neither a run folder nor a checkpoint folder")
    old = [f for f in folders if _old_manifest(f) is not None]
    if not old:
        print(f"{path}: no checkpoint of the earlier layout; nothing to convert")
        return 0
    for f in old:
        convert_folder(f)
        print(f"converted {f} (the old folder is in {f.parent / storage.MOVED_ASIDE})")
    return 0
