"""The checkpoint manager: the loop's two calls, `load()` at start-up and `save(step)` after a step.

It takes the run's stateful pieces as a dict (name -> object with `state_dict()` /
`load_state_dict()`) and knows nothing of their insides, except that "model" also goes into the
fp16 weights file for inference. Only global rank 0 writes; every rank takes part in the decisions
(which checkpoint, did the save succeed) so that no rank is left waiting in a collective.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from configs import CheckpointConfig
from runtime import Runtime

from . import io, rng, runfolder

log = logging.getLogger("minimind")
RESUME_FORMAT = "minimind-resume/1"


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> Any: ...


@dataclass
class TrainState:
    """Where the run is: optimizer steps done, and the epoch and samples consumed in it (DESIGN.md I2)."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.samples_seen = int(state["step"]), int(state["epoch"]), int(state["samples_seen"])


@dataclass
class Resumed:
    """What `load()` found: the checkpoint's folder and the geometry it was written under."""

    path: Path
    step: int
    world_size: int
    micro_batch: int
    threads: int | None


def _share_key(t: torch.Tensor) -> tuple:
    """Two state_dict entries with this key are one tensor (tied embeddings): copy it once."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _to_cpu_copy(obj: Any, pin: bool, memo: dict | None = None) -> Any:
    """A deep copy with every tensor in (pinned) CPU memory: the snapshot an async save works from.
    Tensors that share memory (tied embeddings) stay shared, so the file matches a sync save's."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = _share_key(obj)
        if key not in memo:
            if pin:
                memo[key] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True).copy_(obj.detach())
            else:
                memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        out = type(obj)((k, _to_cpu_copy(v, pin, memo)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu_copy(v, pin, memo) for v in obj)
    return obj


def half_weights(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp16 copy for inference (MiniMind's convention); tied tensors stay one tensor."""
    seen: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in model_state.items():
        key = _share_key(v)
        if key not in seen:
            seen[key] = v.detach().to("cpu", torch.float16) if v.is_floating_point() else v.detach().cpu()
        out[k] = seen[key]
    return out


def truncate_metrics(path: Path, step: int) -> int:
    """Drop metrics lines past `step` (and any half-written line) so a resumed log equals an
    uninterrupted one (DESIGN.md I11). Returns the number of lines kept."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)
    return len(kept)


class CheckpointManager:
    """`load(states)` once, `save(step, states)` at every optimizer-step boundary, `close()` at the end.

    `meta` describes the run (world_size, global_batch, micro_batch, accum, threads, config,
    data_fingerprint, run_id) and goes into every resume file and manifest.
    """

    def __init__(self, cfg: CheckpointConfig, out_dir: Path, rt: Runtime, meta: dict) -> None:
        self.cfg, self.rt, self.meta = cfg, rt, dict(meta)
        self.root = Path(out_dir) / runfolder.CHECKPOINTS
        self.metrics_path = Path(out_dir) / runfolder.METRICS
        self.owned: set[Path] = set()  # checkpoints this run verified or published: the only ones pruning may delete
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if cfg.async_ and rt.is_main else None
        self._pending: Future | None = None
        self._error: BaseException | None = None

    # ---------------------------------------------------------------- load
    def _choose(self) -> Path | None:
        """Rank 0: the checkpoint to resume from, per checkpoint.resume."""
        mode = self.cfg.resume
        if mode == "never":
            existing = io.list_checkpoints(self.root)
            if existing:
                raise io.CheckpointMismatch(
                    f"checkpoint.resume=never, but {self.root} already holds checkpoints "
                    f"({', '.join(p.name for _, p in existing)}); nothing was deleted. Use a new out_dir for a "
                    f"fresh run, or checkpoint.resume=auto to continue this one")
            return None
        if mode != "auto":
            path = Path(mode)
            if not (path / io.MANIFEST).exists() and path.is_dir() and (path / runfolder.CHECKPOINTS).is_dir():
                raise io.CheckpointMismatch(f"checkpoint.resume={mode} is a run folder; give one of its checkpoints/step_* folders, or use checkpoint.resume=auto with out_dir={mode}")
            io.verify(path)  # an explicit path must verify or the run fails
            return path
        newest, listing = io.scan(self.root)
        if newest is None and listing:
            # Checkpoints exist and none verifies: a fresh start would train over them. Stop (I13).
            faults = "\n".join(f"  {folder}: {error}" for _, folder, error in listing)
            raise io.CheckpointError(
                f"{self.root}: no checkpoint verifies, so this run cannot resume, and it will not start "
                f"fresh over them (nothing was trained or deleted):\n{faults}\n"
                f"Ways on: checkpoint.resume=<a checkpoint folder you trust>, or a new out_dir")
        for step, _, error in listing:
            if error:  # newer than the one chosen: reported, never silently passed over
                log.warning("skipping checkpoint step %d: %s", step, error)
        return newest

    def load(self, states: dict[str, Stateful], optional: frozenset[str] = frozenset({"scaler"})) -> Resumed | None:
        """Restore `states` from the checkpoint that checkpoint.resume names (None: fresh start).

        A state named in `optional` that the checkpoint lacks starts fresh with a warning (a
        GradScaler when a float32 or bfloat16 run continues in float16); any other missing state
        is an error."""
        t0 = time.monotonic()
        choice: Any = None
        if self.rt.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for p in io.clear_temporaries(self.root):
                log.info("removed %s, left by an interrupted save", p)
            try:
                path = self._choose()
                choice = {"path": str(path) if path else None}
            except io.CheckpointError as e:
                choice = {"error": str(e), "mismatch": isinstance(e, io.CheckpointMismatch)}
        choice = self.rt.broadcast(choice)
        if "error" in choice:
            raise (io.CheckpointMismatch if choice["mismatch"] else io.CheckpointError)(choice["error"])
        if choice["path"] is None:
            if self.rt.is_main:
                truncate_metrics(self.metrics_path, 0)
            return None

        path = Path(choice["path"])
        if self.rt.is_main and path.parent == self.root:
            self.owned.add(path)  # verified just now
        error = None
        try:
            payload = io.safe_load(path / io.RESUME_FILE)
            self._check_compatible(path, payload)
            for name, obj in states.items():
                if name in payload:
                    obj.load_state_dict(payload[name])
                elif name in optional:
                    log.warning("%s: no '%s' state in the resume file; it starts fresh", path, name)
                else:
                    raise io.CheckpointError(f"{path / io.RESUME_FILE}: no '{name}' state in the resume file")
            self._restore_rng(payload)
        except io.CheckpointError as e:
            error = (type(e).__name__, str(e))
        # Every rank loaded; if any failed, all stop here together (no rank enters training alone).
        failed = [(r, e) for r, e in enumerate(self.rt.all_gather(error)) if e]
        if failed:
            rank, (kind, message) = failed[0]
            cls = io.CheckpointMismatch if kind == "CheckpointMismatch" else io.CheckpointError
            raise cls(message if error else f"rank {rank} could not load {path}: {message}")

        train = payload["train"]
        self.meta["run_id"] = payload.get("run_id", self.meta.get("run_id"))
        if self.rt.is_main:
            truncate_metrics(self.metrics_path, train["step"])
        resumed = Resumed(path, train["step"], payload["world_size"], payload["micro_batch"], payload.get("threads"))
        log.info("loaded %s: step %d, epoch %d, %.2fs", path, train["step"], train["epoch"], time.monotonic() - t0)
        self._log_rescale(resumed, train)
        self._warn_changed(payload.get("config", {}))
        if resumed.threads is not None and resumed.threads != self.meta.get("threads"):
            log.warning(
                "the checkpoint was written with %s intra-op threads per process, this run uses %s: "
                "floating-point results differ, so bit-equality with an uninterrupted run is not promised",
                resumed.threads, self.meta.get("threads"),
            )
        return resumed

    # A resume may change these; each change is said, with the old and new values.
    _CHANGES = {
        "steps": "the LR schedule from here on spans the new count",
        "dtype": "autocast changes the arithmetic: not bit-identical to the uninterrupted run",
        **{k: "the optimization from here on differs from the uninterrupted run"
           for k in ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")},
    }

    def _warn_changed(self, then: dict) -> None:
        old, new = then.get("train", {}) if isinstance(then, dict) else {}, self.meta["config"]["train"]
        for key, consequence in self._CHANGES.items():
            if key in old and old[key] != new.get(key):
                log.warning("train.%s was %s, now %s: %s", key, old[key], new.get(key), consequence)

    def _log_rescale(self, r: Resumed, train: dict) -> None:
        w, micro, accum = self.meta["world_size"], self.meta["micro_batch"], self.meta["accum"]
        skip = (train["samples_seen"] // self.meta["global_batch"]) * accum
        where = f"step {r.step} resumes at sample {train['samples_seen']} of epoch {train['epoch']}, skipping {skip} micro-batches per rank"
        if r.world_size != w or r.micro_batch != micro:
            log.info("world size %d → %d, micro batch %d → %d: %s", r.world_size, w, r.micro_batch, micro, where)
        else:
            log.info("%s", where)

    def _check_compatible(self, path: Path, payload: dict) -> None:
        """A resume under another model, corpus, global batch or seed is an error naming each field."""
        if not isinstance(payload, dict) or payload.get("format") != RESUME_FORMAT:
            raise io.CheckpointError(f"{path / io.RESUME_FILE}: not a resume file of this trainer (format {payload.get('format') if isinstance(payload, dict) else type(payload).__name__!r})")
        ours, theirs = self.meta["config"], payload.get("config", {})
        diffs = []
        for k in sorted(set(ours["model"]) | set(theirs.get("model", {}))):
            a, b = theirs.get("model", {}).get(k), ours["model"].get(k)
            if a != b:
                diffs.append(f"model.{k} is {a} in the checkpoint, {b} in this run")
        for label, a, b in (
            ("seed", theirs.get("seed"), ours["seed"]),
            ("train.global_batch", payload.get("global_batch"), self.meta["global_batch"]),
        ):
            if a != b:
                diffs.append(f"{label} is {a} in the checkpoint, {b} in this run")
        fa, fb = payload.get("data_fingerprint", {}), self.meta["data_fingerprint"]
        for k in ("source_sha256", "tokenizer", "seq_len", "num_samples"):
            if fa.get(k) != fb.get(k):
                diffs.append(f"data {k} is {fa.get(k)} in the checkpoint, {fb.get(k)} in this run")
        if diffs:
            raise io.CheckpointMismatch(f"{path}: cannot resume this run from it: " + "; ".join(diffs))

    def _restore_rng(self, payload: dict) -> None:
        states = payload.get("rng") or []
        if self.rt.rank < len(states):
            rng.restore(states[self.rt.rank], self.rt.device)
        else:
            # A rank that did not exist before: its generators get a seed-derived state.
            rng.seed_all(rng.derive_seed(self.meta["config"]["seed"], self.rt.rank, payload["train"]["step"]))
            log.warning("rank %d has no saved RNG state (the checkpoint had %d ranks); seeded it from (seed, rank, step)",
                        self.rt.rank, len(states))

    # ---------------------------------------------------------------- save
    def due(self, step: int) -> bool:
        return bool(self.cfg.interval) and step % self.cfg.interval == 0

    def save(self, step: int, states: dict[str, Stateful], train: TrainState) -> None:
        """Save at this optimizer-step boundary (DESIGN.md I7): called by every rank, rank 0 writes.

        Synchronous: returns once the checkpoint is published, and raises on every rank if it was
        not. Asynchronous: returns after the snapshot; a failure surfaces at the next boundary.
        """
        t0 = time.monotonic()
        rng_states = self.rt.gather(rng.capture(self.rt.device))  # a collective: every rank
        failed = False
        if self.rt.is_main:
            self.wait()  # the previous async save, before a new one
            pin = self._pool is not None and self.rt.device.type == "cuda"
            snapshot = {name: obj.state_dict() for name, obj in states.items()}
            # The fp16 copy is made here, on the training thread, in both modes: a tensor op in the
            # background thread would start a second OpenMP team that fights the training's for cores.
            weights = half_weights(snapshot["model"])
            if self._pool is not None:
                snapshot = _to_cpu_copy(snapshot, pin)
                self._pending = self._pool.submit(self._write, step, snapshot, weights, rng_states, train.state_dict(), t0)
                log.info("checkpoint step %d: snapshot taken in %.3fs, writing in the background", step, time.monotonic() - t0)
            else:
                try:
                    self._write(step, snapshot, weights, rng_states, train.state_dict(), t0)
                except io.CheckpointError as e:
                    self._error, failed = e, True
        if self._pool is None and self.rt.any(failed):
            self.raise_failure()

    def _write(self, step: int, snapshot: dict, weights: dict, rng_states: list, train: dict, t0: float) -> None:
        """Serialize, hash, fsync and publish (the part an async save does in the background)."""
        model_state = snapshot["model"]
        resume = {"format": RESUME_FORMAT, **snapshot, "rng": rng_states, **self._meta_for(train)}
        files = {io.RESUME_FILE: resume, io.WEIGHTS_FILE: weights}
        manifest = {**train, **{k: v for k, v in self._meta_for(train).items() if k != "data_fingerprint"},
                    "model_sha256": io.model_sha256(model_state), "created_unix": time.time()}
        final = io.publish(self.root, step, files, manifest)
        self.owned.add(final)
        pruned = io.prune(self.root, self.cfg.keep, self.owned)
        log.info("saved %s: step %d, %.2fs%s", final, step, time.monotonic() - t0,
                 f", pruned {', '.join(p.name for p in pruned)}" if pruned else "")

    def _meta_for(self, train: dict) -> dict:
        keys = ("world_size", "global_batch", "micro_batch", "accum", "threads", "reduce", "config", "data_fingerprint", "run_id")
        return {k: self.meta.get(k) for k in keys}

    # ---------------------------------------------------------------- async bookkeeping
    def wait(self) -> None:
        """Rank 0: block until the pending background save is done; keep its error for `failed`."""
        if self._pending is not None:
            try:
                self._pending.result()
            except BaseException as e:  # surfaced through failed() / raise_failure(), never lost
                self._error = e
            self._pending = None

    @property
    def failed(self) -> bool:
        """Rank 0: did a background save fail? Non-blocking; the loop sums this over ranks."""
        if self._pending is not None and self._pending.done():
            self.wait()
        return self._error is not None

    def raise_failure(self) -> None:
        """Raise on every rank once the ranks agreed that a save failed."""
        if self._error is not None:
            raise io.CheckpointError(str(self._error)) from self._error
        raise io.CheckpointError("rank 0 failed to save a checkpoint (its log has the cause); stopping")

    def close(self) -> None:
        """Drain the pending save (end of run, halt, stop); raise if it failed, on every rank."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.rt.any(self._error is not None):
            self.raise_failure()


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
