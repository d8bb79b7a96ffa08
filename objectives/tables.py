"""Precomputed tables (DPO's reference log-probabilities, distillation's teacher top-k): built in chunks,
each published atomically and hashed in the table's own manifest, verified on every read.

A table is a folder beside the packed rows, named by what its figures are a function of (the rows'
fingerprint, the frozen model's identity, the autocast, the shape: `table_name`):

    <stem>.ref-<rows>-<model>-ddp-float32-S2-N48/manifest.json          {"chunks": {name: {sha256, bytes, rows}}}
    <stem>.ref-<rows>-<model>-ddp-float32-S2-N48/0000000003-0000000017.safetensors

A chunk holds some rows' items (`rows`, `offsets`: row j's items are `offsets[j]:offsets[j + 1]` of
every field) as safetensors (no timestamp: the same items, the same bytes). The rows a run reads,
sorted, are cut into groups of `chunk_rows` (a function of their count alone); each group's rows not
yet held are one chunk, computed by one rank (group g of a round on rank g mod W), gathered, written
by the writer, then listed in the manifest (written last, atomically). A stop signal during the
precompute (StopDuringSetup, exit 75) keeps every chunk of the finished rounds; the next launch
computes the same groups' remainders, so that the chunks, the manifest and every figure are the
same bits however many stops it took (docs/design.md I31).

A read hashes every listed chunk against the manifest: a chunk that differs, is missing or does not
parse, or a manifest that does not parse, is logged by name and its rows computed again (never
trained on). A chunk file the manifest does not list (a stop between the two writes) is ignored and
written again. All file I/O goes through `TableFiles`: a store (s3://) plugs in there.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.files import atomic_write
from common.outcome import Stopped, attempt
from data.sampler import make_order

log = logging.getLogger("minimind")
MANIFEST = "manifest.json"
FORMAT = 1
"""The table manifest's format."""
CHUNKS = 64
"""About this many chunks per precompute (at least MIN_ROWS rows each): a stop loses at most one round's."""
MIN_ROWS = 8


def table_files(dataset, fingerprint: dict, sha: str, shape: str, autocast: tuple[str, str], kind: str) -> TableFiles:
    """Beside the packed rows, named by what its figures are a function of: the packed rows' own
    fingerprint (the corpus's bytes, the tokenizer, the packing), the frozen model's identity, the
    autocast it ran under and the table's `shape` (DPO's sides, distillation's top-k); `kind`: whose
    table ("ref": DPO's reference, "teacher": distillation's)."""
    from data.remote import remote_of

    rows = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]
    stem = Path(dataset.bin_path).stem
    folder = Path(dataset.bin_path).with_name(f"{stem}.{kind}-{rows}-{sha[:16]}-{'-'.join(autocast)}-{shape}-N{dataset.start + len(dataset)}")
    url = remote_of(folder)  # rows packed into a cache in a store (data.cache_dir=s3://...): the table lives there too
    return StoreTableFiles(url) if url else TableFiles(folder)


def rows_read(num_samples: int, global_batch: int, seed: int, order: str, steps: int) -> np.ndarray:
    """The sorted indices of every row steps [0, steps) read (each epoch's order, docs/design.md I1):
    what a precomputed table must hold, the resume's remainder included."""
    per_epoch = num_samples // global_batch
    seen: list[np.ndarray] = []
    for epoch in range(-(-steps // per_epoch) if per_epoch else 0):
        n = min(steps - epoch * per_epoch, per_epoch) * global_batch
        seen.append(np.asarray(make_order(order, num_samples, seed, epoch).take(0, n), dtype=np.int64))
    return np.unique(np.concatenate(seen)) if seen else np.zeros(0, dtype=np.int64)


def chunk_rows(needed: int) -> int:
    """Rows per group of a precompute over `needed` rows: a function of the count alone."""
    return max(MIN_ROWS, math.ceil(needed / CHUNKS))


class TableFiles:
    """A table's files under one folder: read, write (atomic), list and remove by name. The one class
    that touches the table's storage; another store (an object store's prefix) is another class
    with these methods."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @property
    def name(self) -> str:
        return self.folder.name

    def __str__(self) -> str:
        return str(self.folder)

    def read(self, name: str) -> bytes | None:
        """A file's bytes, or None when there is none."""
        try:
            return (self.folder / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        """Publish `data` as `name`: a reader sees the old file or the new one, never a part."""
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(self.folder / name, data)

    def names(self) -> list[str]:
        """The files, sorted (none when the folder is absent)."""
        return sorted(p.name for p in self.folder.iterdir() if p.is_file()) if self.folder.is_dir() else []

    def stale(self, mark: str) -> list[str]:
        """Entries beside this table whose names start like its own up to `mark`'s end but which
        are other tables of the same kind: named by other rows (a repacked corpus), or an earlier
        release's single-file table (.npy/.npz)."""
        stem, rest = self.name.split(mark, 1)
        rows = rest.split("-")[0]
        return sorted(p.name for p in self.folder.parent.glob(f"{stem}{mark}*")
                      if p.name != self.name and (p.suffix in (".npy", ".npz") or p.name.split(mark, 1)[1].split("-")[0] != rows))

    def remove_sibling(self, name: str) -> None:
        """Delete a stale table (a file or a folder) beside this one."""
        path = self.folder.parent / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


class StoreTableFiles(TableFiles):
    """A table in an object store, beside the packed rows of a cache there (data.cache_dir=s3://...):
    the same files as objects under the table's prefix, each PUT whole (a reader sees the old object or
    the new one) with its SHA-256 checked by the store, the manifest put last as on a disk."""

    def __init__(self, url: str) -> None:
        from common.store import RemotePath

        self.folder = RemotePath(url)

    def read(self, name: str) -> bytes | None:
        got = self.folder.store.get((self.folder / name).key)
        return None if got is None else got[0]

    def write(self, name: str, data: bytes) -> None:
        self.folder.store.put((self.folder / name).key, data, sha256=hashlib.sha256(data).hexdigest())

    def names(self) -> list[str]:
        base = f"{self.folder.key}/"
        return sorted(k[len(base):] for k in self.folder.store.list(base) if "/" not in k[len(base):])

    def stale(self, mark: str) -> list[str]:
        stem, rest = self.name.split(mark, 1)
        rows, parent = rest.split("-")[0], f"{self.folder.parent.key}/"
        siblings = {k[len(parent):].split("/")[0] for k in self.folder.store.list(f"{parent}{stem}{mark}")}
        return sorted(n for n in siblings if n != self.name and (n.endswith((".npy", ".npz")) or n.split(mark, 1)[1].split("-")[0] != rows))

    def remove_sibling(self, name: str) -> None:
        sibling = self.folder.parent / name
        for key in sorted(self.folder.store.list(f"{sibling.key}/")) + [sibling.key]:
            self.folder.store.delete(key)


@dataclass
class Table:
    """A table in memory: sorted `rows`, `offsets` (len(rows) + 1) and each field's items, flat."""

    rows: np.ndarray
    offsets: np.ndarray
    fields: dict[str, np.ndarray]

    @classmethod
    def of(cls, items: dict[int, dict[str, np.ndarray]], empty: dict[str, np.ndarray]) -> Table:
        """Rows -> their items (each field an array whose first axis counts the row's items);
        `empty`: each field with no items (its dtype and trailing shape)."""
        rows = np.asarray(sorted(items), dtype=np.int64)
        counts = [len(next(iter(items[r].values()))) for r in rows.tolist()]
        fields = {k: (np.concatenate([items[r][k] for r in rows.tolist()]).astype(v.dtype, copy=False) if len(rows) else v)
                  for k, v in empty.items()}
        return cls(rows, np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64), fields)

    def items(self) -> dict[int, dict[str, np.ndarray]]:
        o = self.offsets
        return {int(r): {k: v[o[j]:o[j + 1]] for k, v in self.fields.items()} for j, r in enumerate(self.rows)}

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        return save({"rows": self.rows, "offsets": self.offsets, **{f"field.{k}": v for k, v in self.fields.items()}})

    @classmethod
    def from_bytes(cls, data: bytes, empty: dict[str, np.ndarray]) -> Table:
        """The chunk in `data`; ValueError when it is not one of these fields' shapes and dtypes."""
        from safetensors.numpy import load

        try:
            arrays = load(data)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
            raise ValueError(f"not a table chunk ({type(e).__name__}: {e})") from None
        rows, offsets = arrays.get("rows"), arrays.get("offsets")
        fields = {k: arrays.get(f"field.{k}") for k in empty}
        if (rows is None or offsets is None or rows.ndim != 1 or offsets.shape != (len(rows) + 1,) or any(
                v is None or v.dtype != empty[k].dtype or v.shape[1:] != empty[k].shape[1:] or len(v) != offsets[-1]
                for k, v in fields.items()) or offsets[0] != 0 or (np.diff(offsets) < 0).any()):
            raise ValueError("not a table chunk of these fields (rows, offsets and items do not agree)")
        return cls(rows, offsets, fields)


def chunk_name(rows: list[int]) -> str:
    return f"{rows[0]:010d}-{rows[-1]:010d}.safetensors"


def read_verified(files: TableFiles, empty: dict[str, np.ndarray], what: str) -> tuple[dict[int, dict[str, np.ndarray]], dict]:
    """Every row of the chunks the manifest lists whose bytes hash to its entry, and those entries;
    each chunk (or a manifest) that does not is logged by name and left out: its rows are computed again."""
    raw = files.read(MANIFEST)
    if raw is None:
        return {}, {}
    try:
        manifest = json.loads(raw)
        chunks = manifest["chunks"]
        if manifest.get("format") != FORMAT or not isinstance(chunks, dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT} with a 'chunks' object")
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s: %s/%s is damaged (%s): the whole table is computed again", what, files, MANIFEST, e)
        return {}, {}
    out: dict[int, dict[str, np.ndarray]] = {}
    kept: dict[str, dict] = {}
    for name, entry in sorted(chunks.items()):
        data = files.read(name)
        why = "missing" if data is None else None
        if data is not None and hashlib.sha256(data).hexdigest() != (entry or {}).get("sha256"):
            why = f"its sha256 {hashlib.sha256(data).hexdigest()[:16]}... is not the manifest's {str((entry or {}).get('sha256'))[:16]}..."
        if why is None:
            try:
                out.update(Table.from_bytes(data, empty).items())
                kept[name] = entry
                continue
            except ValueError as e:
                why = str(e)
        log.warning("%s: %s/%s is damaged (%s): its rows are computed again", what, files, name, why)
    return out, kept


def precompute(files: TableFiles, needed: np.ndarray, compute: Callable[[int], dict[str, np.ndarray]],
               empty: dict[str, np.ndarray], rt, writer: bool, agree, what: str, mark: str) -> Table:
    """The table of every row in `needed` (module docstring): the verified chunks read, the groups'
    missing rows computed by `compute(row)` (row -> its items), a round of W chunks at a time, each
    round gathered on every rank and published by the `writer` (each node's first rank; rank 0
    alone with a shared cache), which also removes stale tables of the same kind (`mark`)."""
    have, manifest = read_verified(files, empty, what)
    held = set(have)
    needed = np.asarray(needed, dtype=np.int64)
    missing = set().union(*rt.all_gather([int(r) for r in needed.tolist() if int(r) not in held]))
    if rt.is_main and held:
        log.info("%s: %d of the %d rows the run reads verified in %s", what, len(needed) - len(missing), len(needed), files)
    if not missing:
        return Table.of(have, empty)
    size = chunk_rows(len(needed))
    todo = [part for g in range(0, len(needed), size) if (part := [r for r in needed[g:g + size].tolist() if r in missing])]

    def tidy() -> None:
        for old in files.stale(mark):
            files.remove_sibling(old)

    agree(what, attempt(tidy) if writer else None)
    try:
        _rounds(files, todo, compute, empty, rt, writer, agree, what, manifest, have, len(missing))
    except Stopped:
        if rt.is_main:  # what the manifest on disk lists (the stop may have come between its write and anything after)
            try:
                kept = len(json.loads(files.read(MANIFEST) or b'{"chunks": {}}')["chunks"])
            except (ValueError, KeyError, TypeError, OSError):
                kept = 0
            log.warning("%s: stopped; %s keeps the %d chunk(s) published, the next launch continues from them", what, files.name, kept)
        raise
    return Table.of(have, empty)


def _rounds(files: TableFiles, todo: list[list[int]], compute, empty: dict[str, np.ndarray], rt, writer: bool, agree, what: str,
            manifest: dict, have: dict, missing: int) -> None:
    """The groups' chunks, W at a time: computed, gathered, published by the writer (listed in `manifest`), kept in `have`."""
    done, last = 0, time.monotonic()
    for start in range(0, len(todo), rt.world_size):
        round_ = todo[start:start + rt.world_size]
        mine: dict[int, dict[str, np.ndarray]] = {}
        if rt.rank < len(round_):
            agree(what, attempt(lambda: mine.update({r: compute(r) for r in round_[rt.rank]})))
        else:
            agree(what, None)
        gathered = rt.all_gather(mine)

        def publish() -> None:
            listed = dict(manifest)
            for part in gathered[:len(round_)]:
                chunk = Table.of(part, empty)
                data = chunk.to_bytes()
                name = chunk_name(chunk.rows.tolist())
                files.write(name, data)
                listed[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "rows": len(chunk.rows)}
            files.write(MANIFEST, json.dumps({"format": FORMAT, "chunks": dict(sorted(listed.items()))}, indent=1).encode())
            manifest.update(listed)  # published: the manifest that lists them is written

        agree(what, attempt(publish) if writer else None)
        for part in gathered:
            have.update(part)
        done += sum(len(c) for c in round_)
        if rt.is_main and (time.monotonic() - last > 10 or done == missing):
            last = time.monotonic()
            log.info("%s: %d of %d rows computed into %s (%d chunk(s) published)", what, done, missing, files.name,
                     min(start + rt.world_size, len(todo)))

