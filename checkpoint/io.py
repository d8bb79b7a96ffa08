"""Atomic publishing, manifests, verification and safe loading of checkpoint folders.

A checkpoint is the folder `checkpoints/step_XXXXXXXX/` holding the resume file, the fp16 weights
file and `manifest.json`. It is built under a temporary dot-name, every file fsynced, the manifest
(size and sha256 of every file) written last, then `os.replace`d to its final name and the parent
fsynced (DESIGN.md I8). Discovery only looks at `step_*` names and only trusts a folder whose
manifest parses and whose files match it, so a save killed at any moment leaves either the
complete new checkpoint or nothing that is ever loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

RESUME_FILE = "resume.pth"
WEIGHTS_FILE = "weights_fp16.pth"
MANIFEST = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder or file and what failed."""


class HashingWriter:
    """File-like wrapper that hashes and counts bytes as `torch.save` writes them (nothing is read back)."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, obj: Any) -> dict:
    with open(path, "wb") as f:
        w = HashingWriter(f)
        if isinstance(obj, bytes):
            w.write(obj)
        else:
            torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": w.size, "sha256": w.sha.hexdigest()}


def _test_delay() -> None:
    # Test hook: stretch a save between two files so that a test can kill it mid-write.
    delay = float(os.environ.get("CKPT_TEST_WRITE_DELAY_S", "0") or 0)
    if delay:
        time.sleep(delay)


def publish(root: Path, step: int, files: dict[str, Any], manifest: dict) -> Path:
    """Write `files` (name -> object for torch.save, or raw bytes) as checkpoint `step` under `root`.

    On any failure the temporary folder is removed, nothing new is visible, and the error (with the
    path and the cause) propagates.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        entries = {}
        for name, obj in files.items():
            entries[name] = _write_file(tmp / name, obj)
            _test_delay()
        body = {"format": FORMAT, **manifest, "step": step, "files": entries}
        _write_file(tmp / MANIFEST, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
        _fsync_dir(tmp)
        if final.exists():
            # Saving a step that exists (a rerun of the same step): move the old one aside first,
            # so that a complete checkpoint of this step exists at every moment but this rename.
            trash = root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):
            raise CheckpointError(f"saving step {step} to {final} failed: {type(e).__name__}: {e}") from e
        raise
    return final


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_*` folder under root, newest first (validity not checked)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def scan(root: Path, verify_all: bool = False) -> tuple[Path | None, list[tuple[int, Path, str | None]]]:
    """The newest checkpoint under `root` that verifies (or None), and the checkpoints looked at,
    newest first, each with its verification error (None: it verifies). Without `verify_all` the
    scan stops at the first that verifies."""
    newest, listing = None, []
    for step, folder in list_checkpoints(root):
        if newest is not None and not verify_all:
            break
        try:
            verify(folder)
            listing.append((step, folder, None))
            newest = newest or folder
        except CheckpointError as e:
            listing.append((step, folder, str(e)))
    return newest, listing


def checkpoints_root(run: Path) -> Path:
    """The folder holding `step_*` checkpoints: `run/checkpoints` for a run folder, else `run`."""
    return run / "checkpoints" if (run / "checkpoints").is_dir() else run


def clear_temporaries(root: Path) -> list[Path]:
    """Remove what killed saves left behind (never loaded, never counted)."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints, oldest first. Call only after publishing."""
    removed = []
    for _, p in reversed(list_checkpoints(root)[keep:]):
        shutil.rmtree(p)
        removed.append(p)
    return removed


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (an unfinished or foreign folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: does not parse ({e})") from None
    if not isinstance(body, dict) or not isinstance(body.get("files"), dict) or "step" not in body:
        raise CheckpointError(f"{path}: not a checkpoint manifest (no 'files' or 'step')")
    return body


def verify(folder: Path) -> dict:
    """The manifest of `folder` after checking every file's size and sha256 against it."""
    body = read_manifest(folder)
    for name, entry in body["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in the manifest)")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry.get('bytes')} (truncated or replaced)")
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                sha.update(block)
        if sha.hexdigest() != entry.get("sha256"):
            raise CheckpointError(f"{path}: sha256 {sha.hexdigest()[:12]}... does not match the manifest's {str(entry.get('sha256'))[:12]}... (corrupted)")
    return body


def safe_load(path: Path, map_location: Any = "cpu") -> Any:
    """`torch.load(weights_only=True)`: tensors, numbers, strings and containers only (DESIGN.md I10).

    A file that needs anything else to unpickle is refused; the unpickler stops before any of its
    code runs.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: not a plain checkpoint: it needs pickled objects beyond tensors and containers; "
            f"refused without running them ({first})"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def model_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the fp32 parameters' bytes in state_dict order: the identity of a model's weights."""
    h = hashlib.sha256()
    for t in state_dict.values():
        t = t.detach()
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            t = t.to("cpu", torch.float32).contiguous()
        h.update(t.view(torch.uint8).numpy())  # the buffer itself: no copy, no tensor op
    return h.hexdigest()
