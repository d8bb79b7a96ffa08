"""`python -m checkpoint convert RUN`: checkpoints of the earlier layout (manifest format 1: a
resume.pth file beside the fp16 weights, or shards/ of DCP files for an fsdp run) rewritten in this
one, in place, through the one save path (checkpoint/manager.py). The same step, weights (the same
model_sha256), optimizer state, data position, every rank's generator states and the run's record;
the old folder is moved to checkpoints/moved_aside/, never deleted. Each old file is read once and
used only when its sha256 is its manifest's, with nothing pickled run.

The record gains every config key added since that release, at the default that is what the release
did (no LoRA, next_token, eager, no activation checkpointing, no q/k norm, no experts), and the
conversion names them: a converted run resumes under today's policy (configs/resume.py) and continues
with the uninterrupted run's bits (tests/test_convert.py, on checkpoints that release wrote).

One step folder converts in a sequence journaled in checkpoints/convert.journal, written atomically
before anything changes and removed after the last step:

    1. the journal: the step folder, and the name it will have under moved_aside/
    2. the new checkpoint written and published in checkpoints/.convert/ (nothing of the run changes)
    3. the old folder moved to checkpoints/moved_aside/<name>-earlier-layout-<UTC time>-<4 hex>
    4. the new one renamed in as checkpoints/step_N
    5. .convert/ and the journal removed

A conversion killed anywhere in it is finished by the next `convert` (the journal says what was under
way, the folders how far it got), and while the journal is there a resume is refused (the manager
names it), so no resume loads an older step or clears a converted copy. The newest step converts
first: between two folders, the newest checkpoint is always a converted one.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import torch

from checkpoint import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, RunMeta, format, storage
from checkpoint.manager import CONVERT_JOURNAL
from common.files import atomic_write, fsync_path

OLD_NAMES = re.compile(r"^(resume\.pth|weights_fp16\.pth|tokenizer\.json|tokenizer_config\.json|shards/(__\d{1,6}_\d{1,6}\.distcp|\.metadata))$")
STAGING = ".convert"
"""checkpoints/.convert/: where a step's new checkpoint is written (as a run folder of its own) before it is renamed in."""


def _reached(point: str) -> None:
    """A point of the sequence passed: "journal", "staged", "aside", "renamed", "cleaned", "converted" (the
    tests stop a conversion at each, as a kill would)."""


def _old_manifest(folder: Path) -> dict | None:
    """The manifest of `folder` when it is of the earlier layout, else None."""
    try:
        body = json.loads((folder / storage.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and body.get("format") == 1 and isinstance(body.get("files"), dict) else None


def _verified(folder: Path, body: dict) -> dict[str, bytes]:
    """Every file the old manifest lists, read once, its name one the old layout writes and its sha256 the manifest's."""
    from .arguments import CommandError

    out = {}
    for name, entry in body["files"].items():
        if not OLD_NAMES.match(name):
            raise CommandError(f"{folder / storage.MANIFEST}: lists {name!r}, not a file of the earlier layout; not converted")
        try:
            data = (folder / name).read_bytes()
        except FileNotFoundError:
            raise storage.CheckpointError(f"{folder / name}: missing (listed in its manifest); not converted") from None
        if len(data) != entry.get("bytes") or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise storage.CheckpointError(f"{folder / name}: does not match its manifest (damaged); not converted")
        out[name] = data
    if "resume.pth" not in out:
        raise CommandError(f"{folder}: no resume.pth; not a checkpoint of the earlier layout")
    return out


def completed(config: dict) -> tuple[dict, list[str]]:
    """The earlier release's recorded config with every key added since at its default, and the keys
    filled ("train.objective=next_token", ...). Each default is what that release did: it had no LoRA
    (rank 0), one objective (next_token), no compile, no activation checkpointing, no q/k norm,
    head_dim = dim / n_heads (0) and no experts; DPO's and GRPO's keys are unused under next_token."""
    from configs import Config, to_dict

    filled: list[str] = []

    def fill(record: dict, defaults: dict, prefix: str) -> dict:
        out = dict(record)
        for key, value in defaults.items():
            if key not in record:
                out[key] = value
                filled.append(f"{prefix}{key}={json.dumps(value) if isinstance(value, dict) else value}")
            elif isinstance(value, dict) and isinstance(record[key], dict):
                out[key] = fill(record[key], value, f"{prefix}{key}.")
        return out

    return fill(config, to_dict(Config()), ""), filled


def states_of(config: dict) -> tuple[dict, object, object]:
    """The states a run of `config` (a resolved config, as a manifest records it) checkpoints, built
    on one process: ({"model", "optimizer", "train"}, the model, the optimizer)."""
    from model import MiniMindLM, ModelConfig
    from objectives.optim import make_optimizer
    from run.state import TrainState

    model = MiniMindLM(ModelConfig.from_dict(config["model"]))
    opt = make_optimizer(model, SimpleNamespace(**config["train"]))
    return {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": TrainState()}, model, opt


def read_old(folder: Path) -> tuple[dict[str, bytes], dict]:
    """The files of a checkpoint of the earlier layout, each read once and verified, and its resume.pth
    unpickled (tensors and containers only); nothing changes yet."""
    files = _verified(folder, _old_manifest(folder))
    payload = storage.safe_load_bytes(files["resume.pth"], folder / "resume.pth")
    train = payload.get("train") if isinstance(payload, dict) else None
    step = train.get("step") if isinstance(train, dict) else None
    name = folder.name.split("-")[0]  # step_N, or step_N-earlier-layout-<time> under moved_aside/
    if not isinstance(step, int) or storage.step_dir_name(step) != name or not isinstance(payload.get("config"), dict):
        raise storage.CheckpointError(f"{folder / 'resume.pth'}: expected the train state of step {name} and the run's config, "
                                      f"got step {step!r}; not converted")
    return files, payload


def write_converted(folder: Path, files: dict[str, bytes], payload: dict, staging: Path) -> tuple[Path, list[str]]:
    """Publish the checkpoint of the earlier layout read from `folder` (read_old) in this layout as
    staging/checkpoints/step_N; returns that folder and the config keys filled."""
    from runtime import Runtime

    from configs import to_dict
    from model import ModelConfig

    step = int(payload["train"]["step"])
    config, filled = completed(payload["config"])
    sharded = bool(payload.get("sharded"))
    config = {**config, "model": to_dict(ModelConfig.from_dict(config["model"]))}
    states, model, opt = states_of(config)
    if sharded:  # the model and optimizer are DCP files already, under the same names this layout uses
        entries = {n: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for n, data in files.items()}
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
                   files={k: v for k, v in files.items() if k in storage.TOKENIZER_FILES},
                   architecture=_architecture(config))
    manager = CheckpointManager(CheckpointConfig(interval=0, keep=1 << 30), staging, Runtime(), meta)
    try:
        manager.save(step, states, background=False, rng_states=blobs)
    finally:
        manager.close()
    return staging / storage.CHECKPOINTS / storage.step_dir_name(step), filled


def _architecture(config: dict) -> dict:
    """The converted model's architecture fields, for its identity (the manifest's model_sha256)."""
    from model import ModelConfig

    return ModelConfig.from_dict(config["model"]).architecture()


def _remove_staging(root: Path) -> None:
    """Remove checkpoints/.convert/ (only this command writes there; a link is unlinked, never followed)."""
    staging = root / STAGING
    if staging.is_symlink():
        staging.unlink()
    elif staging.exists():
        shutil.rmtree(staging)
    fsync_path(root)


def _move(src: Path, dest: Path) -> None:
    os.replace(src, dest)
    fsync_path(dest.parent)
    fsync_path(src.parent)


def convert_folder(folder: Path) -> tuple[Path, Path, list[str]]:
    """Rewrite one checkpoint of the earlier layout in this one, journaled (the module's docstring);
    returns (the new folder, same name; where the old one went; the config keys filled)."""
    from .arguments import CommandError

    root = folder.parent
    if root.name != storage.CHECKPOINTS:
        raise CommandError(f"{folder}: not in a run folder's {storage.CHECKPOINTS}/ (convert it where its run keeps it)")
    files, payload = read_old(folder)  # a damaged folder is refused here, before anything changes
    when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = root / storage.MOVED_ASIDE / f"{folder.name}-earlier-layout-{when}-{uuid.uuid4().hex[:4]}"
    _remove_staging(root)  # what a conversion killed before its journal was written left
    atomic_write(root / CONVERT_JOURNAL, json.dumps({"folder": folder.name, "aside": str(aside.relative_to(root)),
                                                     "staging": STAGING}, indent=1) + "\n")
    _reached("journal")
    staged, filled = write_converted(folder, files, payload, root / STAGING)
    _reached("staged")
    aside.parent.mkdir(exist_ok=True)
    _move(folder, aside)
    _reached("aside")
    _move(staged, folder)
    _reached("renamed")
    _remove_staging(root)
    _reached("cleaned")
    (root / CONVERT_JOURNAL).unlink()
    fsync_path(root)
    _reached("converted")
    return folder, aside, filled


def _journal(root: Path) -> dict:
    """The journal of an interrupted conversion, its names confined to checkpoints/ (else a CheckpointError)."""
    path = root / CONVERT_JOURNAL
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise storage.CheckpointError(f"{path}: cannot be read ({e}); a conversion was interrupted: move it away once "
                                      f"{root} holds the checkpoints you want") from None
    folder, aside = (body.get("folder"), body.get("aside")) if isinstance(body, dict) else (None, None)
    if not (isinstance(folder, str) and re.fullmatch(r"step_\d{8}", folder) and isinstance(aside, str)
            and re.fullmatch(rf"{storage.MOVED_ASIDE}/{folder}-earlier-layout-\d{{8}}T\d{{6}}Z-[0-9a-f]{{4}}", aside)):
        raise storage.CheckpointError(f"{path}: not a journal of this command (expected a step folder and its moved_aside/ name)")
    return body


def finish(root: Path) -> str | None:
    """Finish the conversion the journal in `root` (a run's checkpoints/) says was under way, from
    wherever it stopped; returns what was done (None: no journal)."""
    if not (root / CONVERT_JOURNAL).exists():
        return None
    body = _journal(root)
    final, aside = root / body["folder"], root / body["aside"]
    staged = root / STAGING / storage.CHECKPOINTS / body["folder"]
    if _old_manifest(final) is not None:  # stopped before the old folder moved: it converts again from the start
        done = f"{final}: the interrupted conversion had not moved it; converting it again"
    else:
        if not final.exists() and not final.is_symlink():
            if _old_manifest(aside) is None:
                raise storage.CheckpointError(f"{root / CONVERT_JOURNAL}: names {final.name}, but neither it nor {aside} "
                                              f"holds it; nothing was changed")
            try:
                storage.verify(staged)
            except storage.CheckpointError:  # not reached by this command's order; rebuilt from the old folder all the same
                _remove_staging(root)
                staged, _ = write_converted(aside, *read_old(aside), root / STAGING)
            _move(staged, final)
        storage.verify(final)  # the converted one is in place (else a CheckpointError naming it: exit 1, nothing removed)
        done = f"finished the interrupted conversion of {final} (the old folder is in {aside})"
    _remove_staging(root)
    (root / CONVERT_JOURNAL).unlink()
    fsync_path(root)
    return done


def convert(path: Path) -> int:
    """Convert every checkpoint of the earlier layout in a run folder (or the one checkpoint folder
    given), newest first, after finishing a conversion that was interrupted."""
    from common.store import is_url

    from .arguments import CommandError

    if is_url(path):  # the store came with this layout: nothing there was written by the earlier one
        from checkpoint import remote

        run, step = remote.split(str(path))
        steps = [folder.name for _, folder in remote.RemoteStore(remote.RemotePath(run)).list_steps()]
        if not steps or (step and step not in steps):
            raise CommandError(f"{path}: no checkpoint in the store there; nothing to convert")
        print(f"{path}: a run folder in object storage holds this layout only (the earlier one predates the store); nothing to convert")
        return 0
    path = Path(path)
    if (path / storage.MANIFEST).exists():
        root, only = path.parent, path
    elif (path / storage.CHECKPOINTS).is_dir() and not (path / storage.CHECKPOINTS).is_symlink():
        root, only = path / storage.CHECKPOINTS, None
    elif (path.parent / CONVERT_JOURNAL).exists():  # the checkpoint folder given is the one under way
        root, only = path.parent, path
    else:
        raise CommandError(f"{path}: neither a run folder (with {storage.CHECKPOINTS}/) nor a checkpoint folder (with "
                           f"{storage.MANIFEST}); expected the run folder whose checkpoints to convert")
    done = finish(root)
    if done:
        print(done)
    folders = [only] if only is not None else [f for _, f in storage.list_checkpoints(root)]  # newest first
    if only is None and not folders and not done:
        raise CommandError(f"{path}: no checkpoint in {root}; nothing to convert")
    old = [f for f in folders if _old_manifest(f) is not None]
    if not old:
        if not done:
            print(f"{path}: no checkpoint of the earlier layout; nothing to convert")
        return 0
    said = set()
    for f in old:
        _, aside, filled = convert_folder(f)
        print(f"converted {f} (the old folder is {aside})")
        if filled and tuple(filled) not in said:
            said.add(tuple(filled))
            print(f"  filled the keys the earlier release did not have with the defaults that are what it did: {', '.join(filled)}")
    return 0


HELP = "convert checkpoints of the earlier layout (resume.pth) into this one, in place"
REMOTE = False  # not fetched: a local run folder is rewritten in place, one in the store has nothing to convert


def arguments(p) -> None:
    from .arguments import place

    p.add_argument("path", type=place, help="a run folder (every old checkpoint in it) or one checkpoint folder")


def run(args) -> int:
    return convert(args.path)
