"""The checkpoint manager on its own, with a one-process fake of the collectives it agrees through:
the two calls the loop makes (load, after_step), what they decide, and what they refuse."""
import json

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager, RunMeta, runfolder
from checkpoint import storage as io

pytestmark = pytest.mark.unit


class OneProcess:
    """The Collectives protocol for a world of one: every decision is this process's own."""

    rank, world_size, device, is_main = 0, 1, torch.device("cpu"), True

    def __init__(self):
        self.sums = 0

    def sum(self, values):
        self.sums += 1
        return list(values)

    def any(self, flag):
        return bool(flag)

    def broadcast(self, obj):
        return obj

    def gather(self, obj):
        return [obj]

    def all_gather(self, obj):
        return [obj]


class Counter:
    """A stateful piece: one number."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = int(state["value"])


class Train:
    def __init__(self, step=0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def meta(**config):
    return RunMeta(1, 8, 2, 4, 1, "ddp", {"seed": 1, "train": {"lr": 0.1}, **config}, {"source_sha256": "abc"}, "run-a",
                   must_match={"config.seed": "seed", "data_fingerprint.source_sha256": "data source_sha256"},
                   may_change={"config.train.lr": ("train.lr", "the optimization differs")})


def states(step=0, value=0):
    return {"model": torch.nn.Linear(2, 2), "counter": Counter(value), "train": Train(step)}


def manager(tmp_path, comm=None, run_meta=None, **cfg):
    return CheckpointManager(CheckpointConfig(**cfg), tmp_path, comm or OneProcess(), run_meta or meta())


def run_steps(mgr, st, steps, stop_at=None, end_at=None):
    for step in range(1, steps + 1):
        st["train"].step, st["counter"].value = step, step * 10
        reason = mgr.after_step(step, st, stop=step == stop_at, end="finished" if step == end_at else None)
        if reason:
            return step, reason
    return steps, None


def test_after_step_saves_on_the_interval_and_at_the_end_with_one_collective_per_step(tmp_path):
    comm = OneProcess()
    mgr = manager(tmp_path, comm, interval=3, keep=10)
    assert run_steps(mgr, states(), 7, end_at=7) == (7, "finished")
    assert [s for s, _ in io.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [7, 6, 3]
    assert comm.sums == 7


def test_a_stop_vote_saves_at_that_step_and_ends_the_run_as_stopped(tmp_path):
    mgr = manager(tmp_path, interval=0)
    assert run_steps(mgr, states(), 50, stop_at=4) == (4, "stopped")
    assert [s for s, _ in io.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [4]


def test_load_restores_every_state_and_a_fresh_folder_starts_fresh(tmp_path):
    assert manager(tmp_path).load(states()) is None
    run_steps(manager(tmp_path, interval=5), states(), 5)
    st = states()
    resumed = manager(tmp_path).load(st)
    assert resumed.step == 5 and st["counter"].value == 50 and st["train"].step == 5
    assert resumed.path.name == "step_00000005"


def test_a_failed_async_save_surfaces_at_the_next_boundary_and_stops_the_run(tmp_path, monkeypatch):
    real = io.publish

    def failing(root, step, files, manifest):
        if step == 2:
            raise io.CheckpointError("disk gone")
        return real(root, step, files, manifest)

    monkeypatch.setattr(io, "publish", failing)
    mgr = manager(tmp_path, interval=1, **{"async_": True})
    st = states()
    mgr.after_step(1, st, stop=False, end=None)
    mgr.after_step(2, st, stop=False, end=None)  # the snapshot is taken; the write fails in the background
    mgr.wait()
    with pytest.raises(io.CheckpointError, match="disk gone"):
        mgr.after_step(3, st, stop=False, end=None)


def test_an_async_end_of_run_waits_for_the_pending_write_and_writes_its_own_before_returning(tmp_path, monkeypatch):
    import threading

    release, real = threading.Event(), io.publish

    def slow(root, step, *args):
        if step == 1:
            assert release.wait(10)
        return real(root, step, *args)

    monkeypatch.setattr(io, "publish", slow)
    mgr = manager(tmp_path, interval=1, **{"async_": True})
    st = states()
    assert mgr.after_step(1, st, stop=False, end=None) is None  # step 1 is written in the background, held up
    timer = threading.Timer(0.3, release.set)
    timer.start()
    assert mgr.after_step(2, st, stop=True, end=None) == "stopped"
    # Returned only after both writes: the held-up one first, then the stop's own.
    assert release.is_set() and [s for s, _ in io.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [2, 1]
    for _, folder in io.list_checkpoints(tmp_path / runfolder.CHECKPOINTS):
        io.verify(folder)


def test_a_checkpoint_of_another_seed_or_corpus_is_refused_naming_each_and_a_changed_lr_warns(tmp_path, caplog):
    run_steps(manager(tmp_path, interval=2), states(), 2)
    other = meta(seed=2)
    other.data_fingerprint = {"source_sha256": "xyz"}
    with pytest.raises(io.CheckpointMismatch, match="seed is 1 in the checkpoint, 2 in this run; data source_sha256 is abc"):
        manager(tmp_path, run_meta=other).load(states())
    changed = meta(train={"lr": 0.2})
    manager(tmp_path, run_meta=changed).load(states())
    assert "train.lr was 0.1, now 0.2: the optimization differs" in caplog.text


def test_resume_never_over_checkpoints_is_refused_and_auto_over_only_damaged_ones_stops(tmp_path):
    run_steps(manager(tmp_path, interval=1, keep=2), states(), 2)
    with pytest.raises(io.CheckpointMismatch, match="checkpoint.resume=never, but"):
        manager(tmp_path, resume="never").load(states())
    for _, folder in io.list_checkpoints(tmp_path / runfolder.CHECKPOINTS):
        (folder / io.MANIFEST).write_text(json.dumps({"files": {}}))
    with pytest.raises(io.CheckpointError, match="no checkpoint verifies"):
        manager(tmp_path).load(states())
    assert len(io.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)) == 2


def test_the_run_id_of_the_checkpoint_is_kept_on_resume(tmp_path):
    run_steps(manager(tmp_path, interval=1), states(), 1)
    later = meta()
    later.run_id = "run-b"
    manager(tmp_path, run_meta=later).load(states())
    assert later.run_id == "run-a"
