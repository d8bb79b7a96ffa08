"""The checkpoint manager: the loop's two calls, `load()` at start-up and `after_step()` after every
optimizer step, and the one save path behind them (docs/design.md, "One save path").

It takes the run's stateful pieces as a dict (name -> object with `state_dict()` /
`load_state_dict()`) and knows nothing of their insides, except that "model" also becomes the fp16
weights file for inference and "train" holds the step. Every state goes through DCP
(checkpoint/format.py); what the run is (its geometry, config and identity) comes as a `RunMeta` and
goes into the manifest; the few collectives it needs come through `Collectives`, and DCP's own run
on a process group the manager makes at its first use and destroys in `close()`.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
import uuid
import concurrent.futures
import copy
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from common.store import RemotePath, is_url, location

from . import format, states as rng, storage
from .remote import RemoteStore
from .config import CheckpointConfig

log = logging.getLogger("minimind")
OPTIONAL_STATES = frozenset({"scaler"})
"""States a checkpoint may lack: they start fresh, with a warning (a GradScaler when a float32 or
bfloat16 run continues in float16)."""
CONVERT_JOURNAL = "convert.journal"
"""checkpoints/convert.journal: a conversion of the earlier layout under way (cli/convert.py); while it is there no
resume loads anything (it could be an older step than the one being converted)."""


def store_of(out_dir) -> storage.LocalStore | RemoteStore:
    """The checkpoints of a run folder: storage.LocalStore for a path, remote.RemoteStore for
    s3://BUCKET/PREFIX (docs/object_storage.md). The manager's one switch between the two."""
    return RemoteStore(RemotePath(str(out_dir))) if is_url(out_dir) else storage.LocalStore(Path(out_dir))


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> Any: ...


class Collectives(Protocol):
    """The collectives the manager agrees through (runtime.Runtime is one; so is a one-process fake)."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool: ...
    def sum(self, values: list[float]) -> list[float]: ...
    def any(self, flag: bool) -> bool: ...
    def broadcast(self, obj: Any) -> Any: ...
    def gather(self, obj: Any) -> list[Any] | None: ...
    def all_gather(self, obj: Any) -> list[Any]: ...


@dataclass(kw_only=True)
class RunMeta:
    """What a run is, written into every manifest.

    `must_match` and `may_change` are dotted paths into a manifest (e.g. "config.model.dim",
    "global_batch"), each with the label an error or warning uses: a resume whose checkpoint
    differs in a `must_match` path is refused (CheckpointMismatch, naming each), one that differs
    in a `may_change` path warns with the old and new values and the consequence given."""

    world_size: int
    global_batch: int
    micro_batch: int
    accum: int
    threads: int
    reduce: str
    strategy: str = "ddp"
    config: dict = field(default_factory=dict)
    data_fingerprint: dict = field(default_factory=dict)
    run_id: str = ""
    must_match: dict[str, str | tuple[str, object]] = field(default_factory=dict)
    """(label) or (label, what a checkpoint without the path held: a key newer than the checkpoint)."""
    may_change: dict[str, tuple[str, str]] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    """Files every checkpoint carries as they are (the run's tokenizer files, so that the checkpoint
    alone can encode and decode); names from storage.FILES."""
    init_from: dict | None = None
    """Where the run's first weights came from (path, sha256, format), when not from its seeded init;
    carried from checkpoint to checkpoint."""
    base: dict | None = None
    """A LoRA run's frozen base, which its checkpoints do not hold: {sha256: the base's identity
    (storage.model_sha256), identity: its version, init_from: where they were read (None: the seeded init), adapters_from: the
    adapters it began from (None: fresh)}; carried from checkpoint to checkpoint."""

    reference: dict | None = None
    """A DPO run's reference model: {sha256: its identity, identity: its version, source: where they were read
    (None: the seeded init)}; carried from checkpoint to checkpoint."""

    reward: dict | None = None
    """A GRPO run's reward: {spec, and for a user's function its file and sha256}; carried from checkpoint to checkpoint."""

    teacher: dict | None = None
    """A distillation's teacher: {sha256: its identity (its own architecture's), identity: its version, source: where
    they were read, architecture}; carried from checkpoint to checkpoint."""

    architecture: dict = field(default_factory=dict)
    """The model's architecture fields (`ModelConfig.architecture()`): part of the identity the
    manifest's `model_sha256` is (storage.model_sha256; docs/design.md "One model identity")."""

    RECORDED = ("world_size", "global_batch", "micro_batch", "accum", "threads", "reduce", "strategy", "config",
                "data_fingerprint", "run_id", "init_from", "base", "reference", "reward", "teacher", "architecture")

    def record(self) -> dict:
        return {k: getattr(self, k) for k in self.RECORDED}


def lookup(tree: Any, dotted: str) -> Any:
    """`tree["a"]["b"]` for "a.b"; None where a part is missing."""
    for part in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


@dataclass
class Resumed:
    """What `load()` found: the checkpoint's folder, its step, and the geometry it was written under."""

    path: Path
    step: int
    world_size: int
    micro_batch: int
    strategy: str
    data_fingerprint: dict = field(default_factory=dict)
    """The checkpoint's data fingerprint (what it read: data/repack.py continues a phase from it)."""


def _half(v: torch.Tensor, single_thread: bool = False) -> torch.Tensor:
    """One tensor of half_weights: a floating tensor as fp16 on the CPU, any other as it is."""
    v = v.detach()
    if single_thread and v.dtype == torch.float32 and v.device.type == "cpu":
        return torch.from_numpy(v.numpy().astype(np.float16))
    return v.to("cpu", torch.float16) if v.is_floating_point() else v.cpu()


def _shared(model_state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Every name to the first name of the same tensor (tied embeddings: one memory under two names)."""
    first: dict[tuple, str] = {}
    for k, v in model_state.items():
        first.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype), k)
    return {k: first[(v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype)] for k, v in model_state.items()}


def half_weights(model_state: dict[str, torch.Tensor], single_thread: bool = False) -> dict[str, torch.Tensor]:
    """fp16 copy for inference (MiniMind's convention); tensors that share memory stay one tensor.
    `single_thread`: convert fp32 CPU tensors with numpy (same rounding, no second OpenMP team
    fighting the training's for the cores)."""
    firsts, converted = _shared(model_state), {}
    for first in firsts.values():
        if first not in converted:
            converted[first] = _half(model_state[first], single_thread)
    return {k: converted[first] for k, first in firsts.items()}


_SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64",
                       torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def safetensors_header(specs: dict[str, tuple[torch.dtype, tuple]], metadata: dict[str, str]) -> bytes:
    """The start of a safetensors file whose tensors (name: (dtype, shape)) follow it in name order,
    laid out the same every time: the 8-byte header size, the JSON header (names sorted, the
    metadata's keys sorted; the library's own writer orders the metadata as a hash map does, so two
    saves of one state would differ), padded to 8 bytes."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


def write_half(path: Path, model_state: dict[str, torch.Tensor], single_thread: bool = False) -> dict:
    """The fp16 weights for inference (half_weights) as a safetensors file at `path` (any Hugging Face
    tool reads it), hashed as it is written and fsynced; returns its manifest entry. Each tensor is
    converted as the file reaches it, straight into the writer's stream (no copy of the whole). A
    tensor under two names (tied embeddings) is written once, the other name recorded in the file's
    metadata under storage.ALIASES (weights/sources.py gives it back)."""
    firsts = _shared(model_state)
    aliases = {k: first for k, first in firsts.items() if k != first}
    own = {k: model_state[k] for k in model_state if k not in aliases}
    specs = {k: (torch.float16 if v.is_floating_point() else v.dtype, tuple(v.shape)) for k, v in own.items()}
    meta = {"format": "pt", **({storage.ALIASES: json.dumps(aliases, sort_keys=True)} if aliases else {})}

    def stream():
        yield safetensors_header(specs, meta)
        for name in sorted(own):
            yield _half(own[name], single_thread).contiguous().reshape(-1).view(torch.uint8).numpy()

    return storage.write_file(path, stream())


def _tie(source: dict, copy: dict) -> dict:
    """`copy` (a state dict of the same structure as `source`) with one buffer wherever `source` has
    one tensor under two names (tied embeddings), so that a snapshot is the same state as its source."""
    first: dict[tuple, torch.Tensor] = {}

    def walk(src, dst):
        for key, value in src.items():
            if isinstance(value, dict):
                walk(value, dst[key])
            elif type(value) is torch.Tensor:
                same = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
                dst[key] = first.setdefault(same, dst[key])

    walk(source, copy)
    return copy


def dcp_failure(e: BaseException, what: str) -> storage.CheckpointError:
    """DCP's exception (every rank's failures gathered: every rank raises alike) as one
    CheckpointError with the first failing rank's error, and that rank as `failed_rank` (the
    failure protocol names it: run/protocol.py)."""
    failures = getattr(e, "failures", None)
    if not failures:
        return e if isinstance(e, storage.CheckpointError) else storage.CheckpointError(f"{what}: {type(e).__name__}: {e}")
    rank = min(failures)
    err = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    text = str(err) if isinstance(err, storage.CheckpointError) else f"{type(err).__name__}: {err}"
    more = f" (and on {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    out = storage.CheckpointError(f"{what}: {text}{more}")
    out.failed_rank = rank
    return out


class CheckpointManager:
    """`load(states)` once before the loop, `after_step(step, states, end)` after every optimizer
    step, `close()` at the end (it also runs when the run fails)."""

    def __init__(self, cfg: CheckpointConfig, out_dir: Path, comm: Collectives, meta: RunMeta, durable: tuple[Path, ...] = (),
                 shared: bool = False) -> None:
        self.cfg, self.comm, self.meta = cfg, comm, meta
        self.shared = shared
        """Several launches share the folder (live recovery's groups: docs/fault_tolerance.md): a load leaves the
        temporary folders alone (they may be a live writer's save under way)."""
        self.store = store_of(out_dir)
        """Where the checkpoints are: storage.LocalStore (a folder) or remote.RemoteStore (s3://...): the one switch."""
        self.root = self.store.root
        self.durable = tuple(Path(p) for p in durable)
        """Files whose contents up to a step must be as durable as that step's checkpoint (the metrics)."""
        self.token = comm.broadcast(uuid.uuid4().hex[:8])  # names this launch's temporary folders alike on every rank
        self.owned: set[Path] = set()  # checkpoints this run verified or published: the only ones pruning may delete
        self.resumed: Resumed | None = None  # what load() found, once it found one
        self._fresh: dict[str, dict] = {}  # the optional states as they were before load(): what one a checkpoint lacks goes back to
        self._group = None  # the process group of DCP's collectives (see _dcp)
        self._pool: ThreadPoolExecutor | None = None  # one thread for background writes, made at the first
        self._pending: Future | None = None
        self._retiring: list[Future] = []  # pruned checkpoints' files being deleted (storage.retire_later)
        self._error: BaseException | None = None
        self._staged: dict | None = None  # the buffers a background snapshot is copied into, reused
        self._dcp()  # the group now, while the set-up's store is there (a stop after the launcher died saves without it)
        format.prepare()  # DCP's modules now, not in a save: a launch's first save is often a stop's (exit 75 before the notice ends)

    # ---------------------------------------------------------------- DCP's process group
    def _dcp(self) -> dict:
        """How DCP meets the other ranks: on one process without a group; else on a gloo group of
        the manager's own (a background write's collectives must not share the training's group),
        made by every rank together when the manager is made, and destroyed in close()."""
        if self.comm.world_size == 1:
            return {"no_dist": True}
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return {"group": self._group}

    def close(self) -> None:
        """Wait for a background write (its error is kept, not raised: the run ends anyway), stop the
        thread and destroy the group. Any number of runs in one process each make and free their own."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None
        self._staged = None

    # ---------------------------------------------------------------- load
    def _candidates(self) -> list[tuple[str, dict | None, str | None, bool]]:
        """Rank 0: the checkpoints to try, in order, per checkpoint.resume: (folder, manifest, None, False),
        or (folder, None, why it cannot be used, whether it is of the earlier layout). Files present
        with their sizes, no link in them; nothing hashed yet."""
        mode = self.cfg.resume
        if isinstance(self.root, Path) and (self.root / CONVERT_JOURNAL).exists():
            raise storage.CheckpointMismatch(
                f"{self.root / CONVERT_JOURNAL}: a conversion of the earlier layout was interrupted; finish it first "
                f"(nothing was loaded or deleted): {storage.CONVERT} {self.root.parent}")
        if mode == "never":
            existing = self.store.list_steps()
            if existing:
                raise storage.CheckpointMismatch(
                    f"checkpoint.resume=never, but {self.root} already holds checkpoints "
                    f"({', '.join(p.name for _, p in existing)}); nothing was deleted. Use a new out_dir for a "
                    f"fresh run, or checkpoint.resume=auto to continue this one")
            return []
        if mode != "auto":
            path = location(mode)
            if isinstance(path, Path) and not (path / storage.MANIFEST).exists() and path.is_dir() and (path / storage.CHECKPOINTS).is_dir():
                raise storage.CheckpointMismatch(
                    f"checkpoint.resume={mode} is a run folder; give one of its checkpoints/step_* folders, "
                    f"or use checkpoint.resume=auto with out_dir={mode}")
            folders = [path]
        else:
            folders = [folder for _, folder in self.store.list_steps(warn=True)]
        out = []
        for folder in folders:
            try:
                out.append((str(folder), self._store_of(folder).listed(folder), None, False))  # checkpoint.resume: any place
            except storage.CheckpointError as e:
                out.append((str(folder), None, str(e), isinstance(e, storage.OldLayout)))
        return out

    def _store_of(self, folder) -> storage.LocalStore | RemoteStore:
        """The checkpoints a step folder is one of: this run's own (what it listed and read already), or another place's."""
        return self.store if folder.parent == self.root else store_of(folder.parent.parent)

    @torch.no_grad()
    def load(self, states: dict[str, Stateful]) -> Resumed | None:
        """Restore `states` from the checkpoint that checkpoint.resume names (None: fresh start).

        Rank 0 lists the candidates; every rank then loads the newest through DCP, each reading
        the files it needs once and using them only when their sha256 is the manifest's. A file
        that does not verify on any rank fails the load on every rank together, and every rank
        moves on to the previous checkpoint (never, for an explicit checkpoint.resume path). A
        state named in OPTIONAL_STATES that the checkpoint lacks starts fresh with a warning."""
        t0 = time.monotonic()
        # An optional state a checkpoint lacks starts as it is now (fresh), whichever checkpoint was tried before.
        self._fresh = {name: copy.deepcopy(states[name].state_dict()) for name in OPTIONAL_STATES if name in states}
        found: Any = None
        if self.comm.is_main:  # nothing is created here: the first publish makes the folder
            try:
                for what in () if self.shared else self.store.clear():
                    log.info("removed %s", what)
            except Exception as e:  # noqa: BLE001 - said below, on every rank
                found = {"error": f"{self.root}: {e}", "mismatch": False}
            try:
                found = found or {"candidates": self._candidates()}
            except storage.CheckpointError as e:
                found = {"error": str(e), "mismatch": isinstance(e, storage.CheckpointMismatch)}
            except Exception as e:  # anything else on rank 0 alone: every rank stops with it now, not at a timeout
                found = {"error": f"rank 0 could not list the checkpoints in {self.root}: {type(e).__name__}: {e}", "mismatch": False}
        found = self.comm.broadcast(found)
        if "error" in found:
            raise (storage.CheckpointMismatch if found["mismatch"] else storage.CheckpointError)(found["error"])
        explicit, faults = self.cfg.resume != "auto", []
        for folder, manifest, why, old_layout in found["candidates"]:
            path = location(folder)
            if old_layout:  # newer than any checkpoint that loads: converting it is the way on, not an older step (exit 2)
                raise storage.OldLayout(why)
            if manifest is not None:
                self._check_compatible(path, manifest)  # the same manifest on every rank: all raise alike
                try:
                    self._load_from(path, manifest, states)
                except storage.CheckpointMismatch:
                    raise  # sound, but not this run's: bad input on every rank alike, no fallback
                except storage.CheckpointError as e:  # unusable, whatever was damaged: the previous one is tried
                    why = str(e)
            if why is None:
                for bad in faults:  # newer than the one used: reported, never silently passed over
                    log.warning("skipping checkpoint %s", bad)
                return self._loaded(path, manifest, t0)
            if explicit:
                raise storage.CheckpointError(why)
            faults.append(why)
        if faults:
            # Checkpoints exist and none verifies: a fresh start would train over them. Stop (docs/design.md I13).
            listing = "\n".join(f"  {f}" for f in faults)
            raise storage.CheckpointError(
                f"{self.root}: no checkpoint verifies, so this run cannot resume, and it will not start "
                f"fresh over them (nothing was trained or deleted):\n{listing}\n"
                f"Ways on: checkpoint.resume=<a checkpoint folder you trust>, or a new out_dir")
        return None

    def _load_from(self, path: Path, manifest: dict, states: dict[str, Stateful]) -> None:
        """Every rank: fill `states` from the checkpoint at `path`. Raises on every rank alike:
        CheckpointMismatch when the checkpoint holds another structure than this run's (naming each
        key), CheckpointError when anything of it is unusable (damaged, forged, a link)."""
        meta_name = f"{format.STATE}/{format.METADATA}"
        data: Any = None
        store = self._store_of(path)  # the folder's own kind: checkpoint.resume may name a place other than out_dir
        src = store.files(path, manifest)  # where the listed files lie (the folder itself, or the save's prefix in the store)
        if self.comm.is_main:
            try:
                data = format.verified_bytes(src, meta_name, manifest["files"])
            except storage.CheckpointError as e:
                data = {"error": str(e)}
            except Exception as e:  # noqa: BLE001 - rank 0 alone: brought to every rank, not raised here
                data = {"error": f"{path / meta_name}: cannot be read ({type(e).__name__}: {e})"}
        data = self.comm.broadcast(data)  # rank 0 read and verified it; every rank unpickles and checks the same bytes
        if isinstance(data, dict):
            raise storage.CheckpointError(data["error"])
        metadata = format.read_metadata(data, src / meta_name, manifest["files"])  # chunk coverage and bounds checked
        # The load reads into memory of its own (or a target the state made for it: a fresh Adam's), never into
        # what the run holds: nothing is applied until every check passed (docs/design.md I13).
        target = {}
        for name, obj in states.items():
            if format.has(metadata, name):
                target[name] = obj.load_target() if hasattr(obj, "load_target") else obj.state_dict()
                if not getattr(obj, "target_is_new", False):
                    target[name] = _apart(target[name])
            elif name in OPTIONAL_STATES:
                log.warning("%s: no '%s' state in the checkpoint; it starts fresh", path, name)
            else:
                raise storage.CheckpointError(f"{path}: no '{name}' state in the checkpoint")
        mine = f"rng.{self.comm.rank}"
        if mine in format.keys(metadata):
            target["rng"] = {str(self.comm.rank): b""}
        # A structure DCP could not fill (a key it lacks, another size): named, agreed, before any read.
        misfits = self.comm.all_gather(format.structure_mismatches(target, metadata))
        if any(misfits):
            changed = [f"{label} {lookup(manifest, d)} -> {lookup(self.meta.record(), d)}" for d, (label, _) in self.meta.may_change.items()
                       if lookup(manifest, d) is not None and lookup(manifest, d) != lookup(self.meta.record(), d)]
            since = f" (changed since the checkpoint: {', '.join(changed)})" if changed else ""
            raise storage.CheckpointMismatch(
                f"{path}: its states do not fit this run's: {'; '.join(next(m for m in misfits if m)[:8])}{since}; nothing was loaded")
        # The files DCP does not read (the fp16 weights, the tokenizer's) verified beside the states' read: a resumed
        # checkpoint is whole, every file of it as the manifest says (it is counted as valid from now on).
        others = _hasher.submit(store.verify, path, manifest, lambda name: not name.startswith(f"{format.STATE}/")) \
            if self.comm.is_main else None
        try:
            try:
                format.load(target, src, manifest["files"], metadata, **self._dcp())
            except format.errors() as e:  # DCP gathered every rank's failure: all of them raise alike
                raise dcp_failure(e, f"loading {path}") from None
            finally:
                if others is not None:
                    concurrent.futures.wait([others])
            failed = None
            if others is not None and others.exception() is not None:
                e = others.exception()
                failed = str(e) if isinstance(e, storage.CheckpointError) else f"{path}: cannot be read ({type(e).__name__}: {e})"
            # Plain tensors (no shards to gather): the optimizer's identity is taken in a helper thread while this
            # one takes the model's, the two hashes on two cores instead of one after the other.
            optimizer = target.get("optimizer")
            plain = optimizer is not None and manifest.get("optimizer_sha256") is not None and \
                all(type(t) is torch.Tensor for t in storage.optimizer_tensors(optimizer).values())
            ahead = _hasher.submit(storage.optimizer_sha256, storage.optimizer_tensors(optimizer)) if plain else None
            try:  # on every rank alike, whatever failed above: a sharded state is gathered whole for them (a collective)
                self._check_identity(path, manifest, target.get("model"))
                self._check_optimizer(path, manifest, target.get("optimizer"), ahead)
            except storage.CheckpointError as e:
                failed = failed or str(e)
            finally:
                if ahead is not None:
                    concurrent.futures.wait([ahead])
            failures = [f for f in self.comm.all_gather(failed) if f]
            if failures:  # verified before applied: nothing of this checkpoint reached the run's states
                raise storage.CheckpointError(failures[0])
        except BaseException:
            for obj in states.values():
                if hasattr(obj, "discard_target"):
                    obj.discard_target()
            raise
        failed = None
        try:
            for name, obj in states.items():
                if name in target:
                    obj.load_state_dict(target[name])
                elif name in self._fresh:  # the fallback restores everything it holds, and what it lacks starts fresh
                    obj.load_state_dict(copy.deepcopy(self._fresh[name]))
            if "rng" in target:
                rng.restore_blob(target["rng"][str(self.comm.rank)], self.comm.device)
        except Exception as e:  # noqa: BLE001 - what was read does not load (a forged item): unusable, on every rank alike
            failed = f"{path}: its states do not load ({type(e).__name__}: {e})"
        failures = [f for f in self.comm.all_gather(failed) if f]
        if failures:
            raise storage.CheckpointError(failures[0])
        if "rng" not in target:  # a rank that did not exist before: its generators get a seed-derived state
            rng.seed_fresh(lookup(manifest, "config.seed") or 0, self.comm.rank, int(manifest["step"]))
            log.warning("rank %d has no saved RNG state (the checkpoint had %d ranks); seeded it from (seed, rank, step)",
                        self.comm.rank, manifest.get("world_size", 0))

    def _check_identity(self, path: Path, manifest: dict, model: dict) -> None:
        """What was loaded is what was saved: the identity of the model state DCP filled equals the
        manifest's model_sha256 (docs/design.md "One model identity"), else the checkpoint is
        unusable (a metadata that maps a tensor's name to another's bytes, a chunk read twice).
        Sharded states are gathered whole for it, on every rank alike (one all-gather per resume)."""
        if model is None:
            return
        if manifest.get("identity") != storage.IDENTITY:
            if manifest.get("format", 0) >= 3:  # every format-3 manifest was written with it: one without was edited
                raise storage.CheckpointError(f"{path}: its manifest (format {manifest.get('format')}) records no model identity "
                                              f"(\"identity\": {storage.IDENTITY}, found {manifest.get('identity')!r}): damaged or "
                                              f"edited, so what was loaded cannot be checked")
            return  # an earlier release's manifest: its hash is of the dict's order, checked by the tools
        whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sorted(model.items())}
        got = storage.model_sha256(whole, self.meta.architecture)
        if got != manifest.get("model_sha256"):
            raise storage.CheckpointError(f"{path}: the loaded model's identity {got} is not the {manifest.get('model_sha256')} "
                                          f"its manifest recorded at the save: the state files' metadata is damaged")

    def _check_optimizer(self, path: Path, manifest: dict, optimizer: dict | None, ahead: Future | None = None) -> None:
        """The optimizer state DCP filled has the identity the manifest recorded at the save
        (storage.optimizer_sha256), as the model's: else the checkpoint is unusable (one parameter's
        moments handed to another, the files' hashes rewritten to match). A manifest written before
        optimizer identities has none to check. `ahead`: that identity, being taken in a helper thread."""
        want = manifest.get("optimizer_sha256")
        if optimizer is None or want is None:
            return
        got = ahead.result() if ahead is not None else storage.optimizer_sha256(storage.optimizer_tensors(optimizer))
        if got != want:
            raise storage.CheckpointError(f"{path}: the loaded optimizer state's identity {got} is not the {want} its manifest "
                                          f"recorded at the save: the state files or their metadata are damaged")

    def _loaded(self, path: Path, manifest: dict, t0: float) -> Resumed:
        if self.comm.is_main and path.parent == self.root:
            self.owned.add(path)  # verified just now
        self.meta.run_id = manifest.get("run_id", self.meta.run_id)
        for key in ("init_from", "base", "reference", "reward", "teacher"):  # what the run began from and pinned, carried on
            setattr(self.meta, key, manifest.get(key))
        step = int(manifest["step"])
        log.info("loaded %s: step %d, %.2fs", path, step, time.monotonic() - t0)
        for dotted, (label, consequence) in self.meta.may_change.items():
            then, now = lookup(manifest, dotted), lookup(self.meta.record(), dotted)
            if then is not None and then != now:
                log.warning("%s was %s, now %s: %s", label, then, now, consequence)
        self.resumed = Resumed(path, step, manifest["world_size"], manifest["micro_batch"], manifest.get("strategy", "ddp"),
                               manifest.get("data_fingerprint") or {})
        return self.resumed

    def _check_compatible(self, path: Path, manifest: dict) -> None:
        """A resume whose checkpoint differs in a `must_match` path is an error naming each."""
        ours = self.meta.record()

        def said(tree: dict, dotted: str) -> str:  # a value, and where it came from when a "<path>_source" says so
            source = lookup(tree, f"{dotted}_source")
            return f"{lookup(tree, dotted)}{f' ({source})' if source else ''}"

        def saved(dotted: str):  # what the checkpoint holds; a path newer than it: the value it stood for (a (label, value) entry)
            then, spec = lookup(manifest, dotted), self.meta.must_match[dotted]
            return spec[1] if then is None and isinstance(spec, tuple) else then

        def differs(dotted: str, label) -> str:
            label = label[0] if isinstance(label, tuple) else label
            then, now = saved(dotted), lookup(ours, dotted)
            if isinstance(then, dict) and isinstance(now, dict):  # e.g. a corpus's files: name the keys that differ
                def change(k) -> str:  # a setting's two values; a file's hash is only said to differ
                    short = all(isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 40) for v in (then[k], now[k]))
                    return f"changed ({then[k]} in the checkpoint, {now[k]} in this run)" if short else "changed"

                parts = [f"{k} {what}" for k, what in (
                    *((k, "is gone") for k in then if k not in now), *((k, "is new") for k in now if k not in then),
                    *((k, change(k)) for k in then if k in now and then[k] != now[k]))]
                return f"{label}: {', '.join(parts)} since the checkpoint"
            return f"{label} is {said(manifest, dotted)} in the checkpoint, {said(ours, dotted)} in this run"

        diffs = [differs(d, label) for d, label in self.meta.must_match.items() if saved(d) != lookup(ours, d)]
        if diffs:
            raise storage.CheckpointMismatch(f"{path}: cannot resume this run from it: " + "; ".join(diffs))

    # ---------------------------------------------------------------- after each step
    def due(self, step: int) -> bool:
        """Whether checkpoint.interval saves after optimizer step `step`."""
        return bool(self.cfg.interval and step % self.cfg.interval == 0)

    def after_step(self, step: int, states: dict[str, Stateful], end: str | None) -> None:
        """Called by every rank after optimizer step `step` (docs/design.md I7) with how the run ends
        here, as every rank agreed ("stopped", "halted", "finished"), or None to go on. Saves at an
        end or when the interval is due; at an end the save is waited for (and written in the
        foreground: an async snapshot would only add to the time from a stop signal to the checkpoint)."""
        if end or self.due(step):
            self.save(step, states, background=self.cfg.async_ and not end)
        if end:
            self.drain()

    @torch.no_grad()
    def save(self, step: int, states: dict[str, Stateful], background: bool | None = None, rng_states: list[bytes] | None = None) -> None:
        """Save at this optimizer-step boundary; called by every rank. One path: the snapshot, then
        the write (DCP: every rank writes its items, the coordinator lists them in the manifest and
        publishes), either here (returns once published; raises on every rank if not) or in the
        background thread after a copy of the snapshot (a failure surfaces at a later boundary).
        `rng_states`: every rank's generator states to record instead of this launch's (the converter's)."""
        background = self.cfg.async_ if background is None else background
        t0 = time.monotonic()
        self.wait()  # one save at a time; a failure of the previous one was agreed at a boundary or is raised here alike
        if self._error is not None:
            raise self._failure()
        blobs = rng_states or self.comm.gather(rng.rng_blob(self.comm.device))  # a collective: rank 0 writes every rank's states
        snapshot = {name: obj.state_dict() for name, obj in states.items()}
        if blobs is not None:
            snapshot["rng"] = {str(r): blob for r, blob in enumerate(blobs)}
        dcp = self._dcp()
        tmp = self.store.staging(step, self.token)
        if not background:
            self._write(step, snapshot, tmp, dcp, False, t0)
            return
        snapshot = self._stage(snapshot)
        self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")
        self._pending = self._pool.submit(self._write, step, snapshot, tmp, dcp, True, t0)
        if self.comm.is_main:
            log.info("checkpoint step %d: snapshot taken in %.3fs, writing in the background", step, time.monotonic() - t0)

    def _stage(self, snapshot: dict) -> dict:
        """A copy of `snapshot` in CPU memory (pinned on CUDA), into the buffers of the previous
        copy when the structure is the same (DCP's own staging helpers: DTensors stay DTensors)."""
        from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

        if self._staged is not None:
            try:
                return _copy_state_dict(snapshot, self._staged)
            except (AssertionError, CompanionMismatch, KeyError, RuntimeError, TypeError, ValueError):  # another structure: new buffers
                pass
        self._staged = _tie(snapshot, _create_cpu_state_dict(snapshot, pin_memory=self.comm.device.type == "cuda"))
        return _copy_state_dict(snapshot, self._staged)

    def _write(self, step: int, snapshot: dict, tmp: Path, dcp: dict, background: bool, t0: float) -> None:
        """Every rank: write `snapshot` with DCP into `tmp`; the coordinator publishes it (inside
        DCP's finish, so that any failure there reaches every rank), then prunes."""
        published: list[Path] = []
        model, half, model_sha, opt_sha = snapshot["model"], None, None, None
        whole = all(type(t) is torch.Tensor for t in model.values())
        opt = storage.optimizer_tensors(snapshot["optimizer"]) if "optimizer" in snapshot else None
        if self.comm.is_main and whole:
            # From the same snapshot, beside the state files' write: the fp16 file and the weights' identity.
            tmp.mkdir(parents=True, exist_ok=True)
            half = _hasher.submit(write_half, tmp / storage.WEIGHTS_FILE, model, background)
            model_sha = _hasher.submit(storage.model_sha256, model, self.meta.architecture)
        if self.comm.is_main and opt is not None and all(type(t) is torch.Tensor for t in opt.values()):
            opt_sha = _hasher.submit(storage.optimizer_sha256, opt)

        def publish(entries: dict, metadata) -> None:
            nonlocal half, model_sha, opt_sha
            if half is None:  # shards (DTensors): read back whole, once every rank's are on disk
                whole_model = format.read_tensors(tmp, entries, metadata, "model.")
                model_sha = _hasher.submit(storage.model_sha256, whole_model, self.meta.architecture)
                half = _hasher.submit(write_half, tmp / storage.WEIGHTS_FILE, whole_model, background)
            if opt is not None and opt_sha is None:  # the optimizer's shards, the same way
                opt_sha = _hasher.submit(storage.optimizer_sha256, format.read_tensors(tmp, entries, metadata, "optimizer.state."))
            self.store.make_durable(self.durable)  # the log up to this step is as durable as this checkpoint (docs/design.md I11)
            manifest = {**snapshot["train"], **self.meta.record(), "model_sha256": model_sha, "identity": storage.IDENTITY,
                        **({"optimizer_sha256": opt_sha} if opt_sha is not None else {}), "created_unix": time.time()}
            written = {**entries, storage.WEIGHTS_FILE: half}
            final = self.store.publish(step, dict(self.meta.files), manifest, tmp, written)
            self.owned.add(final)
            pruned = self.store.prune(self.cfg.keep, self.owned, later=self._retire)
            published.append(final)
            log.info("saved %s: step %d, %.2fs%s", final, step, time.monotonic() - t0,
                     f", pruned {', '.join(p.name for p in pruned)}" if pruned else "")

        try:
            format.save(snapshot, tmp, publish if self.comm.is_main else None, **dcp)
        except format.errors() as e:  # DCP gathered every rank's failure: every rank raises alike
            raise dcp_failure(e, f"saving step {step}") from None
        finally:
            if half is not None:
                concurrent.futures.wait([half])  # done writing into tmp before it is removed (its error, if any, was raised)
            if self.comm.is_main and not published:
                self.store.discard(tmp)

    # ---------------------------------------------------------------- background bookkeeping
    def _retire(self, fn) -> None:
        """Delete a pruned checkpoint's files in the helper thread (the next save, and the run's end, wait for it)."""
        self._retiring.append(_retirer.submit(fn))

    def wait(self) -> None:
        """Block until the pending background write, and the deletion of what was pruned, are done; keep the write's error."""
        self._wait_write()
        retiring, self._retiring = self._retiring, []
        concurrent.futures.wait(retiring)

    def _wait_write(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()
            except BaseException as e:  # surfaced through failure() and the boundary's vote, never lost
                self._error = e
            self._pending = None

    def failure(self) -> BaseException | None:
        """A background write that failed (non-blocking: None while one is still being written).
        The loop votes on it at the next step boundary (run/protocol.py)."""
        if self._pending is not None and self._pending.done():
            self._wait_write()
        return self._error

    def _failure(self) -> storage.CheckpointError:
        e = self._error
        return e if isinstance(e, storage.CheckpointError) else storage.CheckpointError(f"saving a checkpoint failed: {type(e).__name__}: {e}")

    def drain(self) -> None:
        """Wait for the pending save (end of run, halt, stop); raise if it failed, on every rank
        (a background write fails on every rank alike: DCP gathers the failures)."""
        self.wait()
        if self.comm.any(self._error is not None):
            raise self._failure() if self._error is not None else storage.CheckpointError("a background save failed on another rank")


_retirer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-prune")
"""Deletes pruned checkpoints' files (storage.retire_later); it logs, never raises."""
_hasher = ThreadPoolExecutor(max_workers=3, thread_name_prefix="ckpt-half")
"""The fp16 weights file, the weights' identity and the optimizer's, each in a thread beside the state files' write."""


def _apart(tree: Any) -> Any:
    """`tree` with every tensor replaced by an uninitialised one of its kind (shape, dtype, device, a
    DTensor's placement) and every container by a new one: what a load reads into before anything is
    checked, so that the run's own states are untouched until they are."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {k: _apart(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_apart(v) for v in tree)
    return tree


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
