"""The checkpoint manager: the loop's two calls, `load()` at start-up and `after_step()` after
every optimizer step.

It takes the run's stateful pieces as a dict (name -> object with `state_dict()` /
`load_state_dict()`) and knows nothing of their insides, except that "model" also goes into the
fp16 weights file for inference and "train" holds the step. What the run is (its geometry, config
and identity) comes as a `RunMeta`; the few collectives it needs come through `Collectives`. Only
global rank 0 writes; every rank takes part in the decisions (which checkpoint, stop or not, did
the save succeed) so that no rank is left waiting in a collective.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from . import rng, runfolder, sharded, storage
from .files import atomic_write, fsync_path
from .config import CheckpointConfig

log = logging.getLogger("minimind")
_model_hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-model-sha")
RESUME_FORMAT = "minimind-resume/1"
OPTIONAL_STATES = frozenset({"scaler"})
"""States a resume file may lack: they start fresh, with a warning (a GradScaler when a float32 or
bfloat16 run continues in float16)."""


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


@dataclass
class RunMeta:
    """What a run is, written into every resume file (flat, as below) and manifest.

    `must_match` and `may_change` are dotted paths into a resume file (e.g. "config.model.dim",
    "global_batch"), each with the label an error or warning uses: a resume whose checkpoint
    differs in a `must_match` path is refused (CheckpointMismatch, naming each), one that differs
    in a `may_change` path warns with the old and new values and the consequence given."""

    world_size: int
    global_batch: int
    micro_batch: int
    accum: int
    threads: int
    reduce: str
    config: dict
    data_fingerprint: dict
    run_id: str
    must_match: dict[str, str] = field(default_factory=dict)
    may_change: dict[str, tuple[str, str]] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    """Files every checkpoint carries as they are, beside the resume and weights files (the run's
    tokenizer files, so that the checkpoint alone can encode and decode); names from storage.FILES."""

    init_from: dict | None = None
    """Where the run's first weights came from (path, sha256, format), when not from its seeded init;
    carried from checkpoint to checkpoint."""

    RECORDED = ("world_size", "global_batch", "micro_batch", "accum", "threads", "reduce", "config", "data_fingerprint", "run_id",
                "init_from")

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


def _share_key(t: torch.Tensor) -> tuple:
    """Two state_dict entries with this key are one tensor (tied embeddings): copy it once."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _to_cpu_copy(obj: Any, pin: bool, memo: dict | None = None, spare: list | None = None) -> Any:
    """A deep copy with every tensor in (pinned) CPU memory: the snapshot an async save works from.
    Tensors that share memory (tied embeddings) stay shared, so the file matches a sync save's.

    `spare`: the previous snapshot's tensors, in the order this copy meets them (memo["order"]
    collects them for the next one): a tensor of the same shape and dtype is copied into, so a
    save does not pay for fresh memory (page faults) every time."""
    memo = {"order": []} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = _share_key(obj)
        if key not in memo:
            i, src = len(memo["order"]), obj.detach()
            old = spare[i] if spare is not None and i < len(spare) else None
            if old is not None and old.shape == src.shape and old.dtype == src.dtype and old.is_pinned() == pin:
                memo[key] = old.copy_(src)
            elif pin:
                memo[key] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
            else:
                memo[key] = src.to("cpu", copy=True)
            memo["order"].append(memo[key])
        return memo[key]
    if isinstance(obj, dict):
        out = type(obj)((k, _to_cpu_copy(v, pin, memo, spare)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu_copy(v, pin, memo, spare) for v in obj)
    return obj


def half_weights(model_state: dict[str, torch.Tensor], single_thread: bool = False) -> dict[str, torch.Tensor]:
    """fp16 copy for inference (MiniMind's convention); tied tensors stay one tensor.
    `single_thread`: convert fp32 CPU tensors with numpy (same rounding, no OpenMP team)."""
    seen: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in model_state.items():
        key = _share_key(v)
        if key not in seen:
            v = v.detach()
            if single_thread and v.dtype == torch.float32 and v.device.type == "cpu":
                seen[key] = torch.from_numpy(v.numpy().astype(np.float16))
            else:
                seen[key] = v.to("cpu", torch.float16) if v.is_floating_point() else v.cpu()
        out[k] = seen[key]
    return out


def truncate_metrics(path: Path, step: int) -> int:
    """Drop metrics lines past `step` (and any half-written line) so a resumed log equals an
    uninterrupted one (docs/design.md I11); the kept lines must be exactly steps 1..step, else
    CheckpointError (a log with a gap, e.g. after a power loss, is not silently continued). Returns
    the number of lines kept."""
    if not path.exists():
        return 0
    kept, steps = [], []
    for line in path.read_text().splitlines():
        try:
            s = json.loads(line)["step"]
            if s <= step:
                kept.append(line)
                steps.append(s)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    if steps != list(range(1, step + 1)):
        missing = sorted(set(range(1, step + 1)) - set(steps))
        raise storage.CheckpointError(
            f"{path}: the log up to the resumed step {step} should hold steps 1..{step} once each, but "
            f"{f'lacks steps {missing[:10]}' if missing else 'repeats or misorders steps'}{' ...' if len(missing) > 10 else ''}; "
            f"a resumed log would not equal the uninterrupted one. Move the file aside to resume (the new log then "
            f"starts at step {step + 1})")
    atomic_write(path, "".join(k + "\n" for k in kept))
    return len(kept)


class CheckpointManager:
    """`load(states)` once before the loop, `after_step(step, states, ...)` after every optimizer step."""

    def __init__(self, cfg: CheckpointConfig, out_dir: Path, comm: Collectives, meta: RunMeta) -> None:
        self.cfg, self.comm, self.meta = cfg, comm, meta
        self.root = Path(out_dir) / runfolder.CHECKPOINTS
        self.metrics_path = Path(out_dir) / runfolder.METRICS
        self.owned: set[Path] = set()  # checkpoints this run verified or published: the only ones pruning may delete
        self._pool: ThreadPoolExecutor | None = None  # made at the first async save
        self._pending: Future | None = None
        self._spare: list | None = None  # a finished snapshot's tensors, reused by the next one
        self._snapshot_tensors: list | None = None  # the pending snapshot's
        self._error: BaseException | None = None

    # ---------------------------------------------------------------- load
    def _choose(self) -> tuple[Path, dict, bytes] | None:
        """Rank 0: the checkpoint to resume from, per checkpoint.resume, with its resume file
        (read once, verified) and that file's bytes; None: a fresh start."""
        mode = self.cfg.resume
        if mode == "never":
            existing = storage.list_checkpoints(self.root)
            if existing:
                raise storage.CheckpointMismatch(
                    f"checkpoint.resume=never, but {self.root} already holds checkpoints "
                    f"({', '.join(p.name for _, p in existing)}); nothing was deleted. Use a new out_dir for a "
                    f"fresh run, or checkpoint.resume=auto to continue this one")
            return None
        if mode != "auto":
            path = Path(mode)
            if not (path / storage.MANIFEST).exists() and path.is_dir() and (path / runfolder.CHECKPOINTS).is_dir():
                raise storage.CheckpointMismatch(
                    f"checkpoint.resume={mode} is a run folder; give one of its checkpoints/step_* folders, "
                    f"or use checkpoint.resume=auto with out_dir={mode}")
            return path, *_load_verified(path)[1:]  # an explicit path must verify or the run fails
        faults = []
        for step, folder in storage.list_checkpoints(self.root, warn=True):
            try:
                _, payload, data = _load_verified(folder)
            except storage.CheckpointError as e:
                faults.append((step, folder, str(e)))
                continue
            for bad, _, error in faults:  # newer than the one chosen: reported, never silently passed over
                log.warning("skipping checkpoint step %d: %s", bad, error)
            return folder, payload, data
        if faults:
            # Checkpoints exist and none verifies: a fresh start would train over them. Stop (docs/design.md I13).
            listing = "\n".join(f"  {folder}: {error}" for _, folder, error in faults)
            raise storage.CheckpointError(
                f"{self.root}: no checkpoint verifies, so this run cannot resume, and it will not start "
                f"fresh over them (nothing was trained or deleted):\n{listing}\n"
                f"Ways on: checkpoint.resume=<a checkpoint folder you trust>, or a new out_dir")
        return None

    def load(self, states: dict[str, Stateful]) -> Resumed | None:
        """Restore `states` from the checkpoint that checkpoint.resume names (None: fresh start).

        Rank 0 alone reads the resume file, once, and verifies it; the other ranks get those bytes
        from it (a broadcast) and deserialize them, so a launch reads the checkpoint once however
        many ranks it has (not once per rank from a shared filesystem). A state named
        in OPTIONAL_STATES that the checkpoint lacks starts fresh with a warning (a GradScaler when a
        float32 or bfloat16 run continues in float16); any other missing state is an error."""
        t0, read0 = time.monotonic(), bytes_read()
        choice: Any = None
        payload = data = None
        if self.comm.is_main:  # nothing is created here: the first publish makes the folder
            for p in storage.clear_temporaries(self.root):
                log.info("removed %s, left by an interrupted save", p)
            try:
                chosen = self._choose()
                if chosen:
                    payload, data = chosen[1], chosen[2]
                choice = {"path": str(chosen[0]) if chosen else None}
            except storage.CheckpointError as e:
                choice = {"error": str(e), "mismatch": isinstance(e, storage.CheckpointMismatch)}
            except Exception as e:  # anything else on rank 0 alone: every rank stops with it now, not at a timeout
                choice = {"error": f"rank 0 could not choose a checkpoint in {self.root}: {type(e).__name__}: {e}", "mismatch": False}
        choice = self.comm.broadcast(choice)
        if "error" in choice:
            raise (storage.CheckpointMismatch if choice["mismatch"] else storage.CheckpointError)(choice["error"])
        if choice["path"] is None:
            if self.comm.is_main:
                truncate_metrics(self.metrics_path, 0)
            return None

        path = Path(choice["path"])
        if self.comm.is_main and path.parent == self.root:
            self.owned.add(path)  # verified just now
        if self.comm.world_size > 1:
            data = self.comm.broadcast(data)  # the bytes rank 0 verified
        error = None
        try:
            if payload is None:  # the other ranks: rank 0's verified bytes, deserialized here (weights_only)
                payload = storage.deserialize(data, path / storage.RESUME_FILE, "cpu")
            self._check_compatible(path, payload)
            ours = any(sharded.is_sharded(obj) for obj in states.values())
            if bool(payload.get("sharded")) != ours:
                theirs = "dist.strategy=fsdp (sharded)" if payload.get("sharded") else "dist.strategy=ddp (not sharded)"
                raise storage.CheckpointMismatch(
                    f"{path}: written by a {theirs} run; this run is dist.strategy={'fsdp' if ours else 'ddp'}: resume it with "
                    f"the strategy that wrote it (docs/sharding.md)")
            for name, obj in states.items():
                if sharded.is_sharded(obj):
                    obj.load_state_dict(sharded.load(obj.state_dict(), path))  # resharded to this world size
                elif name in payload:
                    obj.load_state_dict(payload[name])
                elif name in OPTIONAL_STATES:
                    log.warning("%s: no '%s' state in the resume file; it starts fresh", path, name)
                else:
                    raise storage.CheckpointError(f"{path / storage.RESUME_FILE}: no '{name}' state in the resume file")
            self._restore_rng(payload)
        except storage.CheckpointError as e:
            error = (isinstance(e, storage.CheckpointMismatch), str(e))
        # Every rank loaded; if any failed, all stop here together (no rank enters training alone).
        outcomes = self.comm.all_gather((error, bytes_read() - read0))
        failed = [(r, e) for r, (e, _) in enumerate(outcomes) if e]
        if failed:
            rank, (mismatch, message) = failed[0]
            cls = storage.CheckpointMismatch if mismatch else storage.CheckpointError
            raise cls(message if error else f"rank {rank} could not load {path}: {message}")

        self.meta.run_id = payload.get("run_id", self.meta.run_id)
        self.meta.init_from = payload.get("init_from")
        step = int(payload["train"]["step"])
        if self.comm.is_main:
            truncate_metrics(self.metrics_path, step)
        size = len(data) if data is not None else 0
        log.info("loaded %s: step %d, %.2fs; %.1f MiB read from files by %d rank(s) for a %.1f MiB resume file",
                 path, step, time.monotonic() - t0, sum(n for _, n in outcomes) / 2**20, len(outcomes), size / 2**20)
        for dotted, (label, consequence) in self.meta.may_change.items():
            then, now = lookup(payload, dotted), lookup(self.meta.record(), dotted)
            if then is not None and then != now:
                log.warning("%s was %s, now %s: %s", label, then, now, consequence)
        return Resumed(path, step, payload["world_size"], payload["micro_batch"])

    def _check_compatible(self, path: Path, payload: dict) -> None:
        """A resume whose checkpoint differs in a `must_match` path is an error naming each."""
        if not isinstance(payload, dict) or payload.get("format") != RESUME_FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise storage.CheckpointError(f"{path / storage.RESUME_FILE}: not a resume file of this trainer (format {found!r})")
        ours = self.meta.record()

        def said(tree: dict, dotted: str) -> str:  # a value, and where it came from when a "<path>_source" says so
            source = lookup(tree, f"{dotted}_source")
            return f"{lookup(tree, dotted)}{f' ({source})' if source else ''}"

        def differs(dotted: str, label: str) -> str:
            then, now = lookup(payload, dotted), lookup(ours, dotted)
            if isinstance(then, dict) and isinstance(now, dict):  # e.g. a corpus's files: name the keys that differ
                parts = [f"{k} {what}" for k, what in (
                    *((k, "is gone") for k in then if k not in now), *((k, "is new") for k in now if k not in then),
                    *((k, "changed") for k in then if k in now and then[k] != now[k]))]
                return f"{label}: {', '.join(parts)} since the checkpoint"
            return f"{label} is {said(payload, dotted)} in the checkpoint, {said(ours, dotted)} in this run"

        diffs = [differs(dotted, label) for dotted, label in self.meta.must_match.items() if lookup(payload, dotted) != lookup(ours, dotted)]
        if diffs:
            raise storage.CheckpointMismatch(f"{path}: cannot resume this run from it: " + "; ".join(diffs))

    def _restore_rng(self, payload: dict) -> None:
        states = payload.get("rng") or []
        if self.comm.rank < len(states):
            rng.restore(states[self.comm.rank], self.comm.device)
        else:
            # A rank that did not exist before: its generators get a seed-derived state.
            rng.seed_fresh(lookup(payload, "config.seed") or 0, self.comm.rank, int(payload["train"]["step"]))
            log.warning("rank %d has no saved RNG state (the checkpoint had %d ranks); seeded it from (seed, rank, step)",
                        self.comm.rank, len(states))

    # ---------------------------------------------------------------- after each step
    def after_step(self, step: int, states: dict[str, Stateful], stop: bool, end: str | None) -> str | None:
        """Called by every rank after optimizer step `step` (docs/design.md I7). One collective decides for
        every rank together (docs/design.md I9): did any rank get a stop signal (`stop`), did a background save
        fail (then all raise). Saves when the run ends here ("stopped", or the loop's `end`:
        "halted", "finished") or the interval is due; at an end, drains the pending async save.
        Returns how the run ends here, or None to go on."""
        stop_votes, save_failures = self.comm.sum([float(stop), float(self._failed())])
        if save_failures:
            self._raise_failure()
        # A stop signal at the run's last step (or its halt) changes nothing: that end is saved and said.
        reason = end or ("stopped" if stop_votes else None)
        if reason or (self.cfg.interval and step % self.cfg.interval == 0):
            # The last save of a run is waited for anyway: written here, without the snapshot copy
            # (an async snapshot would only add to the time from a stop signal to the checkpoint).
            self.save(step, states, background=self.cfg.async_ and not reason)
        if reason:
            self.drain()
        return reason

    def save(self, step: int, states: dict[str, Stateful], background: bool | None = None) -> None:
        """Save at this optimizer-step boundary: called by every rank, rank 0 writes.

        Synchronous: returns once the checkpoint is published, and raises on every rank if it was
        not. In the background (checkpoint.async, unless `background` says otherwise): returns
        after the snapshot; a failure surfaces at the next boundary.
        """
        background = self.cfg.async_ if background is None else background
        t0 = time.monotonic()
        rng_states = self.comm.gather(rng.capture(self.comm.device))  # a collective: every rank
        if any(sharded.is_sharded(obj) for obj in states.values()):
            return self._save_sharded(step, states, rng_states, t0, background)
        failed = False
        if self.comm.is_main:
            self.wait()  # the previous async save, before a new one
            # The log up to this step is as durable as the checkpoint of this step (docs/design.md I11).
            if self.metrics_path.exists():
                fsync_path(self.metrics_path)
            pin = background and self.comm.device.type == "cuda"
            snapshot = {name: obj.state_dict() for name, obj in states.items()}
            if background:
                # The stall is this copy alone; the fp16 copy is made in the background from it,
                # with numpy (one thread: a torch op there would start a second OpenMP team that
                # fights the training's for the cores).
                memo: dict = {"order": []}
                snapshot = _to_cpu_copy(snapshot, pin, memo, self._spare)
                self._spare = None  # in use until this write is done; then its tensors are the spare ones
                self._snapshot_tensors = memo["order"]
                self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")
                self._pending = self._pool.submit(self._write, step, snapshot, None, rng_states, t0)
                log.info("checkpoint step %d: snapshot taken in %.3fs, writing in the background", step, time.monotonic() - t0)
            else:
                try:
                    self._write(step, snapshot, half_weights(snapshot["model"]), rng_states, t0)
                except Exception as e:  # published or not, every rank hears of it at once (docs/design.md I9)
                    self._error, failed = e, True
        if not background and self.comm.any(failed):
            self._raise_failure()

    def _save_sharded(self, step: int, states: dict[str, Stateful], rng_states: list | None, t0: float,
                      background: bool = False) -> None:
        """A sharded save (docs/design.md I19): every rank writes its shards with DCP into the step's
        temporary folder and hashes them; rank 0 gathers the hashes, writes the resume file (the
        states that are not sharded), the fp16 weights (the full model, gathered to it) and the one
        manifest, and publishes the folder by the same rename. Synchronous: all ranks fail together
        here. In the background: every rank returns once DCP has staged its shards in CPU memory;
        each rank's thread writes and hashes its shards and leaves the hashes in a small file that
        rank 0's thread collects before it publishes; a failure anywhere surfaces at the next boundary."""
        [(name, obj)] = [(n, o) for n, o in states.items() if sharded.is_sharded(o)]
        self.wait()  # every rank: its previous background save first (one DCP save at a time on its group)
        full = obj.full_model_state()  # a collective: rank 0 gets the full fp32 model
        tmp, error, entries = None, None, {}
        if self.comm.is_main:
            try:
                tmp = storage.new_temporary(self.root, step)
            except OSError as e:
                error = f"{self.root}: {e.strerror or e}"
        tmp = self.comm.broadcast(str(tmp) if tmp else error and {"error": error})
        if isinstance(tmp, dict):
            raise storage.CheckpointError(f"saving step {step} failed: {tmp['error']}")
        tmp = Path(tmp)
        snapshot = {n: o.state_dict() for n, o in states.items() if n != name} if self.comm.is_main else {}
        if background:
            snapshot = _to_cpu_copy(snapshot, False)
            staged = sharded.save_async(obj.state_dict(), tmp)  # a collective; returns after the copy
            self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")
            self._pending = self._pool.submit(self._finish_sharded, step, name, staged, tmp, snapshot, full, rng_states, t0)
            if self.comm.is_main:
                log.info("checkpoint step %d: shards staged in %.3fs, writing in the background", step, time.monotonic() - t0)
            return
        try:
            entries = sharded.save(obj.state_dict(), tmp, self.comm.rank)
        except Exception as e:  # DCP raises on every rank when one fails; each says why
            error = f"rank {self.comm.rank}: {type(e).__name__}: {e}"
        gathered = self.comm.gather((entries, error))
        failed = False
        if self.comm.is_main:
            try:
                errors = [e for _, e in gathered if e]
                if errors:
                    raise storage.CheckpointError(f"saving step {step} failed: the shards: {errors[0]}")
                self._publish_sharded(step, name, tmp, {k: v for part, _ in gathered for k, v in part.items()}, snapshot,
                                      full, rng_states, t0)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                self._error, failed = e, True
        if self.comm.any(failed):
            self._raise_failure()

    def _publish_sharded(self, step: int, name: str, tmp: Path, written: dict, snapshot: dict, full: dict,
                         rng_states: list | None, t0: float) -> None:
        """Rank 0: the rest of a sharded checkpoint beside its shards, then the publish."""
        if self.metrics_path.exists():
            fsync_path(self.metrics_path)
        self._write(step, {**snapshot, "sharded": {name: sharded.SHARDS}}, half_weights(full, single_thread=True), rng_states, t0,
                    model=full, tmp=tmp, written=written)

    def _finish_sharded(self, step: int, name: str, staged, tmp: Path, snapshot: dict, full: dict,
                        rng_states: list | None, t0: float, wait_s: float = 600.0) -> None:
        """Every rank's background thread of a sharded save (see _save_sharded)."""
        rank = self.comm.rank
        try:
            staged.result()
            outcome = {"entries": sharded.hash_own(tmp, rank)}
        except Exception as e:
            outcome = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
        atomic_write(tmp / f".hashes-{rank}.json", json.dumps(outcome))  # rank 0 waits for every rank's
        if "error" in outcome and not self.comm.is_main:
            raise storage.CheckpointError(f"saving step {step} failed: {outcome['error']}")
        if not self.comm.is_main:
            return
        try:
            written, end = {}, time.monotonic() + wait_s
            for r in range(self.comm.world_size):
                path = tmp / f".hashes-{r}.json"
                while not path.exists():
                    if time.monotonic() > end:
                        raise storage.CheckpointError(f"saving step {step}: rank {r} wrote no shard hashes in {wait_s:g} s")
                    time.sleep(0.02)
                got = json.loads(path.read_text())
                if "error" in got:
                    raise storage.CheckpointError(f"saving step {step} failed: the shards: {got['error']}")
                written.update(got["entries"])
                path.unlink()
            self._publish_sharded(step, name, tmp, written, snapshot, full, rng_states, t0)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write(self, step: int, snapshot: dict, weights: dict | None, rng_states: list, t0: float,
               model: dict | None = None, tmp: Path | None = None, written: dict | None = None) -> None:
        """Serialize, hash, fsync and publish (the part an async save does in the background)."""
        model = snapshot["model"] if model is None else model
        weights = weights if weights is not None else half_weights(model, single_thread=True)
        record = self.meta.record()
        resume = {"format": RESUME_FORMAT, **snapshot, "rng": rng_states, **record}
        files = {storage.RESUME_FILE: resume, storage.WEIGHTS_FILE: weights, **self.meta.files}
        # The weights' sha256 is computed in a thread of its own while the files are written (it is
        # only needed in the manifest, which comes last): one more hash of 4 bytes a parameter.
        model_sha = _model_hasher.submit(storage.model_sha256, model)
        manifest = {**snapshot["train"], **{k: v for k, v in record.items() if k != "data_fingerprint"},
                    "model_sha256": model_sha, "created_unix": time.time()}
        final = storage.publish(self.root, step, files, manifest, **({"tmp": tmp, "written": written} if tmp else {}))
        self.owned.add(final)
        pruned = storage.prune(self.root, self.cfg.keep, self.owned)
        log.info("saved %s: step %d, %.2fs%s", final, step, time.monotonic() - t0,
                 f", pruned {', '.join(p.name for p in pruned)}" if pruned else "")

    # ---------------------------------------------------------------- async bookkeeping
    def wait(self) -> None:
        """Rank 0: block until the pending background save is done; keep its error."""
        if self._pending is not None:
            try:
                self._pending.result()
            except BaseException as e:  # surfaced through _failed() / _raise_failure(), never lost
                self._error = e
            self._pending = None
            self._spare, self._snapshot_tensors = self._snapshot_tensors, None  # written: free to copy into

    def _failed(self) -> bool:
        """Rank 0: did a background save fail? Non-blocking; `after_step` sums this over ranks."""
        if self._pending is not None and self._pending.done():
            self.wait()
        return self._error is not None

    def _raise_failure(self) -> None:
        """Raise on every rank once the ranks agreed that a save failed."""
        if self._error is not None:
            e = self._error
            message = str(e) if isinstance(e, storage.CheckpointError) else f"saving a checkpoint failed: {type(e).__name__}: {e}"
            raise storage.CheckpointError(message) from e
        raise storage.CheckpointError("rank 0 failed to save a checkpoint (its log has the cause); stopping")

    def drain(self) -> None:
        """Wait for the pending save (end of run, halt, stop); raise if it failed, on every rank."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.comm.any(self._error is not None):
            self._raise_failure()


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far (Linux's /proc/self/io rchar; 0 where
    there is none): what a load costs a shared filesystem, whether or not the page cache served it."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _load_verified(folder: Path) -> tuple[dict, dict, bytes]:
    """storage.load_verified_with_bytes, and for a sharded checkpoint every shard's sha256 too (the
    other ranks read shards that rank 0 vouched for; a damaged shard makes the folder not verify)."""
    body, payload, data = storage.load_verified_with_bytes(folder)
    if isinstance(payload, dict) and payload.get("sharded"):
        storage.verify(folder, only=lambda name: name.startswith(f"{sharded.SHARDS}/"))
        unlisted = sorted(p.name for p in (folder / sharded.SHARDS).iterdir() if f"{sharded.SHARDS}/{p.name}" not in body["files"])
        if unlisted:  # DCP would read them: only what the manifest vouches for may be loaded
            raise storage.CheckpointError(f"{folder / sharded.SHARDS}: {', '.join(unlisted)} not in the manifest")
    return body, payload, data


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
