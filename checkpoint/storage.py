"""Checkpoint folders on disk: atomic publishing, the manifest, verification, discovery and pruning.

A checkpoint is the folder `checkpoints/step_XXXXXXXX/`: the run's states in `state/` (DCP's files,
checkpoint/format.py), the fp16 weights for inference, the run's tokenizer files and
`manifest.json`, which lists every file with its size and sha256 and says what the run is. It is
built under a temporary dot-name, every file fsynced, the manifest written last, then `os.replace`d
to its final name and the parent fsynced (docs/design.md I8). Discovery only looks at `step_*` names
and only trusts a folder whose manifest parses, lists only files this trainer writes, and whose
files are all there, each of the listed size; a file is used only once its sha256 matches. A save
killed at any moment leaves either the complete new checkpoint or nothing that is ever loaded.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from common.files import fsync_path
from common.outcome import BadInput

from .files import CheckpointError, FileError, refuse_links, write_file
from .format import METADATA, STATE

CHECKPOINTS = "checkpoints"
"""The run folder's sub-folder of step folders (run/folder.py names the rest of the run folder)."""
WEIGHTS_FILE = "weights_fp16.safetensors"
"""The fp16 weights for inference (format 3): a safetensors file, so that any Hugging Face tool reads it."""
OLD_WEIGHTS_FILE = "weights_fp16.pth"
"""The same of a format-2 checkpoint: a torch.save state dict (read with weights_only=True)."""
ALIASES = "aliases"
"""The weights file's safetensors metadata key: JSON {name: the name whose tensor it shares} (tied
embeddings are one tensor in memory, written once)."""
MANIFEST = "manifest.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A run's tokenizer files, copied as they are into each checkpoint when the run has them."""
FILES = frozenset({WEIGHTS_FILE, OLD_WEIGHTS_FILE, *TOKENIZER_FILES})
"""The only plain names a manifest may list: a manifest never decides which files are opened."""
STATE_NAME = re.compile(rf"^{STATE}/(__\d{{1,6}}_\d{{1,6}}\.distcp|\{METADATA})$")
"""...besides DCP's files in state/ (checkpoint/format.py)."""
FORMAT = 3
"""Of the manifest: 3 holds every state in state/ (DCP) with every tensor's bytes raw (checkpoint/format.py);
2, the same with every item a torch.save record (still read); 1 was the layout of a resume.pth file."""
READS = (2, 3)
"""The manifest formats this trainer loads."""
CONVERT = "python -m checkpoint convert"
log = logging.getLogger("minimind")
NAME = _NAME = re.compile(r"^step_(\d{8})$")
TOKEN = re.compile(r"^[0-9a-f]{8,32}$")
"""A save's token: the prefix of its files in the store (checkpoint/remote.py)."""
TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
MOVED_ASIDE = "moved_aside"
"""checkpoints/moved_aside/: step folders this trainer would otherwise have deleted (one that does not
verify, found where a new checkpoint of its step goes), kept whole under their name and the time."""


class CheckpointMismatch(CheckpointError, BadInput):
    """The checkpoints are sound but this run's settings do not fit them (another model, corpus,
    seed or global batch; resume=never over existing checkpoints): bad input, exit 2 not 1."""


class NoCheckpoint(CheckpointError, BadInput):
    """A path that holds no checkpoint at all (a tool given the wrong folder): bad input, exit 2;
    checkpoints that are there but do not verify are a CheckpointError (exit 1)."""


class OldLayout(CheckpointError, BadInput):
    """A checkpoint of the earlier layout (manifest format 1): `python -m checkpoint convert` turns
    it into this one. Bad input (exit 2): a rerun changes nothing, the conversion does."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def new_temporary(root: Path, step: int) -> Path:
    """A fresh temporary folder for checkpoint `step` (discovery never takes it for a checkpoint;
    clear_temporaries removes it when a save dies)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish(root: Path, step: int, files: dict[str, Any], manifest: dict, tmp: Path | None = None,
            written: dict[str, dict] | None = None) -> Path:
    """Write `files` (name -> object for torch.save, or raw bytes) as checkpoint `step` under `root`.
    A `manifest` value may be a Future (a hash computed while the files are written): it is awaited
    once the files are on disk, before the manifest is written. `tmp` and `written`: a temporary
    folder (new_temporary) that already holds files written and fsynced by every rank (the states,
    checkpoint/format.py), with their manifest entries (or Futures of them: a file still being
    written in a thread, awaited here); they are listed with the rest.

    On any failure the temporary folder is removed, nothing new is visible, and the error (with the
    path and the cause) propagates.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    try:
        tmp = tmp or new_temporary(root, step)
        entries = {name: e.result() if isinstance(e, Future) else e for name, e in (written or {}).items()}
        fsyncs = []
        for sub in {Path(name).parent for name in entries} - {Path(".")}:
            fsync_path(tmp / sub)  # the state files' names are durable in their folder
        try:
            for name, obj in files.items():
                # a file's fsync runs while the next one is written
                entries[name] = write_file(tmp / name, obj, fsyncs)
        finally:
            for done in fsyncs:
                done.result()  # every file is on disk before the manifest vouches for it
        manifest = {k: v.result() if isinstance(v, Future) else v for k, v in manifest.items()}
        body = sign({"format": FORMAT, **manifest, "step": step, "files": entries})
        write_file(tmp / MANIFEST, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
        fsync_path(tmp)
        if final.exists() or final.is_symlink():
            # A folder of this step exists (a rerun of the step after a resume from an older one).
            # It is never deleted whole: one that verifies gives up only the files its manifest lists
            # (anything a user put there stays, set aside); one that does not verify is set aside as it is.
            old, why = _take_out_of_the_way(root, final)
            os.replace(tmp, final)
            fsync_path(root)
            if why is None:
                left = retire(old)
                if left:
                    kept = set_aside(root, old, final.name)
                    log.warning("step %d: the previous %s held files the trainer did not write (%s): moved to %s",
                                step, final.name, ", ".join(left), kept)
            else:
                log.warning("step %d: the previous %s did not verify (%s); moved to %s, not deleted", step, final.name, why, old)
        else:
            os.replace(tmp, final)
        fsync_path(root)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):
            raise CheckpointError(f"saving step {step} to {final} failed: {type(e).__name__}: {e}") from e
        raise
    return final


def _take_out_of_the_way(root: Path, final: Path) -> tuple[Path, str | None]:
    """Move the existing `final` out of its name: (where it went, None) when it verifies (a
    temporary name, to be retired), or (its place under moved_aside/, the reason) when it does not."""
    try:
        if final.is_symlink():
            raise CheckpointError(f"{final}: a symbolic link")
        verify(final, foreign_ok=True)  # its own files verify: retire them; what else is there is set aside
    except CheckpointError as e:
        return set_aside(root, final, final.name), str(e)
    trash = root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    os.replace(final, trash)
    return trash, None


def set_aside(root: Path, folder: Path, name: str) -> Path:
    """Move `folder` whole to root/moved_aside/<name>-<UTC time>; fsynced. The caller logs why."""
    aside = root / MOVED_ASIDE
    aside.mkdir(exist_ok=True)
    dest = aside / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:4]}"
    os.replace(folder, dest)
    fsync_path(aside)
    fsync_path(root)
    return dest


def retire(folder: Path) -> list[str]:
    """Delete a verified checkpoint's own files: its manifest first (from then on it is no
    checkpoint), then each file the manifest listed, then the folder if nothing else is in it.
    Returns the names of what was left (files a user put there), never touched. A folder with a
    symbolic link in it (itself, its state/, a file) is refused before anything is deleted.
    A folder already out of discovery's sight (`.trash-*`) keeps its manifest to the last, so that
    a retire cut short is finished by clear_temporaries at the next start."""
    no_links(folder)
    body = read_manifest(folder)
    last = folder.name.startswith(_TRASH_PREFIX)
    if not last:
        (folder / MANIFEST).unlink()
    for name in body["files"]:
        (folder / name).unlink(missing_ok=True)
    if last:
        (folder / MANIFEST).unlink()
    state = folder / STATE
    if state.is_dir() and not state.is_symlink() and not any(state.iterdir()):
        state.rmdir()
    left = sorted(p.name for p in folder.iterdir())
    if not left:
        folder.rmdir()
    return left


def retire_later(root: Path, folder: Path, later) -> None:
    """Take a verified checkpoint out of discovery's sight now (renamed `.trash-*`, atomic, the
    parent fsynced) and delete its files with `later(fn)` (a helper thread: deleting a checkpoint's
    gigabytes is not the save's time). What a user put in it is moved to moved_aside/, as retire's
    callers do; a deletion that fails is left, with a warning, for clear_temporaries."""
    no_links(folder)
    trash = root / f"{_TRASH_PREFIX}{folder.name}-{uuid.uuid4().hex[:8]}"
    os.replace(folder, trash)
    fsync_path(root)

    def finish() -> None:
        try:
            left = retire(trash)
            if left:
                kept = set_aside(root, trash, folder.name)
                log.warning("pruned the checkpoint files of %s; what the trainer did not write in it (%s) moved to %s",
                            folder, ", ".join(left), kept)
        except (CheckpointError, OSError) as e:
            log.warning("pruning %s: %s; what is left of it (%s) is removed at the next start", folder, e, trash)

    later(finish)


def _remove(path: Path) -> None:
    """Delete a folder this trainer made; a symbolic link is unlinked, never followed."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(root: Path, warn: bool = False) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_*` folder under root, newest first (validity not checked).
    A `step_*` that is a symbolic link is never followed (skipped, with a warning when `warn`)."""
    if not root.is_dir() or root.is_symlink():
        return []
    found = []
    for p in root.iterdir():
        if not (m := _NAME.match(p.name)):
            continue
        if p.is_symlink():
            if warn:
                log.warning("skipping %s: a symbolic link (checkpoints are never followed through links)", p)
            continue
        if p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def scan(root: Path, verify_all: bool = False) -> tuple[Path | None, list[tuple[int, Path, str | None]]]:
    """The newest checkpoint under `root` that verifies (or None), and the checkpoints looked at,
    newest first, each with its verification error (None: it verifies). Without `verify_all` the
    scan stops at the first that verifies."""
    newest, listing = None, []
    for step, folder in list_checkpoints(root, warn=True):
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
    return run / CHECKPOINTS if (run / CHECKPOINTS).is_dir() else run


def find_checkpoint(path: Path, verify_all: bool = False) -> tuple[Path, dict, list[tuple[int, Path, str | None]]]:
    """(folder, verified manifest, listing): `path` itself when it is a checkpoint folder (it must
    verify), else the newest checkpoint of a run folder that verifies, with the checkpoints looked
    at (all of them with `verify_all`). The one way the tools find a checkpoint."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path, verify(path), []
    root = checkpoints_root(path)
    newest, listing = scan(root, verify_all)
    if newest is None:
        skipped = [f"{p}: a symbolic link (checkpoints are never followed through links)"  # named, never followed
                   for p in sorted(root.iterdir()) if _NAME.match(p.name) and p.is_symlink()] if root.is_dir() else []
        if not listing and not skipped:
            raise NoCheckpoint(f"{path}: no checkpoint (looked in {root}): give a run folder or one of its checkpoints/step_* folders")
        raise CheckpointError(f"{path}: no valid checkpoint (looked in {root}): "
                              + "; ".join([f"step {step}: {error}" for step, _, error in listing if error] + skipped)[:2000])
    manifest = read_manifest(newest)  # scan verified it
    for step, folder, error in listing:
        if error is not None and step > manifest["step"]:
            log.warning("skipped checkpoint step %d, newer than the one used: %s", step, error)
    log.info("using checkpoint step %d: %s", manifest["step"], newest)
    return newest, manifest, listing


def clear_temporaries(root: Path) -> list[Path]:
    """Remove what killed saves left behind (never loaded, never counted): a save's temporary folder
    (only the trainer's files). A replaced checkpoint caught on its way out (`.trash-*`) gives up
    only the files its manifest lists, like any retired checkpoint; what else is in it is moved to
    moved_aside/, never deleted."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                _remove(p)
                removed.append(p)
            elif p.name.startswith(_TRASH_PREFIX):
                try:
                    left = retire(p) if not p.is_symlink() else [p.name]
                except (CheckpointError, OSError):
                    left = [p.name]
                if left:
                    kept = set_aside(root, p, p.name.removeprefix(_TRASH_PREFIX))
                    log.warning("%s held files the trainer did not write (%s): moved to %s", p, ", ".join(left), kept)
                removed.append(p)
    return removed


def prune(root: Path, keep: int, owned: set[Path], later=None) -> list[Path]:
    """Retire all but the newest `keep` valid checkpoints, oldest first. Call only after publishing.
    `later`: run the deletion of their files through it (retire_later), after they left their names.

    Only checkpoints in `owned` (this run verified or published them) count and may go; another
    `step_*` folder is verified first and joins `owned` when it passes. A folder that does not
    verify is reported, never counted toward `keep`, never deleted; links are never followed.
    Retiring deletes only the files the manifest lists: a folder that also holds something else
    (an export a user wrote into it) stays with that, and a warning names it."""
    valid = []
    for _, p in list_checkpoints(root):
        if p not in owned:
            if not (p / MANIFEST).exists() and not any((p / name).exists() for name in FILES):
                continue  # no checkpoint any more: what a user left in a retired one (warned about then)
            try:
                verify(p)
                owned.add(p)
            except CheckpointError as e:
                log.warning("not pruning %s: it does not verify (%s); left for you to inspect", p, e)
                continue
        valid.append(p)
    removed = []
    for p in reversed(valid[keep:]):
        try:
            left = retire(p) if later is None else retire_later(root, p, later) or []
        except CheckpointError as e:  # e.g. a link put in it since it was published: nothing deleted, nothing followed
            log.warning("not pruning %s: %s; left for you to inspect", p, e)
            owned.discard(p)
            continue
        if left:
            log.warning("pruned the checkpoint files of %s; left it there with what the trainer did not write: %s", p, ", ".join(left))
        owned.discard(p)
        removed.append(p)
    return removed


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if path.is_symlink():
        raise CheckpointError(f"{path}: a symbolic link; refused")
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (an unfinished or foreign folder)") from None
    except OSError as e:  # a folder where the file should be, no permission, an I/O error
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: does not parse ({e})") from None
    return check_manifest(body, path, folder.name, folder)


KEY_VARIABLE = "MINIMIND_CHECKPOINT_KEY"
"""The environment variable that holds the key of signed checkpoints (never a config value or an argument:
those are written into every manifest and shown by `ps`; the key is never logged or written)."""
MAC = "mac"
"""The manifest field that holds "hmac-sha256:<hex>" of the manifest's content, when a key is set."""
UNSIGNED = (MAC, "objects")
"""What the MAC does not cover: itself, and in object storage where the save's files lie (a downloaded copy
drops it; every file is still checked against the sha256 the signed content lists)."""


def signing_key() -> bytes | None:
    """The key from MINIMIND_CHECKPOINT_KEY, or None when it is unset or empty (nothing is signed or checked)."""
    key = os.environ.get(KEY_VARIABLE, "")
    return key.encode("utf-8") if key else None


def mac_of(body: dict, key: bytes) -> str:
    """HMAC-SHA256 of a manifest's content: every field but UNSIGNED, as sorted compact JSON."""
    content = json.dumps({k: v for k, v in body.items() if k not in UNSIGNED}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "hmac-sha256:" + hmac.new(key, content.encode("ascii"), hashlib.sha256).hexdigest()


def sign(body: dict) -> dict:
    """`body` with its MAC when a key is set (docs/run_folder.md, "Signed checkpoints"); as it is without one."""
    key = signing_key()
    if key is None:
        return body
    body = json.loads(json.dumps(body))  # the content as it will be read back (tuples as lists): what the reader hashes
    return {**body, MAC: mac_of(body, key)}


def check_mac(body: dict, path) -> None:
    """With a key set, a manifest whose MAC is missing or is not its content's under that key is refused
    (CheckpointError: a run falls back, a tool exits 1, naming the manifest); without one, nothing is checked."""
    key = signing_key()
    if key is None:
        return
    got = body.get(MAC)
    if not isinstance(got, str) or not hmac.compare_digest(got, mac_of(body, key)):
        why = "carries no MAC (written without a key)" if got is None else "has a MAC that is not its content's under this key (edited, or signed with another key)"
        raise CheckpointError(f"{path}: {why}; with {KEY_VARIABLE} set only manifests signed with that key are loaded")


def check_manifest(body, path, name: str, folder=None) -> dict:
    """A parsed manifest (at `path`, of the step folder called `name`) checked: a checkpoint
    manifest of a format this trainer reads, listing only its own plain file names, of its folder's step."""
    if not isinstance(body, dict) or not isinstance(body.get("files"), dict) or not isinstance(body.get("step"), int):
        raise CheckpointError(f"{path}: not a checkpoint manifest (no 'files' mapping or integer 'step')")
    if body.get("format") == 1:
        raise OldLayout(f"{folder}: written in the earlier layout (a resume.pth file, manifest format 1), which this trainer "
                        f"no longer loads; convert it once, in place (nothing is deleted): {CONVERT} {folder.parent.parent}")
    if body.get("format") not in READS:
        raise CheckpointError(f"{path}: manifest format {body.get('format')!r}; this trainer reads formats {', '.join(map(str, READS))}")
    check_mac(body, path)
    for name_, entry in body["files"].items():
        # Confined to its folder: plain names of the files this trainer writes, nothing else.
        if name_ not in FILES and not STATE_NAME.match(name_):
            raise CheckpointError(f"{path}: lists {name_!r}, which is not a file this trainer writes (expected {', '.join(sorted(FILES))}"
                                  f" or {STATE}/__<rank>_<n>.distcp and {STATE}/{METADATA})")
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"{path}: the entry for {name_} is not {{'bytes': int, 'sha256': str}}")
    if f"{STATE}/{METADATA}" not in body["files"]:
        raise CheckpointError(f"{path}: does not list {STATE}/{METADATA}")
    m = _NAME.match(name)
    if m and int(m.group(1)) != body["step"]:
        raise CheckpointError(f"{path}: says step {body['step']}, but the folder is {name}")
    return body


def verify(folder: Path, only=None, foreign_ok: bool = False) -> dict:
    """The manifest of `folder` after checking every file's size and sha256 against it (of the
    files for which `only(name)` is true, when given). `foreign_ok`: files the manifest does not
    list may be there too (a folder about to be retired keeps them; nothing loads from it)."""
    body = listed_files_present(folder, foreign_ok)
    for name, entry in body["files"].items():
        if only is not None and not only(name):
            continue
        sha = hashlib.sha256()
        with open(folder / name, "rb") as f:
            while block := f.read(1 << 22):
                sha.update(block)
        check_sha(folder / name, sha.hexdigest(), entry)
    return body


def no_links(folder: Path) -> None:
    """Neither `folder`, nor its state/, nor anything in either is a symbolic link (CheckpointError
    naming it): a step folder is read, verified, replaced and retired without following a link."""
    refuse_links(folder)
    for sub in (folder, folder / STATE):
        if sub.is_dir() and not sub.is_symlink():
            for p in sub.iterdir():
                refuse_links(p)
        else:
            refuse_links(sub)


def listed_files_present(folder: Path, foreign_ok: bool = False) -> dict:
    """The manifest of `folder`, once nothing in it is a link (no_links), every file it lists is
    there with its size and (unless `foreign_ok`) nothing else is in the folder or its state/."""
    no_links(folder)
    body = read_manifest(folder)
    check_files(folder, body)
    if not foreign_ok:
        check_foreign(folder, body)
    return body


def check_foreign(folder: Path, body: dict) -> None:
    """Nothing in the step folder or its state/ that the manifest does not list: DCP would read any
    file of state/, and a folder someone added to is not the folder that was published."""
    listed = set(body["files"]) | {MANIFEST, STATE}
    found = [p.name for p in folder.iterdir() if p.name not in listed]
    state = folder / STATE
    if state.is_dir() and not state.is_symlink():
        found += [f"{STATE}/{p.name}" for p in state.iterdir() if f"{STATE}/{p.name}" not in body["files"]]
    elif state.exists():
        found.append(STATE)
    if found:
        raise CheckpointError(f"{folder}: holds {', '.join(sorted(found))}, not in its manifest; only the files a manifest lists "
                              f"may be in a checkpoint (move them out to use it)")


def check_sha(path, sha: str, entry: dict) -> None:
    if sha != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256 {sha[:12]}... does not match the manifest's {entry['sha256'][:12]}... (corrupted)")


def check_files(folder: Path, body: dict) -> None:
    """Every file the manifest lists is there, a plain file of the listed size (no byte is read)."""
    for name, entry in body["files"].items():
        path = folder / name
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in the manifest)")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")


def read_verified(folder: Path, name: str, body: dict | None = None) -> bytes:
    """The bytes of `folder/name`, read once and returned only if their size and sha256 are the manifest's."""
    from .files import verified_bytes

    body = body or listed_files_present(folder)
    try:
        return verified_bytes(folder, name, body["files"])
    except FileError as e:
        raise CheckpointError(str(e)) from None


def read_metadata(folder: Path, body: dict):
    """DCP's metadata of a checkpoint folder, its bytes verified, unpickled through the allow-list."""
    from . import format

    name = f"{STATE}/{METADATA}"
    try:
        return format.read_metadata(read_verified(folder, name, body), folder / name)
    except format.FormatError as e:
        raise CheckpointError(str(e)) from None


def read_tensors(folder: Path, body: dict, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` ("model.": the fp32 weights) of a checkpoint folder whose manifest
    is `body`, whole, on one process: each file read once, used only if its sha256 is the manifest's."""
    from . import format

    metadata = read_metadata(folder, body)
    try:
        return format.read_tensors(folder, body["files"], metadata, prefix)
    except format.errors() as e:  # DCP wraps what the reader raised
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else e
        raise CheckpointError(str(cause) if isinstance(cause, (format.FormatError, CheckpointError)) else
                              f"{folder}: the states cannot be read ({type(cause).__name__}: {cause})") from None


def _refusal(path: Path, e: Exception) -> CheckpointError:
    # torch's message suggests retrying with weights_only=False: exactly what must not happen.
    found = re.search(r"Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+", str(e))
    return CheckpointError(
        f"{path}: not a plain checkpoint: it needs pickled objects beyond tensors and containers; "
        f"refused without running them{f' ({found.group(0)})' if found else ''}")


def safe_load(path: Path, map_location: Any = "cpu") -> Any:
    """`torch.load(weights_only=True)`: tensors, numbers, strings and containers only (docs/design.md I10).

    A file that needs anything else to unpickle is refused; the unpickler stops before any of its
    code runs.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(path, e) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def safe_load_bytes(data: bytes, path: Path, map_location: Any = "cpu") -> Any:
    """`safe_load` of bytes already read (and hashed) from `path`: nothing is read twice."""
    import io

    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(path, e) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


IDENTITY = 2
"""The version of `model_sha256` a manifest or a pin records under "identity"; one without it holds
`legacy_model_sha256` (the releases before: fp32 bytes in state-dict order, no names, no shapes)."""


def _fp32(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to("cpu", torch.float32).contiguous()
    return t


def model_sha256(state_dict: dict[str, torch.Tensor], architecture: dict) -> str:
    """A model's identity (docs/design.md "One model identity"): sha256 over the architecture fields
    that change the function the weights compute (`ModelConfig.architecture()`, as sorted JSON), then
    for every tensor in sorted name order its name, shape and fp32 bytes. The same weights give the
    same identity however they were read (a dict's order, a file's layout); another name, shape or
    head layout gives another."""
    h = hashlib.sha256(json.dumps({"identity": IDENTITY, "architecture": architecture}, sort_keys=True).encode() + b"\n")
    for name in sorted(state_dict):
        t = _fp32(state_dict[name])
        h.update(f"{name}\0float32\0{list(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy, no tensor op
    return h.hexdigest()


def legacy_model_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """The earlier releases' hash (fp32 bytes in the dict's order, no names): kept only to check
    the pins and manifests those releases wrote (their records carry no "identity")."""
    h = hashlib.sha256()
    for t in state_dict.values():
        h.update(_fp32(t).reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def identity_matches(record: dict, key: str, state_dict: dict[str, torch.Tensor], architecture: dict) -> tuple[bool, str]:
    """Whether `state_dict` is the model `record[key]` names, by the identity version the record was
    written with; returns (equal, the hash computed the same way)."""
    got = model_sha256(state_dict, architecture) if record.get("identity") == IDENTITY else legacy_model_sha256(state_dict)
    return got == record.get(key), got


def optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """An optimizer state dict's tensors (`{"state": {param: {key: tensor}}}`, by parameter name) as
    one flat mapping "<param>.<key>" -> tensor: the form `optimizer_sha256` hashes, and the one DCP's
    metadata names them by under "optimizer.state." (format.read_tensors)."""
    return {f"{param}.{key}": v for param, entries in (state.get("state") or {}).items() for key, v in entries.items()
            if isinstance(v, torch.Tensor)}


_digests = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="ckpt-digest")
"""The optimizer identity's per-tensor sha256s, in parallel (hashlib releases the GIL over a buffer)."""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def optimizer_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The optimizer state's identity (the manifest's "optimizer_sha256"): sha256 over one line per
    tensor of `optimizer_tensors` in sorted name order, its name, dtype, shape and the sha256 of its
    bytes as stored (those computed in parallel; a sharded tensor gathered whole one at a time, on
    every rank alike). What a resume loaded is checked against it, as the model's identity: a
    metadata or a file that hands one parameter's moments to another, with the hashes rewritten to
    match, is refused."""
    names = sorted(tensors)
    if any(hasattr(tensors[n], "full_tensor") for n in names):  # shards: each gathered (a collective), hashed and dropped in turn
        digests = {n: _digest(tensors[n].full_tensor() if hasattr(tensors[n], "full_tensor") else tensors[n]) for n in names}
    else:
        digests = {n: f.result() for n, f in {n: _digests.submit(_digest, tensors[n]) for n in names}.items()}
    h = hashlib.sha256(b"optimizer-identity 1\n")
    for n in names:
        h.update(f"{n}\0{tensors[n].dtype}\0{list(tensors[n].shape)}\0{digests[n]}\n".encode())
    return h.hexdigest()


class LocalStore:
    """The checkpoints of a run folder on a local (POSIX) filesystem: what CheckpointManager calls
    (checkpoint/remote.py: RemoteStore is its twin in object storage). Each method is this module's
    function of the same step of the protocol."""

    def __init__(self, run: Path) -> None:
        self.run, self.root = Path(run), Path(run) / CHECKPOINTS

    def list_steps(self, warn: bool = False) -> list[tuple[int, Path]]:
        return list_checkpoints(self.root, warn)

    def listed(self, folder: Path) -> dict:
        return listed_files_present(folder)

    def files(self, folder: Path, manifest: dict) -> Path:
        return folder

    def verify(self, folder: Path, manifest: dict | None = None, only=None) -> dict:
        return verify(folder, only)

    def clear(self) -> list[str]:
        return [f"{p}, left by an interrupted {'save' if p.name.startswith(TMP_PREFIX) else 'prune or replacement'}"
                for p in clear_temporaries(self.root)]

    def staging(self, step: int, token: str) -> Path:
        return self.root / f"{TMP_PREFIX}{step_dir_name(step)}-{token}"

    def discard(self, tmp: Path) -> None:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

    def make_durable(self, paths) -> None:
        for path in paths:  # the log up to this step is as durable as this checkpoint (docs/design.md I11)
            if Path(path).exists():
                fsync_path(Path(path))

    def publish(self, step: int, files: dict, manifest: dict, tmp: Path, written: dict) -> Path:
        return publish(self.root, step, files, manifest, tmp=tmp, written=written)

    def prune(self, keep: int, owned: set, later=None) -> list[Path]:
        return prune(self.root, keep, owned, later)

