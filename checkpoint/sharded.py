"""Sharded states through torch.distributed.checkpoint (DCP), under this package's rules
(docs/design.md I8, I10, I19; docs/sharding.md).

Each rank writes its own shards with DCP into the step's temporary folder (`shards/__<rank>_0.distcp`,
rank 0 also `shards/.metadata`); each rank hashes the files it wrote and rank 0 lists them all in the
one manifest it publishes with the rest of the checkpoint. Loading goes through DCP (which reshards
to the current world size) with two changes that keep I10, "loading never runs code": DCP reads its
`.metadata` with pickle and its non-tensor items with `torch.load(weights_only=False)`; here the
metadata is unpickled by an allow-list of DCP's own metadata classes and torch's dtypes and sizes,
and the items with `weights_only=True`. The files are verified against the manifest before either.

Nothing here knows a model: a sharded state is any object with `sharded = True`, `state_dict()`
(DTensors), `load_state_dict()` and `full_model_state()` (runtime/sharding.py: ShardedState).
"""
from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch

SHARDS = "shards"
"""The sub-folder of a step folder holding DCP's files."""


def is_sharded(obj: Any) -> bool:
    return getattr(obj, "sharded", False) is True


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch's dtypes, layouts, memory formats and sizes, and plain
    containers: anything else is refused before it is looked up."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or module == "torch.distributed.checkpoint":
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module == "torch.serialization" and name == "_get_layout":  # how a torch.layout pickles: a name lookup
            return torch.serialization._get_layout
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            import pathlib  # the checkpoint's id DCP records: a path, only built, never opened

            return getattr(pathlib, name)
        elif module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        elif module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            return {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex}[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata: refused (loading never runs code)")


def _reader_classes():
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            with open(self._get_metadata_path(rank), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)  # the default planner's, but weights_only
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element  # what the default planner uses

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader, SafePlanner


def _read_metadata(folder: Path):
    """DCP's metadata of a checkpoint's shards, through the allow-list; CheckpointError when refused."""
    from .storage import CheckpointError

    reader_cls, _ = _reader_classes()
    try:
        return reader_cls(str(Path(folder) / SHARDS)).read_metadata()
    except (pickle.UnpicklingError, OSError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{Path(folder) / SHARDS / '.metadata'}: {e}") from None


def save(state: dict, folder: Path, rank: int) -> dict[str, dict]:
    """Collective: write `state` with DCP into `folder`/shards; returns the manifest entries
    ({"shards/<file>": {"bytes", "sha256"}}) of the files this rank wrote."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(Path(folder) / SHARDS), single_file_per_rank=True, sync_files=True))
    return hash_own(folder, rank)


_SIDE_GROUP = None


def _side_group():
    """A gloo group of every rank for DCP's collectives in the background (a background save that
    shares the training's group can hang, measured before this was built). Made at the first
    background save, which every rank reaches together."""
    global _SIDE_GROUP
    if _SIDE_GROUP is None:
        import torch.distributed as dist

        _SIDE_GROUP = dist.new_group(backend="gloo")
    return _SIDE_GROUP


def save_async(state: dict, folder: Path):
    """Collective: stage `state` (a copy in CPU memory: training may go on) and start writing it with
    DCP in a background thread, on a group of its own; returns DCP's future."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(Path(folder) / SHARDS), single_file_per_rank=True, sync_files=True)
    return dcp.async_save(state, storage_writer=writer, process_group=_side_group())


def hash_own(folder: Path, rank: int) -> dict[str, dict]:
    """The manifest entries of the shard files `rank` wrote into `folder`/shards."""
    out = Path(folder) / SHARDS
    mine = sorted(out.glob(f"__{rank}_*.distcp")) + ([out / ".metadata"] if rank == 0 else [])
    entries = {}
    for path in mine:
        h, n = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
                n += len(block)
        entries[f"{SHARDS}/{path.name}"] = {"bytes": n, "sha256": h.hexdigest()}
    return entries


def load(state: dict, folder: Path, no_dist: bool = False) -> dict:
    """Fill `state` (a state dict of DTensors or plain tensors of the target shapes) from the
    shards of the verified checkpoint `folder`, resharded to this world size; returns it."""
    import torch.distributed.checkpoint as dcp

    from .storage import CheckpointError

    reader_cls, planner_cls = _reader_classes()
    try:
        dcp.load(state, storage_reader=reader_cls(str(Path(folder) / SHARDS)), planner=planner_cls(), no_dist=no_dist)
    except Exception as e:  # DCP gathers every rank's failure into one exception (pickle refusals included)
        raise CheckpointError(f"{Path(folder) / SHARDS}: the shards cannot be loaded ({type(e).__name__}: {e})") from None
    return state


def full_model(folder: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state of a sharded checkpoint, on one process without a process group:
    the shapes from DCP's metadata, the values read and assembled from every rank's shards."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(folder)
    state = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        loaded = load({"model": state}, folder, no_dist=True)
    return loaded["model"]


def model_state(folder: Path, payload: dict) -> dict[str, torch.Tensor]:
    """The fp32 model state of a checkpoint's resume payload: in it, or assembled from its shards."""
    if isinstance(payload, dict) and payload.get("sharded"):
        return full_model(folder)
    return payload["model"]


def optimizer_bytes(folder: Path) -> int:
    """Bytes of the optimizer's tensors in a sharded checkpoint, from DCP's metadata (nothing else read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(folder)
    return sum(m.size.numel() * m.properties.dtype.itemsize for k, m in metadata.state_dict_metadata.items()
               if k.startswith("optimizer.state.") and isinstance(m, TensorStorageMetadata))
