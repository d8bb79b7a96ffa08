"""The one checkpoint format: every state of a run, whatever the strategy, through
torch.distributed.checkpoint (DCP), written and read by a writer and a reader of ours that hash
every byte (docs/design.md I8, I10, I19; the picture in words: docs/design.md, "One save path").

    step_XXXXXXXX/state/.metadata           DCP's metadata: which item lies where (pickled by DCP)
    step_XXXXXXXX/state/__<rank>_0.distcp   the items that rank wrote (DCP's own file layout)

Writing (`Writer`, a DCP StorageWriter). DCP's planner gives each rank its items: a replicated
state (DDP's whole model and optimizer, the step, the RNG states rank 0 gathered) to rank 0 alone,
a sharded one (FSDP's) to the rank that holds each shard. Each rank writes its items into one file,
hashing the bytes as they go out, and fsyncs it; the file's size and sha256 travel to the
coordinator inside DCP's own write results, and the coordinator's `finish()` writes the metadata and
hands every file's entry to the caller's `publish` (the manifest and the rename: storage.publish).

Reading (`Reader`). Each file a rank needs is read once, whole, and used only if its size and
sha256 are the manifest's; the metadata is unpickled by an allow-list of DCP's own metadata classes
(each looked up only in the module that defines it), torch's sizes, dtypes and layouts, and plain
containers: nothing else is looked up, nothing in it runs. Non-tensor items and tensors are read
with `torch.load(weights_only=True)`.

The files are DCP's own, so a step folder's `state/` is also a checkpoint stock DCP reads
(`torch.distributed.checkpoint.load`, `format_utils.dcp_to_torch_save`). Nothing here knows a model.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import os
import pickle
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.serialization import config as serialization_config

from .files import FileError, HashingWriter, verified_bytes, write_file

STATE = "state"
"""The sub-folder of a step folder that holds DCP's files."""
METADATA = ".metadata"
# One process without a process group (plain `python train.py`, the tools) is meant: DCP need not say it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to",
                        category=UserWarning)


class FormatError(FileError):
    """A state file that cannot be used (unlisted, damaged, refused); storage turns it into CheckpointError."""


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


def read_metadata(data: bytes, path: Path):
    """DCP's Metadata from the bytes of a `.metadata` file, through the allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, ImportError) as e:
        raise FormatError(f"{path}: {e}") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise FormatError(f"{path}: not DCP metadata ({type(metadata).__name__})")
    return metadata


# ------------------------------------------------------------------------------------------ writing
class _Results(list):
    """One rank's DCP WriteResults, and the manifest entry of the file it wrote: what the
    coordinator receives, through DCP's own gather, in `finish()`."""

    def __init__(self, results, files: dict[str, dict]) -> None:
        super().__init__(results)
        self.files = files


def _write_items(path: Path, relative: str, items: list, planner) -> tuple[list, dict]:
    """Write DCP's items for this rank into `path`, the byte items first and then the tensors, each
    tensor as DCP's FileSystemWriter writes it (torch.save of the tensor alone); hash and fsync.
    Returns DCP's WriteResults and the file's manifest entry."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    results = []
    with open(path, "wb") as f:
        w = HashingWriter(f)
        try:
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                data, offset = planner.resolve_data(item), w.size
                if item.type == WriteItemType.BYTE_IO:
                    w.write(data.getbuffer())
                else:
                    t = data.detach().cpu()
                    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                        t = t.clone()  # a view: write its elements, not the storage it lives in
                    # The manifest's sha256 covers every byte; torch's per-record CRC32 (0.5 GB/s) adds nothing.
                    with serialization_config.patch({"save.compute_crc32": False}):
                        torch.save(t, w)
                results.append(WriteResult(index=item.index, size_in_bytes=w.size - offset,
                                           storage_data=_StorageInfo(relative, offset, w.size - offset)))
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:  # torch's zip writer hides the real error ("unexpected pos"): name it and the file
            real = w.error or e
            raise OSError(real.errno, real.strerror or str(real), str(path)) from e
    return results, {"bytes": w.size, "sha256": w.sha.hexdigest()}


def _writer_class():
    from torch.distributed.checkpoint.storage import StorageWriter

    class Writer(StorageWriter):
        """DCP's StorageWriter of this repository (see the module docstring): `folder` is the step's
        temporary folder; `publish(entries, metadata)` runs on the coordinator once every rank's
        file is on disk and the metadata is written, with every file's manifest entry."""

        def __init__(self, folder: Path, publish: Callable[[dict, Any], None] | None = None) -> None:
            super().__init__()
            self.folder, self.publish = Path(folder), publish
            self.rank, self.save_id = 0, uuid.uuid4().hex

        def reset(self, checkpoint_id=None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
            self.rank = kwargs.get("rank") or 0

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            # The coordinator, before any rank writes (the plans go back to the ranks after this).
            (self.folder / STATE).mkdir(parents=True, exist_ok=True)
            return [dataclasses.replace(p, storage_data=f"__{i}_0.distcp") for i, p in enumerate(plans)]

        def write_data(self, plan, planner):
            from torch.futures import Future

            results, files = [], {}
            if plan.items:  # a rank with nothing to write (DDP's other ranks) leaves no file
                name = plan.storage_data
                results, entry = _write_items(self.folder / STATE / name, name, plan.items, planner)
                files[f"{STATE}/{name}"] = entry
            fut = Future()
            fut.set_result(_Results(results, files))
            return fut

        def finish(self, metadata, results) -> None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            entries: dict[str, dict] = {}
            for part in results:
                entries.update(getattr(part, "files", {}))
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

    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL [\w.]+", str(e))
        raise FormatError(f"{where}: not a plain checkpoint: it needs pickled objects beyond tensors and containers; refused "
                          f"without running them{f' (Unsupported {found.group(0)})' if found else ''}") from None


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of a saved chunk that a read request asks for."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _reader_classes():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.storage import StorageReader

    class Reader(StorageReader):
        """DCP's StorageReader of this repository: `folder` is a step folder, `entries` its
        manifest's files, `metadata` what read_metadata returns (read beforehand, verified)."""

        def __init__(self, folder: Path, entries: dict[str, dict], metadata, sub: str = STATE) -> None:
            super().__init__()
            self.folder, self.entries, self.metadata, self.sub = Path(folder), entries, metadata, sub
            self.storage_data: dict = {}

        def reset(self, checkpoint_id=None) -> None:
            pass

        def read_metadata(self, *args, **kwargs):
            return self.metadata

        def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
            self.storage_data = metadata.storage_data

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def read_data(self, plan, planner):
            from torch.futures import Future

            per_file: dict[str, list] = {}
            for req in plan.items:
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            for relative, reqs in per_file.items():
                view = memoryview(verified_bytes(self.folder, f"{self.sub}/{relative}", self.entries))
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    piece = io.BytesIO(view[info.offset: info.offset + info.length])
                    where = f"{self.folder / self.sub / relative}: {req.storage_index.fqn}"
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(piece.getvalue()), where)
                        continue
                    tensor = _narrow(_load_item(piece, where), req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise FormatError(f"{self.folder / self.sub / relative}: {req.storage_index.fqn} is {tuple(tensor.size())} "
                                          f"there, {tuple(target.size())} here")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
            fut = Future()
            fut.set_result(None)
            return fut

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

    state = {k[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    return load({prefix.rstrip("."): state}, folder, entries, metadata, no_dist=True)[prefix.rstrip(".")]


def tensor_bytes(metadata, prefix: str) -> int:
    """Bytes of the tensors under `prefix`, from the metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return sum(m.size.numel() * m.properties.dtype.itemsize for k, m in metadata.state_dict_metadata.items()
               if k.startswith(prefix) and isinstance(m, TensorStorageMetadata))
