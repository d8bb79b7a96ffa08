"""The one checkpoint format: every state of a run, whatever the strategy, through
torch.distributed.checkpoint (DCP), written and read by a writer and a reader of ours that hash
every byte in the same pass as its write or read (docs/design.md I8, I10, I19; the byte layout:
docs/design.md, "One save path").

    step_XXXXXXXX/state/.metadata           DCP's metadata: which item lies where (pickled by DCP)
    step_XXXXXXXX/state/__<rank>_0.distcp   the items that rank wrote: the bytes items (torch.save
                                            records), then about half its tensors' bytes raw (format 3)
    step_XXXXXXXX/state/__<rank>_1.distcp   the rest of its tensors' bytes raw

Writing (`Writer`, a DCP StorageWriter). DCP's planner gives each rank its items: a replicated
state (DDP's whole model and optimizer, the step, the RNG states rank 0 gathered) to rank 0 alone,
a sharded one (FSDP's) to the rank that holds each shard. Each rank writes its items into PARTS
files in parallel (`_split`: a file's sha256 is one core's work), the tensors' elements as they are
in memory, each file through a files.StreamWriter (hashed as the bytes go out, O_DIRECT where the
filesystem takes it, fsynced); each item's place (offset, length, and a tensor's dtype and shape)
is its `RawItem` in DCP's storage data, and each file's size and sha256 travel to the coordinator
inside DCP's own write results; the coordinator's `finish()` writes the metadata and hands every
file's entry to the caller's `publish` (the manifest and the rename: storage.publish).

Reading (`Reader`). The metadata is unpickled by an allow-list of DCP's own metadata classes and
`RawItem` (each looked up only in the module that defines it), torch's sizes, dtypes and layouts,
and plain containers: nothing else is looked up, nothing in it runs. Then it is checked against the
files it points into before anything is allocated (`check_metadata`): every tensor's chunks cover
it exactly once (no gap, no overlap, none outside it), every item's bytes lie inside a listed file
and no two overlap, and a raw chunk's bytes are exactly its elements, so every size it states is
bounded by the bytes on disk. Each file a rank needs is then read front to back once (a rank's
files in parallel), hashed as it goes by, each tensor read straight into its destination's memory;
the bytes items are loaded with `torch.load(weights_only=True)`, each only when it is a zip of
stored (uncompressed) records, once every file's sha256 is the manifest's. Format 2 (every item a torch.save record, DCP's own file
layout) is still read: the file read whole and verified, then each item loaded alike.

Nothing here knows a model.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib
import io
import math
import os
import pickle
import threading
import uuid
import warnings
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from common.store import RemotePath, location

from .files import FileError, HashingReader, no_follow, open_read, refuse_links, verified_bytes, write_file, writer_for

STATE = "state"
"""The sub-folder of a step folder that holds DCP's files."""
METADATA = ".metadata"
# One process without a process group (plain `python train.py`, the tools) is meant: DCP need not say it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to",
                        category=UserWarning)


VERSION = 3
"""The byte layout this writer writes (the manifest's "format"): 3, every tensor's bytes raw, at the
offset its `RawItem` records; 2 (still read), every item a torch.save record (DCP's own layout)."""
PARTS = 2
"""Each rank's items are written into (at most) this many files, in parallel: a file's sha256 is
sequential, one core's work; two files are hashed, written and read on two cores at once."""
_files = ThreadPoolExecutor(max_workers=PARTS, thread_name_prefix="ckpt-file")


def _raw_item_class():
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    @dataclasses.dataclass
    class RawItem(_StorageInfo):
        """Where one item lies in a format-3 state file: DCP's (relative_path, offset, length) and, for
        a tensor chunk, the dtype and shape its raw bytes have (None for a bytes item)."""

        dtype: torch.dtype | None = None
        shape: tuple | None = None

    RawItem.__module__, RawItem.__qualname__ = __name__, "RawItem"  # pickled by reference to this module
    return RawItem


_raw_item_lock = threading.Lock()


def __getattr__(name: str):
    # RawItem is made at its first use: DCP's modules take most of a second to import, and most uses
    # of this module (the tools' listings) never need them. Once, under a lock: a rank's files are
    # written by two threads, and a second class of the same name would not pickle as this module's.
    if name == "RawItem":
        with _raw_item_lock:
            if "RawItem" not in globals():
                globals()["RawItem"] = _raw_item_class()
        return globals()["RawItem"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FormatError(FileError):
    """A state file that cannot be used (unlisted, damaged, forged, refused): a CheckpointError."""


def prepare() -> None:
    """Import what a save and a load of DCP need (about half a second, once per process; the
    states' own state_dict helpers among them), so that none of them pays it: the manager calls it
    when it is made."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch._dynamo  # noqa: F401 - its state_dict helpers look a compiled module up in it (half a second more)

    raw_item()


def errors() -> tuple[type[BaseException], ...]:
    """What a DCP call raises: DCP's CheckpointException (every rank's failures gathered; a
    BaseException, so `except Exception` does not see it) or an ordinary exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


# ---------------------------------------------------------------------------------------- metadata
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # how a torch.layout pickles: a lookup by name
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
    # The checkpoint id DCP <= 2.12 recorded (a path): built, never opened. Our writer records none.
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    __name__: frozenset({"RawItem"}),  # format 3's storage entries
}


class _MetadataUnpickler(pickle.Unpickler):
    """The classes of DCP's metadata and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            obj = getattr(importlib.import_module(module), name, None)
            # Defined where it is looked up: a name another module re-exports is not the class we mean.
            if obj is not None and getattr(obj, "__module__", None) == module:
                return obj
        elif module == "torch" and not name.startswith("_"):
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata classes: refused, nothing of it was "
                                     f"built (loading never runs code)")


def read_metadata(data: bytes, path: Path, entries: dict[str, dict] | None = None, sub: str = STATE):
    """DCP's Metadata from the bytes of a `.metadata` file, through the allow-list; with the
    manifest's `entries`, also checked against the files it points into (check_metadata)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - whatever damaged bytes make the unpickler raise: a damaged file
        raise FormatError(f"{path}: does not unpickle as DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict) \
            or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise FormatError(f"{path}: not DCP metadata ({type(metadata).__name__})")
    if entries is not None:
        check_metadata(metadata, entries, path, sub)
    return metadata


def raw_item() -> type:
    """The class RawItem (made at its first use)."""
    return globals().get("RawItem") or __getattr__("RawItem")


def is_raw(metadata) -> bool:
    """Is this checkpoint's layout format 3 (raw tensor bytes; else format 2, torch.save records)?"""
    cls = raw_item()
    return any(isinstance(info, cls) for info in metadata.storage_data.values())


def _count(x) -> bool:
    return type(x) is int and x >= 0


def _overlap(a, b) -> bool:
    """Do two chunks (offsets, sizes) share an element?"""
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1])) and \
        math.prod(a[1]) > 0 and math.prod(b[1]) > 0


def check_metadata(metadata, entries: dict[str, dict], path: Path, sub: str = STATE) -> None:
    """DCP's metadata against the manifest's `entries`, before anything is allocated from it
    (FormatError naming the item, else nothing):

    - every tensor's size is non-negative integers, its dtype a torch dtype, and its chunks cover
      it exactly once: each inside it, no two sharing an element, their elements summing to its;
    - every chunk and every bytes item has its bytes recorded, in a file the manifest lists, inside
      that file, no two items' bytes overlapping, and a chunk's bytes hold at least its elements.

    So no uncovered element is left as it was (fresh-init or uninitialised memory), and every size
    is bounded by the bytes on disk (a forged size allocates nothing)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)

    def bad(what: str):
        raise FormatError(f"{path}: {what} (a damaged or forged checkpoint)")

    sizes = {name[len(sub) + 1:]: e["bytes"] for name, e in entries.items() if name.startswith(f"{sub}/")}
    regions: dict[str, list[tuple[int, int, str]]] = {}
    raw, RawItem = is_raw(metadata), raw_item()
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) or not isinstance(index.fqn, str):
            bad(f"a storage entry of type {type(index).__name__} -> {type(info).__name__}")
        if isinstance(info, RawItem) != raw:
            bad(f"{index.fqn} is stored in format {3 if isinstance(info, RawItem) else 2}, the other items in the other format")
        rel, offset, length = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or rel not in sizes:
            bad(f"{index.fqn} lies in {rel!r}, which the manifest does not list")
        if not _count(offset) or not _count(length) or offset + length > sizes[rel]:
            bad(f"{index.fqn} lies at bytes {offset!r}+{length!r} of {sub}/{rel}, which holds {sizes[rel]}")
        if getattr(info, "transform_descriptors", None):
            bad(f"{index.fqn} is stored transformed ({info.transform_descriptors!r}); this reader reads plain items only")
        regions.setdefault(rel, []).append((offset, length, index.fqn))
    for rel, spans in regions.items():
        spans.sort()
        for (o1, l1, f1), (o2, _, f2) in zip(spans, spans[1:]):
            if o2 < o1 + l1:
                bad(f"the bytes of {f1} and {f2} overlap in {sub}/{rel}")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            bad(f"an item named {fqn!r}")
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(fqn) not in metadata.storage_data:
                bad(f"{fqn}: no bytes recorded for it")
            info = metadata.storage_data[MetadataIndex(fqn)]
            if raw and (info.dtype is not None or info.shape is not None):
                bad(f"{fqn}: a bytes item recorded as a {info.dtype} tensor of {info.shape}")
            continue
        if not isinstance(md, TensorStorageMetadata):
            bad(f"{fqn}: an item of type {type(md).__name__}")
        size, dtype, chunks = getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None), getattr(md, "chunks", None)
        if not isinstance(size, tuple) or not all(_count(n) for n in size) or not isinstance(dtype, torch.dtype) \
                or not isinstance(chunks, list):
            bad(f"{fqn}: size {size!r}, dtype {dtype!r}, chunks of type {type(chunks).__name__}")
        boxes, stored = [], []
        for chunk in chunks:
            offsets, lengths = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not isinstance(chunk, ChunkStorageMetadata) or not isinstance(offsets, tuple) or not isinstance(lengths, tuple) \
                    or len(offsets) != len(size) or len(lengths) != len(size) \
                    or not all(_count(o) and _count(n) and o + n <= dim for o, n, dim in zip(offsets, lengths, size)):
                bad(f"{fqn}: a chunk at {offsets!r} of sizes {lengths!r}, not inside its size {tuple(size)}")
            info = metadata.storage_data.get(MetadataIndex(fqn, offsets))
            if info is None:
                bad(f"{fqn}: no bytes recorded for its chunk at {tuple(offsets)}")
            if math.prod(lengths) * dtype.itemsize > info.length:
                bad(f"{fqn}: its chunk at {tuple(offsets)} has {math.prod(lengths)} elements of {dtype}, more than its "
                    f"{info.length} bytes hold")
            boxes.append((tuple(offsets), tuple(lengths)))
            stored.append((tuple(offsets), tuple(lengths), info))
        if sum(math.prod(b[1]) for b in boxes) != math.prod(size):
            bad(f"{fqn}: its chunks hold {sum(math.prod(b[1]) for b in boxes)} elements, its size {tuple(size)} "
                f"{math.prod(size)}: the chunks do not cover it exactly once")
        boxes.sort()
        active: list = []  # a sweep along the first dimension: only chunks whose rows meet are compared
        for box in boxes:
            if not box[0]:
                break  # a 0-d tensor: one chunk of one element (the sum says so)
            active = [a for a in active if a[0][0] + a[1][0] > box[0][0]]
            for other in active:
                if _overlap(box, other):
                    bad(f"{fqn}: its chunks at {other[0]} and {box[0]} overlap: the chunks do not cover it exactly once")
            active.append(box)
        for offsets, lengths, info in stored if raw else ():  # raw bytes: exactly the chunk's elements, as the chunk says
            if info.dtype != dtype or not isinstance(info.shape, tuple) or info.shape != lengths \
                    or info.length != math.prod(lengths) * dtype.itemsize:
                bad(f"{fqn}: its chunk at {offsets} is {math.prod(lengths)} elements of {dtype} of shape {lengths}, its bytes "
                    f"{info.length} of {info.dtype} of shape {info.shape}")


def structure_mismatches(state: dict, metadata) -> list[str]:
    """What of `state` (the structure a load fills) the checkpoint does not hold as it is here:
    a key it lacks, a tensor of another size, a tensor where it holds bytes or the other way round,
    each naming the flattened key. A sound checkpoint that does not fit this run's settings."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for fqn, obj in flatten_state_dict(state)[0].items():
        md = metadata.state_dict_metadata.get(fqn)
        here_tensor = isinstance(obj, torch.Tensor)
        if md is None:
            out.append(f"{fqn} is not in the checkpoint")
        elif isinstance(md, TensorStorageMetadata) != here_tensor:
            out.append(f"{fqn} is {'a tensor' if here_tensor else type(obj).__name__} in this run, "
                       f"{'a tensor' if isinstance(md, TensorStorageMetadata) else 'not a tensor'} in the checkpoint")
        elif here_tensor and tuple(md.size) != tuple(obj.size()):
            out.append(f"{fqn} is {tuple(md.size)} in the checkpoint, {tuple(obj.size())} in this run")
    return out


# ------------------------------------------------------------------------------------------ writing
class _Results(list):
    """One rank's DCP WriteResults, and the manifest entry of the file it wrote: what the
    coordinator receives, through DCP's own gather, in `finish()`."""

    def __init__(self, results, files: dict[str, dict]) -> None:
        super().__init__(results)
        self.files = files


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's elements as the bytes they are in CPU memory (no copy for a contiguous CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()  # a contiguous view of a larger storage gives its own elements only
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _split(items: list) -> list[list]:
    """This rank's write items in file order, over PARTS files: the bytes items first (in the first
    file), then the tensors in DCP's order, cut where each file holds about an equal share of the
    tensor bytes (a file is hashed on one core: the files are written, and read, in parallel)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    def nbytes(item) -> int:
        return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize

    first = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
    total, parts, done = sum(nbytes(i) for i in tensors), [first], 0
    for item in tensors:
        if done >= total * len(parts) / PARTS and parts[-1] and len(parts) < PARTS:
            parts.append([])
        parts[-1].append(item)
        done += nbytes(item)
    return parts


def _write_part(path: Path, relative: str, items: list) -> tuple[list, dict]:
    """Write one file of DCP's items (format 3), `items` as (write item, its resolved data) pairs:
    a bytes item's torch.save record, a tensor's elements raw, each at the offset its RawItem
    records (with a tensor's dtype and shape); every byte hashed in the write's pass, then fsynced
    (files.StreamWriter). Returns DCP's WriteResults and the file's manifest entry."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    RawItem, results = raw_item(), []
    w = writer_for(path)
    try:
        for item, data in items:
            offset = w.tell()
            if item.type == WriteItemType.BYTE_IO:
                w.write(data.getbuffer())
                info = RawItem(relative, offset, w.tell() - offset)
            else:
                w.write(_raw_bytes(data))
                info = RawItem(relative, offset, w.tell() - offset, None, data.dtype, tuple(data.shape))
            results.append(WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info))
    except BaseException:
        w.abort()
        raise
    return results, w.close()


def _write_items(folder: Path, prefix: str, items: list, planner) -> tuple[list, dict]:
    """Write DCP's items for this rank into the files `prefix`0.distcp, `prefix`1.distcp, ... of
    `folder` (at most PARTS; `_split`), one thread each; returns DCP's WriteResults and every
    file's manifest entry by its name. Every file is done (written or failed) before this returns;
    the first failure, in file order, is raised."""
    raw_item()  # made here, before the threads (one class: __getattr__)
    parts = [[(item, planner.resolve_data(item)) for item in part] for part in _split(items)]
    names = [f"{prefix}{k}.distcp" for k in range(len(parts))]
    futures = [_files.submit(_write_part, folder / name, name, part) for name, part in zip(names[1:], parts[1:])]
    try:
        done = [_write_part(folder / names[0], names[0], parts[0])]
    finally:
        concurrent.futures.wait(futures)
    done += [f.result() for f in futures]
    results, entries = [], {}
    for name, (part_results, entry) in zip(names, done):
        results += part_results
        entries[f"{STATE}/{name}"] = entry
    return results, entries


def _writer_class():
    from torch.distributed.checkpoint.storage import StorageWriter

    class Writer(StorageWriter):
        """DCP's StorageWriter of this repository (see the module docstring): `folder` is the step's
        temporary folder; `publish(entries, metadata)` runs on the coordinator once every rank's
        file is on disk and the metadata is written, with every file's manifest entry."""

        def __init__(self, folder: Path, publish: Callable[[dict, Any], None] | None = None) -> None:
            super().__init__()
            self.folder, self.publish = location(folder), publish
            self.rank, self.save_id, self.own = 0, uuid.uuid4().hex, set()

        def reset(self, checkpoint_id=None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
            self.rank = kwargs.get("rank") or 0

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            # The coordinator, before any rank writes (the plans go back to the ranks after this).
            (self.folder / STATE).mkdir(parents=True, exist_ok=True)
            return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

        def write_data(self, plan, planner):
            from torch.futures import Future

            results, files = [], {}
            if plan.items:  # a rank with nothing to write (DDP's other ranks) leaves no file
                results, files = _write_items(self.folder / STATE, plan.storage_data, plan.items, planner)
                self.own = set(files)
            fut = Future()
            fut.set_result(_Results(results, files))
            return fut

        def finish(self, metadata, results) -> None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            entries: dict[str, dict] = {}
            for part in results:
                entries.update(getattr(part, "files", {}))
            check_written(self.folder, entries, own=self.own)
            metadata.storage_data = {r.index: r.storage_data for part in results for r in part}
            metadata.storage_meta = StorageMeta(checkpoint_id=None, save_id=self.save_id)
            entries[f"{STATE}/{METADATA}"] = write_file(self.folder / STATE / METADATA, pickle.dumps(metadata))
            if self.publish is not None:
                self.publish(entries, metadata)

        def storage_meta(self):
            from torch.distributed.checkpoint.metadata import StorageMeta

            return StorageMeta(checkpoint_id=None, save_id=self.save_id)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return True

    return Writer


def check_written(folder: Path, entries: dict[str, dict], own: set[str]) -> None:
    """The coordinator, before it publishes: every file another rank said it wrote is in `folder`
    here, a plain file (no link) of the size and sha256 it listed; FormatError naming it otherwise
    (ranks on nodes that do not share `folder` would publish checkpoints that never verify)."""
    if isinstance(folder, RemotePath):  # in the store: each part's SHA-256 was checked by the store as it arrived
        listed = folder.store.list(f"{folder.key}/")
        for name, entry in sorted(entries.items()):
            if listed.get(f"{folder.key}/{name}") != entry["bytes"]:
                raise FormatError(f"{folder / name}: another rank wrote {entry['bytes']} bytes, the store holds "
                                  f"{listed.get(f'{folder.key}/{name}', 'nothing')}; not published")
        return
    for name, entry in sorted(entries.items()):
        if name in own:
            continue  # written and hashed by this process a moment ago
        path = Path(folder) / name
        try:
            refuse_links(folder, name)
            with open(path, "rb", opener=no_follow) as f:
                sha, size = hashlib.sha256(), 0
                while block := f.read(1 << 22):
                    sha.update(block)
                    size += len(block)
        except OSError as e:
            raise FormatError(f"{path}: written by another rank, but {e.strerror or e} here (is {folder} on a filesystem "
                              f"every node shares?); not published") from None
        if size != entry["bytes"] or sha.hexdigest() != entry["sha256"]:
            raise FormatError(f"{path}: another rank wrote {entry['bytes']} bytes of sha256 {entry['sha256'][:12]}..., "
                              f"here it holds {size} bytes of sha256 {sha.hexdigest()[:12]}...; not published")


def save(state: dict, folder: Path, publish: Callable[[dict, Any], None] | None, group=None, no_dist: bool = False):
    """Collective: write `state` (nested dicts of tensors, DTensors and plain values) into
    `folder`/state with DCP; the coordinator then calls `publish(entries, metadata)`. A failure on
    any rank raises on every rank (DCP gathers them), naming each failing rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    # Replicated items (DDP's every state, FSDP's non-sharded ones) are written by rank 0 alone.
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    return dcp.save(state, storage_writer=_writer_class()(folder, publish), planner=planner, process_group=group, no_dist=no_dist)


# ------------------------------------------------------------------------------------------ reading
def _load_item(data: io.BytesIO, where: str):
    """`torch.load(weights_only=True)` of one item; an item that needs pickled objects beyond tensors
    and containers is refused naming it (torch's own message suggests weights_only=False: never)."""
    import re

    size = data.getbuffer().nbytes
    try:
        with zipfile.ZipFile(data) as z:
            records = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise FormatError(f"{where}: not a torch.save zip archive ({e})") from None
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.file_size > size:
            raise FormatError(f"{where}: its record {r.filename} is compressed ({r.compress_type}) or larger than the item "
                              f"({r.file_size} of {size} bytes); only stored records are read (a small item must not inflate)")
    data.seek(0)
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL [\w.]+", str(e))
        raise FormatError(f"{where}: not a plain checkpoint: it needs pickled objects beyond tensors and containers; refused "
                          f"without running them{f' (Unsupported {found.group(0)})' if found else ''}") from None
    except Exception as e:  # noqa: BLE001 - damaged bytes inside a verified file (a forged manifest): a damaged item
        raise FormatError(f"{where}: cannot be read ({type(e).__name__}: {e})") from None


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of a saved chunk that a read request asks for."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _fits(target: torch.Tensor, shape: tuple, dtype: torch.dtype) -> bool:
    """Can a chunk's raw bytes be read straight into `target`'s memory?"""
    return target.device.type == "cpu" and target.dtype == dtype and tuple(target.shape) == shape and target.is_contiguous()


def _raw_bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own bytes, writable: a read fills the tensor."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _reader_classes():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.storage import StorageReader

    class Reader(StorageReader):
        """DCP's StorageReader of this repository: `folder` is a step folder, `entries` its
        manifest's files, `metadata` what read_metadata returns (read beforehand, verified)."""

        def __init__(self, folder: Path, entries: dict[str, dict], metadata, sub: str = STATE) -> None:
            super().__init__()
            self.folder, self.entries, self.metadata, self.sub = location(folder), entries, metadata, sub
            self.storage_data: dict = {}

        def reset(self, checkpoint_id=None) -> None:
            pass

        def read_metadata(self, *args, **kwargs):
            return self.metadata

        def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
            self.storage_data = metadata.storage_data
            self.chunks = {(fqn, tuple(c.offsets)): (tuple(c.sizes), md.properties.dtype)
                           for fqn, md in metadata.state_dict_metadata.items() for c in getattr(md, "chunks", ())}

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def read_data(self, plan, planner):
            from torch.futures import Future

            per_file: dict[str, list] = {}
            for req in plan.items:
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            if is_raw(self.metadata):  # the files read in parallel (each hashed on its own core), the bytes items loaded after
                names = sorted(per_file)
                futures = [_files.submit(self._read_raw, name, per_file[name], planner) for name in names[1:]]
                try:
                    later = self._read_raw(names[0], per_file[names[0]], planner) if names else []
                finally:
                    concurrent.futures.wait(futures)
                for f in futures:
                    later += f.result()
                for req, data, where in later:
                    planner.load_bytes(req, io.BytesIO(bytes(data)), where)
            else:
                for relative, reqs in per_file.items():
                    self._read_records(relative, reqs, planner)
            fut = Future()
            fut.set_result(None)
            return fut

        def _read_raw(self, relative: str, reqs: list, planner) -> list:
            """Format 3: the file read front to back once, hashed as it goes by; each tensor item read
            straight into the destination tensor's own bytes where the request is the whole chunk and
            the destination a contiguous CPU tensor of its dtype (else into a buffer of the chunk, then
            copied). Returns the bytes items, (request, bytes, where), once the file's sha256 is the
            manifest's: the caller unpickles them after every file is verified."""
            name = f"{self.sub}/{relative}"
            path, entry = self.folder / name, self.entries.get(name)
            if entry is None:
                raise FormatError(f"{path}: not listed in the manifest; only what the manifest vouches for is read")
            items: dict = {}
            for req in reqs:
                items.setdefault(req.storage_index, []).append(req)
            order = sorted(items, key=lambda index: self.storage_data[index].offset)
            f, size = open_read(self.folder, name, FormatError)
            with f:
                if size != entry["bytes"]:  # every item was bounded by the listed size (check_metadata)
                    raise FormatError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
                r, later = HashingReader(f, path), []
                for index in order:
                    info, where = self.storage_data[index], f"{path}: {index.fqn}"
                    if info.offset < r.size:
                        raise FormatError(f"{where}: its bytes at {info.offset} overlap the item before it (a damaged or forged checkpoint)")
                    r.skip(info.offset - r.size)
                    first = items[index][0]
                    if first.type == LoadItemType.BYTE_IO:
                        data = bytearray(info.length)
                        r.readinto(data)
                        later.extend((req, data, where) for req in items[index])
                        continue
                    shape, dtype = self.chunks[(index.fqn, tuple(index.offset))]
                    targets = [planner.resolve_tensor(req).detach() for req in items[index]]
                    whole = len(targets) == 1 and tuple(first.storage_offsets) == (0,) * len(shape) \
                        and tuple(first.lengths) == shape
                    into = targets[0] if whole and _fits(targets[0], shape, dtype) else torch.empty(shape, dtype=dtype)
                    r.readinto(_raw_bytes_of(into))
                    for req, target in zip(items[index], targets):
                        if target is not into:
                            piece = _narrow(into, req.storage_offsets, req.lengths)
                            if target.size() != piece.size():
                                raise FormatError(f"{where}: {tuple(piece.size())} there, {tuple(target.size())} here")
                            target.copy_(piece)
                        planner.commit_tensor(req, target)
                r.rest()
                sha = r.hexdigest()
            if r.size != entry["bytes"] or sha != entry["sha256"]:
                raise FormatError(f"{path}: sha256 {sha[:12]}... of {r.size} bytes does not match the manifest's "
                                  f"{entry['sha256'][:12]}... of {entry['bytes']} (corrupted)")
            return later

        def _read_records(self, relative: str, reqs: list, planner) -> None:
            """Format 2: the file read whole and verified, each item a torch.save record."""
            view = memoryview(verified_bytes(self.folder, f"{self.sub}/{relative}", self.entries))
            for req in reqs:
                info = self.storage_data[req.storage_index]
                piece = io.BytesIO(view[info.offset: info.offset + info.length])
                where = f"{self.folder / self.sub / relative}: {req.storage_index.fqn}"
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(piece.getvalue()), where)
                    continue
                tensor = _load_item(piece, where)
                shape, dtype = self.chunks[(req.storage_index.fqn, tuple(req.storage_index.offset))]
                if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise FormatError(f"{where}: holds {type(tensor).__name__} {tuple(getattr(tensor, 'shape', ()))} "
                                      f"{getattr(tensor, 'dtype', '')}, its metadata says a {dtype} chunk of {shape}")
                tensor = _narrow(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise FormatError(f"{self.folder / self.sub / relative}: {req.storage_index.fqn} is {tuple(tensor.size())} "
                                      f"there, {tuple(target.size())} here")
                target.copy_(tensor)
                planner.commit_tensor(req, target)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return True

    class Planner(DefaultLoadPlanner):
        """DCP's default load planner, but non-tensor items are read with weights_only=True."""

        def load_bytes(self, read_item, value: io.BytesIO, where: str = "a state item") -> None:
            obj = _load_item(value, where)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element  # what the default planner uses

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Reader, Planner


def load(state: dict, folder: Path, entries: dict[str, dict], metadata, group=None, no_dist: bool = False, sub: str = STATE) -> dict:
    """Collective: fill `state` (the same structure as saved; tensors of this world size's shapes)
    from the step folder `folder` (its DCP files in `sub`/), resharded to this world size. A file
    that does not verify on any rank raises on every rank (DCP gathers the failures)."""
    import torch.distributed.checkpoint as dcp

    check_metadata(metadata, entries, location(folder) / sub / METADATA, sub)  # every rank alike, before DCP allocates
    reader_cls, planner_cls = _reader_classes()
    dcp.load(state, storage_reader=reader_cls(folder, entries, metadata, sub), planner=planner_cls(), process_group=group,
             no_dist=no_dist)
    return state


def keys(metadata) -> set[str]:
    """The flattened keys a checkpoint holds ("model.layers.0.attention.wq.weight", "train.step", ...)."""
    return set(metadata.state_dict_metadata)


def has(metadata, name: str) -> bool:
    """Does the checkpoint hold state `name` (a top-level key, or a dotted prefix)?"""
    prefix = f"{name}."
    return any(k == name or k.startswith(prefix) for k in metadata.state_dict_metadata)


def read_tensors(folder: Path, entries: dict[str, dict], metadata, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` ("model.") whole, in the checkpoint's order, on one process
    without a process group: the shapes from the metadata, the values from every rank's files."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_metadata(metadata, entries, location(folder) / STATE / METADATA)  # its sizes bounded by the files before any is allocated
    state = {k[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    return load({prefix.rstrip("."): state}, folder, entries, metadata, no_dist=True)[prefix.rstrip(".")]


def tensor_bytes(metadata, prefix: str) -> int:
    """Bytes of the tensors under `prefix`, from the metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return sum(m.size.numel() * m.properties.dtype.itemsize for k, m in metadata.state_dict_metadata.items()
               if k.startswith(prefix) and isinstance(m, TensorStorageMetadata))
