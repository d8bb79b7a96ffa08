"""Checkpoints in object storage: publishing without rename (docs/object_storage.md).

    PREFIX/checkpoints/latest.json                          the pointer to the newest step: moved by compare-and-swap
    PREFIX/checkpoints/step_00000060/manifest.json          created last, create-only: the step exists from then on
    PREFIX/checkpoints/step_00000060/<save>/state/...       the files it lists (<save>: the saving launch's token,
    PREFIX/checkpoints/step_00000060/<save>/weights_fp16...    the manifest's "objects"); never written twice
    PREFIX/checkpoints/step_00000060/pruning                a step being pruned: out of discovery, finished at the next start

A save (every rank) uploads its files under the step's <save> prefix (checkpoint/files.py:
UploadWriter, multipart, each part with its SHA-256, our sha256 of the whole in the same pass);
the coordinator then checks the lease, creates the manifest with `If-None-Match: *` (a second
writer of the step gets 412 and stops, naming it), advances the pointer with `If-Match` on the
etag it last saw (a writer that lost the folder gets 412), and only then prunes: a pruned step
gets its `pruning` marker, loses the files its manifest lists, then the manifest, then the marker;
never the pointer's target. A step exists only if its manifest exists and every file it lists
verifies: discovery lists the manifests (strongly consistent), checks each listed object's size
from the listing, and a load hashes every byte it reads. Our sha256 decides, never an ETag.
"""
from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from common.store import Conflict, RemotePath, StoreError, StoreRefused, describe_holder

from . import storage
from .files import CheckpointError, open_read, write_file

log = logging.getLogger("minimind")
POINTER = "latest.json"
PRUNING = "pruning"
_requests = ThreadPoolExecutor(max_workers=8, thread_name_prefix="store-request")
"""Independent small requests of one step of the protocol, sent at once (the start's listing and manifests)."""


class RemoteStore:
    """The checkpoints of a run folder in the store: what CheckpointManager calls (storage.LocalStore's twin)."""

    def __init__(self, run: RemotePath) -> None:
        self.run = run
        self.root = run / storage.CHECKPOINTS
        self.store = run.store
        self.pointer_etag: str | None = None
        """The pointer's etag as this writer last saw or wrote it: the next advance must find it unchanged."""
        self._listing: dict[str, int] = {}
        self._manifests: dict[str, dict] = {}  # the manifests read, by their step folder's URL

    # ------------------------------------------------------------------ listing
    def _list(self) -> dict[str, int]:
        self._listing = self.store.list(f"{self.root.key}/")
        return self._listing

    def list_steps(self, warn: bool = False) -> list[tuple[int, RemotePath]]:
        """(step, step folder) of every published step not being pruned, newest first."""
        names: dict[str, set[str]] = {}
        for key in self._list():
            parts = key[len(self.root.key) + 1:].split("/")
            if len(parts) == 2 and storage.NAME.match(parts[0]):
                names.setdefault(parts[0], set()).add(parts[1])
        return sorted(((int(name[5:]), self.root / name) for name, leaves in names.items()
                       if storage.MANIFEST in leaves and PRUNING not in leaves), key=lambda x: x[0], reverse=True)

    def read_manifest(self, folder: RemotePath) -> dict:
        """The manifest of `folder`, checked (storage.check_manifest); one this store read before is not
        fetched again: a manifest is created once, create-only, and only deleted (a pruned step)."""
        if folder.url in self._manifests:
            return copy.deepcopy(self._manifests[folder.url])
        got = folder.store.get((folder / storage.MANIFEST).key)  # the folder's own bucket (checkpoint.resume may name another)
        if got is None:
            raise CheckpointError(f"{folder / storage.MANIFEST}: missing")
        try:
            body = json.loads(got[0])
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{folder / storage.MANIFEST}: does not parse ({e})") from None
        body = storage.check_manifest(body, folder / storage.MANIFEST, folder.name)
        if not isinstance(body.get("objects"), str) or not storage.TOKEN.match(body["objects"]):
            raise CheckpointError(f"{folder / storage.MANIFEST}: no 'objects' prefix of its files (a manifest in the store names them)")
        self._manifests[folder.url] = copy.deepcopy(body)
        return body

    def files(self, folder, manifest: dict):
        """Where the files a manifest lists lie: its step folder's <save> prefix."""
        return folder / manifest["objects"]

    def listed(self, folder: RemotePath) -> dict:
        """The manifest of `folder` once every file it lists is in the store at its listed size (no byte read yet)."""
        body = self.read_manifest(folder)
        where = self.files(folder, body)
        listing = self._listing if any(k.startswith(f"{where.key}/") for k in self._listing) else where.store.list(f"{where.key}/")
        for name, entry in body["files"].items():
            size = listing.get(f"{where.key}/{name}")
            if size is None:
                raise CheckpointError(f"{where / name}: missing (listed in the manifest)")
            if size != entry["bytes"]:
                raise CheckpointError(f"{where / name}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
        return body

    def verify(self, folder: RemotePath, manifest: dict | None = None, only=None) -> dict:
        """The manifest after every listed file (those `only(name)` accepts) was read and its sha256 is the manifest's."""
        body = manifest or self.listed(folder)
        where = self.files(folder, body)
        for name, entry in body["files"].items():
            if only is not None and not only(name):
                continue
            f, size = open_read(where, name, CheckpointError)
            sha = hashlib.sha256()
            with f:
                while block := f.read(8 << 20):
                    sha.update(block)
            if size != entry["bytes"]:
                raise CheckpointError(f"{where / name}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
            storage.check_sha(where / name, sha.hexdigest(), entry)
        return body

    # ------------------------------------------------------------------ the start: what killed saves left
    def clear(self) -> list[str]:
        """The lease holder, before anything is loaded: abort the multipart uploads killed saves left,
        finish the prunes cut short, delete the objects of saves that never published (a <save>
        prefix no manifest names). Returns what was removed."""
        removed = []
        # Three requests at once: the pointer (its etag: this writer's first advance must find it unchanged),
        # the unfinished uploads and the listing (which is of the objects those uploads never made).
        pointer, uploads, listing = [_requests.submit(fn) for fn in (self.read_pointer, lambda: self.store.uploads(f"{self.root.key}/"),
                                                                     self._list)]
        pointer.result()
        for key, upload in uploads.result():
            self.store.abort(key, upload)
            removed.append(f"{self.store.url(key)} (an unfinished upload)")
        listing = listing.result()
        steps: dict[str, dict[str, list[str]]] = {}
        for key in listing:
            parts = key[len(self.root.key) + 1:].split("/", 2)
            if len(parts) >= 2 and storage.NAME.match(parts[0]):
                steps.setdefault(parts[0], {}).setdefault(parts[1] if len(parts) == 3 else "", []).append(key)
        # every published step's manifest, at once (kept: discovery reads them next)
        leaves = {name: {k.rsplit("/", 1)[1] for k in groups.get("", [])} for name, groups in steps.items()}
        manifests = {name: _requests.submit(self.read_manifest, self.root / name) for name in steps
                     if storage.MANIFEST in leaves[name] and PRUNING not in leaves[name]}
        concurrent.futures.wait(manifests.values())
        for name, groups in steps.items():
            folder = self.root / name
            if PRUNING in leaves[name]:
                self._retire(folder, resumed=True)
                removed.append(f"{folder} (a prune cut short)")
                continue
            keep = None
            if name in manifests:
                try:
                    keep = manifests[name].result()["objects"]
                except CheckpointError:
                    continue  # a damaged manifest: its folder is left whole for a person to look at
            for token, keys in groups.items():
                if token and token != keep:
                    for key in keys:
                        self.store.delete(key)
                    removed.append(f"{folder / token} (a save that never published)")
        return removed

    # ------------------------------------------------------------------ saving
    def staging(self, step: int, token: str) -> RemotePath:
        """Where every rank uploads the files of step `step` in this launch (the same on every rank)."""
        return self.root / storage.step_dir_name(step) / token

    def discard(self, tmp: RemotePath) -> None:
        """A save that failed before its manifest was created: its objects go (best effort: what is
        left is removed at the next start). One whose manifest names them is published: kept."""
        try:
            got = self.store.get((tmp.parent / storage.MANIFEST).key)
            if got is not None and json.loads(got[0]).get("objects") == tmp.name:
                return
            for key in self.store.list(f"{tmp.key}/"):
                self.store.delete(key)
        except (StoreError, StoreRefused) as e:
            log.warning("could not remove the objects of a failed save under %s (%s); the next start removes them", tmp, e)

    def read_pointer(self) -> dict | None:
        got = self.store.get((self.root / POINTER).key)
        if got is None:
            self.pointer_etag = None
            return None
        self.pointer_etag = got[1]
        try:
            return json.loads(got[0])
        except ValueError:
            return {}

    def make_durable(self, paths) -> None:
        """The run's files up to this step (metrics.jsonl, config.yaml) into the store before the step is published."""
        for path in paths:
            path = Path(path)
            if path.is_file():
                self.store.put((self.run / path.name).key, path.read_bytes())

    def publish(self, step: int, files: dict, manifest: dict, tmp: RemotePath, written: dict) -> RemotePath:
        """The coordinator: every rank's files are uploaded under `tmp`; upload `files` (the tokenizer's)
        there, create the manifest create-only, move the pointer by compare-and-swap. Returns the step folder."""
        folder = self.root / storage.step_dir_name(step)
        try:
            entries = {name: e.result() if isinstance(e, Future) else e for name, e in (written or {}).items()}
            for name, obj in files.items():
                entries[name] = write_file(tmp / name, obj)
            manifest = {k: v.result() if isinstance(v, Future) else v for k, v in manifest.items()}
            body = {**storage.sign({"format": storage.FORMAT, **manifest, "step": step, "files": entries}), "objects": tmp.name}
            if self.store.lease is not None:
                self.store.lease.check()  # a writer that lost the folder publishes nothing
            data = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
            try:
                self.store.put((folder / storage.MANIFEST).key, data, create=True, sha256=hashlib.sha256(data).hexdigest())
            except Conflict:
                other = self.read_pointer() or {}
                raise CheckpointError(f"{folder / storage.MANIFEST}: step {step} was published by another writer first "
                                      f"({describe_holder(other.get('holder') or {})}); nothing of it was overwritten. Two "
                                      f"runs are writing this folder: this one stops") from None
            self.advance(step, tmp.name, hashlib.sha256(data).hexdigest())
        except Conflict as e:
            raise CheckpointError(str(e)) from None
        return folder

    def advance(self, step: int, objects: str, manifest_sha256: str) -> None:
        """Move the pointer to `step`: If-Match on the etag this writer last saw (If-None-Match when it saw none)."""
        from common.store import holder_record

        record = {"step": step, "folder": storage.step_dir_name(step), "objects": objects, "manifest_sha256": manifest_sha256,
                  "holder": holder_record(), "updated_unix": round(time.time(), 3)}
        data = (json.dumps(record, indent=1) + "\n").encode()
        try:
            if self.pointer_etag is None:
                self.pointer_etag = self.store.put((self.root / POINTER).key, data, create=True)
            else:
                self.pointer_etag = self.store.put((self.root / POINTER).key, data, if_match=self.pointer_etag)
        except Conflict:
            other = self.read_pointer() or {}
            raise CheckpointError(f"{self.root / POINTER}: moved by another writer to step {other.get('step')} "
                                  f"({describe_holder(other.get('holder') or {})}) since this run last saw it; step {step} is "
                                  f"published but not pointed to. Two runs are writing this folder: this one stops") from None

    # ------------------------------------------------------------------ pruning
    def prune(self, keep: int, owned: set, later=None) -> list[RemotePath]:
        """Retire all but the newest `keep` of the steps this run published or verified, oldest first,
        once the pointer has moved past them; never the pointer's target."""
        pointer = self.read_pointer() or {}
        target = pointer.get("step")
        for _, folder in self.list_steps():
            if folder not in owned:  # another launch's step: counted (and prunable) once it verifies, as on a disk
                try:
                    self.verify(folder)
                    owned.add(folder)
                except CheckpointError as e:
                    log.warning("not pruning %s: it does not verify (%s); left for you to inspect", folder, e)
        steps = sorted(((int(p.name[5:]), p) for p in owned), key=lambda x: x[0], reverse=True)
        removed = []
        for step, folder in reversed(steps[keep:]):
            if target is None or step >= target:
                continue  # the pointer has not moved past it
            try:
                self._retire(folder)
            except (CheckpointError, StoreError) as e:
                log.warning("not pruning %s: %s; left for the next start", folder, e)
                continue
            owned.discard(folder)
            removed.append(folder)
        return removed

    def _retire(self, folder: RemotePath, resumed: bool = False) -> None:
        """The `pruning` marker, then every file the manifest lists, then the manifest, then the marker."""
        if not resumed:
            self.store.put((folder / PRUNING).key, b"")
        self._manifests.pop(folder.url, None)  # read again: what is deleted is what the store lists now
        try:
            body = self.read_manifest(folder)
        except CheckpointError:
            body = None
        if body is not None:
            where = self.files(folder, body)
            for name in body["files"]:
                self.store.delete((where / name).key)
            self.store.delete((folder / storage.MANIFEST).key)
        for key in self.store.list(f"{folder.key}/"):  # what is left under it: a killed save's objects
            if not key.endswith(f"/{PRUNING}"):
                self.store.delete(key)
        self.store.delete((folder / PRUNING).key)
        # Gone: neither its manifest (read above) nor its objects (in the start's listing) are remembered, so a
        # step named later (checkpoint.resume) is found missing, as the store says, not as this store read it.
        self._manifests.pop(folder.url, None)
        self._listing = {k: v for k, v in self._listing.items() if not k.startswith(f"{folder.key}/")}


def split(url: str) -> tuple[str, str | None]:
    """A run folder's or a checkpoint's URL as (the run folder's URL, the step folder's name or None)."""
    run, _, step = str(url).rstrip("/").rpartition(f"/{storage.CHECKPOINTS}/")
    return (run, step) if run and storage.NAME.match(step) else (str(url).rstrip("/"), None)


def fetch(url: str, dest: Path, step_folder: str | None = None, checkpoint: bool = True) -> Path:
    """A local copy of a run folder in the store, for the commands that read one (inspect, compare,
    export, generate, chat, serve, eval, plot, status): its status.json, config.yaml and metrics.jsonl,
    and the newest checkpoint that verifies (or `step_folder`), every file hashed as it comes down and
    kept only when its sha256 is the manifest's. A copy already there is reused when its manifest is
    the same. Returns the local run folder."""
    from common.files import atomic_write

    run = RemotePath(url)
    remote = RemoteStore(run)
    remote.store.check()
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("status.json", "config.yaml", "metrics.jsonl"):
        got = remote.store.get((run / name).key)
        if got is not None:
            atomic_write(dest / name, got[0])
        else:
            (dest / name).unlink(missing_ok=True)
    steps = remote.list_steps()
    if not steps and not any(k for k in remote.store.list(f"{run.key}/" if run.key else "")):
        raise storage.NoCheckpoint(f"{url}: nothing there (expected a run folder)")
    if not checkpoint:  # the run's own files, and the published steps' manifests (what status lists)
        for step, folder in steps[:1]:
            got = remote.store.get((folder / storage.MANIFEST).key)
            (dest / storage.CHECKPOINTS / folder.name).mkdir(parents=True, exist_ok=True)
            atomic_write(dest / storage.CHECKPOINTS / folder.name / storage.MANIFEST, got[0] if got else b"{}")
        return dest
    faults = []
    for step, folder in steps:
        if step_folder and folder.name != step_folder:
            continue
        local = dest / storage.CHECKPOINTS / folder.name
        try:
            body = remote.listed(folder)
            if (local / storage.MANIFEST).is_file():
                try:
                    if json.loads((local / storage.MANIFEST).read_text()) == {k: v for k, v in body.items() if k != "objects"}:
                        return dest
                except ValueError:
                    pass
            _download(remote, folder, body, local)
            for other in (dest / storage.CHECKPOINTS).iterdir():  # the copy holds one checkpoint: the one fetched
                if other.name != folder.name and storage.NAME.match(other.name):
                    import shutil

                    shutil.rmtree(other, ignore_errors=True)
            return dest
        except CheckpointError as e:
            faults.append(f"step {step}: {e}")
            log.warning("skipped checkpoint step %d: %s", step, e)
    if step_folder and not faults:
        raise storage.NoCheckpoint(f"{url}: no {step_folder} in it")
    return dest


def _download(remote: RemoteStore, folder: RemotePath, body: dict, local: Path) -> None:
    import shutil
    import uuid

    from common.files import durable_tree

    where = remote.files(folder, body)
    tmp = local.parent / f"{storage.TMP_PREFIX}{folder.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for name, entry in body["files"].items():
            f, _ = open_read(where, name, CheckpointError)
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            sha = hashlib.sha256()
            with f, open(tmp / name, "wb") as out:
                while block := f.read(8 << 20):
                    sha.update(block)
                    out.write(block)
            storage.check_sha(where / name, sha.hexdigest(), entry)
        (tmp / storage.MANIFEST).write_text(json.dumps({k: v for k, v in body.items() if k != "objects"}, indent=1, sort_keys=True) + "\n")
        durable_tree(tmp)
        if local.exists():
            shutil.rmtree(local)
        tmp.rename(local)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
