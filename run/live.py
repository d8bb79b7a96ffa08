"""Live recovery's run side (docs/fault_tolerance.md): each step's batch read after the step's quorum
(and after a heal), the heal payload (weights, optimizer, RNG streams, the data cursor, the log lines
since the last checkpoint) sent from a live peer and verified before the first step (model identity,
the optimizer state's hash, the config and the code, refused by name if they differ), and the writer:
the live group with the lowest id writes the checkpoints and metrics.jsonl."""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from torch.utils.data import default_collate

from checkpoint import OptimizerState, model_sha256
from checkpoint.states import capture, restore
from checkpoint.storage import step_dir_name
from common.files import atomic_write
from runtime.ft import FTConfig, HealRefused, LiveReduce, Membership

from .metrics import Metrics

log = logging.getLogger("minimind")
ROOT = Path(__file__).resolve().parents[1]
PER_GROUP = ("ft.group",)
"""Config keys that may differ between the groups of one run."""


def code_hashes() -> dict[str, str]:
    """sha256 of every Python file of the trainer (train.py and the rooms), by path: a group running
    other code is refused at the heal, naming the files."""
    files = [ROOT / "train.py", *sorted(p for d in ROOT.iterdir() if (d / "__init__.py").exists() for p in d.rglob("*.py"))]
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if "__pycache__" not in p.parts}


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def tree_sha256(tree) -> str:
    """sha256 of a state (nested dicts and lists of tensors and plain values), in sorted key order."""
    h = hashlib.sha256()

    def walk(x) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(f"{k!s}\0".encode())
                walk(x[k])
        elif isinstance(x, list | tuple):
            h.update(f"[{len(x)}\0".encode())
            for v in x:
                walk(v)
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{list(t.shape)}\0".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(f"{x!r}\0".encode())

    walk(tree)
    return h.hexdigest()


class Lines:
    """metrics.jsonl's sink for a group: every line it logs is kept (since the last checkpoint) and,
    while the group is the writer, appended to the file; a group that becomes the writer first makes
    the file hold steps 1..its step from the file and the lines it holds."""

    def __init__(self, path: Path) -> None:
        self.path, self.lines, self.writer, self.synced = path, {}, False, False

    def write(self, text: str) -> None:
        step = json.loads(text)["step"]
        self.lines[step] = text
        if not self.writer:
            self.synced = False
            return
        with open(self.path, "a+") as f:  # locked: two lineages of a split quorum compute the same lines, written once
            fcntl.lockf(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                last = _last_step(f.read()) if self.synced else None
                if last == step - 1:
                    f.write(text)
                elif last is None or last < step - 1:
                    self.sync(step)
            finally:
                fcntl.lockf(f, fcntl.LOCK_UN)

    def sync(self, step: int) -> None:
        have = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    s = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line the previous writer left half-written
                if isinstance(s, int) and s not in have:
                    have[s] = line + "\n"
        have.update(self.lines)
        missing = [s for s in range(1, step + 1) if s not in have]
        if missing:
            log.warning("ft: metrics.jsonl lacks steps %s that no live group holds", missing[:10])
        atomic_write(self.path, "".join(have[s] for s in sorted(have) if s <= step))
        self.synced = True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def prune(self, below: int) -> None:
        self.lines = {s: t for s, t in self.lines.items() if s >= below}


def _last_step(text: str) -> int | None:
    """The step of the last complete line of a metrics file, None when it has none or ends half-written."""
    if not text.endswith("\n"):
        return None
    lines = text.splitlines()
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except (ValueError, KeyError, TypeError):
        return None


class LiveMetrics(Metrics):
    """Metrics whose lines go to `Lines` (the writer group's file) instead of a file of their own."""

    def __init__(self, path: Path | None, *args) -> None:
        super().__init__(None, *args)
        self.file = self.sink = Lines(Path(path)) if path is not None else None


class LiveCheckpoints:
    """The checkpoint manager, saving only while this group is the writer (the lowest live id)."""

    def __init__(self, inner, live: "Live") -> None:
        self.inner, self.live = inner, live

    def after_step(self, step: int, states: dict, end: str | None) -> None:
        if self.live.sink is not None and self.inner.due(step):
            self.live.sink.prune(step + 1)  # the file up to a checkpoint is as durable as it (the writer's fsync)
        if self.live.writer and not (Path(self.inner.root) / step_dir_name(step)).exists():  # once, whichever lineage
            self.inner.after_step(step, states, end)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Live:
    """This group's part in a live-recovery run: made after the resume, it owns the membership, the
    reducer, the step's batch and the heal."""

    def __init__(self, cfg: dict, ft: FTConfig, rt, run, metrics: Metrics, architecture: dict) -> None:
        self.cfg, self.ft, self.rt, self.run, self.architecture = cfg, ft, rt, run, architecture
        self.code, self.born = code_hashes(), time.time()
        self.sink = getattr(metrics, "sink", None)
        self.writer = False
        # DCP's state-dict functions, imported and their names mapped now (seconds, the first time), before this group
        # joins a quorum: not while a peer heals from it, nor in its own heal.
        run.states["model"].state_dict()
        self.membership = Membership(ft, rt, self.state_dict, self.load_state_dict, run.train_state.step)
        self.reducer = LiveReduce(run.model, rt, run.plan.micro_batches, self.membership, ft.group)
        run.ckpt = LiveCheckpoints(run.ckpt, self)
        self.heal_s: float | None = None

    # ---------------------------------------------------------------- the heal
    def state_dict(self) -> dict:
        """What a peer sends a healing group: every state a checkpoint holds, the RNG streams, the log
        lines since the last checkpoint, and what the receiver checks them against."""
        states = {name: obj.state_dict() for name, obj in self.run.states.items()}
        return {"group": self.ft.group, "states": states, "rng": capture(self.rt.device),
                "lines": dict(self.sink.lines) if self.sink is not None else {},
                "identity": model_sha256(self.run.model.state_dict(), self.architecture),
                "optimizer_sha256": tree_sha256(states["optimizer"]), "config": self.cfg, "code": self.code}

    def same_run(self, config: dict, code: dict, other: int, how: str) -> None:
        """HealRefused (exit 2) naming the keys or files in which this group differs from group `other`."""
        mine, theirs = flat(self.cfg), flat(config)
        differs = sorted(k for k in set(mine) | set(theirs) if k not in PER_GROUP and mine.get(k) != theirs.get(k))
        if differs:
            raise HealRefused(f"ft: group {self.ft.group} cannot {how} group {other}: another config: "
                              + "; ".join(f"{k}={mine.get(k)!r} here, {theirs.get(k)!r} there" for k in differs[:8]))
        files = sorted(k for k in set(code) | set(self.code) if code.get(k) != self.code.get(k))
        if files:
            raise HealRefused(f"ft: group {self.ft.group} cannot {how} group {other}: other code: {', '.join(files[:8])} differ")

    def check_members(self) -> bool:
        """At a membership change, before the step: every participant's config and code against the
        oldest launch's among them (ties: the lowest id); a group that differs is refused by name (exit
        2), whether or not it needed a heal. False when a peer failed meanwhile (the step is done again)."""
        blob = json.dumps({"group": self.ft.group, "born": self.born, "config": self.cfg, "code": self.code}).encode()
        got = self.membership.exchange(blob)
        if got is None:
            return False
        seen = [json.loads(b) for b in got]
        first = min(seen, key=lambda x: (x["born"], x["group"]))
        if first["group"] != self.ft.group:
            self.same_run(first["config"], first["code"], first["group"], "train beside")
        return True

    def load_state_dict(self, payload: dict) -> None:
        """Heal from a peer's payload: refused by name (exit 2) when its config or code differ, or when
        what was loaded is not what the sender held."""
        t0, sender = time.monotonic(), payload["group"]
        self.same_run(payload["config"], payload["code"], sender, "heal from")
        for name, obj in self.run.states.items():
            if hasattr(obj, "load_target"):  # a fresh optimizer's state made as Adam's init makes it: not by DCP's zero step
                obj.load_target()
            obj.load_state_dict(payload["states"][name])
        restore(payload["rng"], self.rt.device)
        if self.sink is not None:
            self.sink.lines.update(payload["lines"])
        self.verify(payload, sender)
        self.membership.healed_from, self.heal_s = sender, time.monotonic() - t0
        moved = type(self.membership.transport).seconds
        log.info("ft: group %d healed from group %d at step %d in %.3fs (the transfer %.3fs, load and checks %.3fs; state in, verified: "
                 "identity %s)", self.ft.group, sender, self.run.train_state.step, moved + self.heal_s, moved, self.heal_s,
                 payload["identity"][:12])

    def verify(self, payload: dict, sender: int) -> None:
        """The model's identity and the optimizer state's hash, here against the sender's."""
        identity = model_sha256(self.run.model.state_dict(), self.architecture)
        opt = tree_sha256(OptimizerState(self.run.model, self.run.opt).state_dict())
        for what, here, there in (("model identity", identity, payload["identity"]), ("optimizer state sha256", opt, payload["optimizer_sha256"])):
            if here != there:
                raise HealRefused(f"ft: group {self.ft.group} healed from group {sender} but its {what} is {here[:16]}, the "
                                  f"sender's {there[:16]}: refused (the state did not arrive as it was sent)")

    # ---------------------------------------------------------------- the steps
    def batches(self, dataset, sampler, steps: int):
        """(epoch, step in epoch, this process's micro-batches) for every step: the quorum first (which
        may heal this group and move its data cursor), then the batch, read at the cursor."""
        plan, state = self.run.plan, self.run.train_state
        while state.step < steps:
            participants = self.membership.quorum(state.step)
            if self.membership.changed and not self.check_members():
                # A peer failed during the check: nothing is committed; the next quorum (a new one, without it) checks again.
                self.membership.commit()
                continue
            if self.membership.manager.current_step() != state.step:
                raise RuntimeError(f"ft: group {self.ft.group} is at step {self.membership.manager.current_step()} of the quorum "
                                   f"but its data cursor says step {state.step}")
            self.writer = self.ft.group == min(participants)
            if self.sink is not None:
                self.sink.writer = self.writer
            data_of = getattr(sampler, "dataset_of", lambda e: dataset)
            epoch, s = state.position(plan.global_batch, plan.steps_per_epoch(len(data_of(state.epoch))))
            sampler.set_epoch(epoch)
            data, indices, micro = data_of(epoch), sampler.step_indices(s), plan.micro_batch
            yield epoch, s, [fetch(data, indices[i * micro : (i + 1) * micro]) for i in self.reducer.begin(s, participants)]

    def close(self) -> None:
        self.membership.close()


def fetch(data, indices: list[int]):
    """One micro-batch, as the DataLoader makes it (the dataset's items, default_collate)."""
    items = data.__getitems__(indices) if hasattr(data, "__getitems__") else [data[k] for k in indices]
    return default_collate(items)
