"""The checkpoint manager on its own, with a one-process fake of the collectives it agrees through:
the two calls the loop makes (load, after_step), what they decide, and what they refuse."""
import json
import random

import numpy as np
import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager, RunMeta, runfolder
from checkpoint import storage

pytestmark = pytest.mark.unit


class OneProcess:
    """The Collectives protocol for a world of one: every decision is this process's own."""

    rank, world_size, device, is_main = 0, 1, torch.device("cpu"), True

    def __init__(self):
        self.calls: list[str] = []  # every collective, by name, in order

    def sum(self, values):
        self.calls.append("sum")
        return list(values)

    def any(self, flag):
        self.calls.append("any")
        return bool(flag)

    def broadcast(self, obj):
        self.calls.append("broadcast")
        return obj

    def gather(self, obj):
        self.calls.append("gather")
        return [obj]

    def all_gather(self, obj):
        self.calls.append("all_gather")
        return [obj]


class AnotherRankSignalled(OneProcess):
    """Rank 0 of two, where only the other rank got the stop signal: its vote arrives through the sum."""

    def sum(self, values):
        self.calls.append("sum")
        return [values[0] + 1.0, *values[1:]]


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
    assert [s for s, _ in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [7, 6, 3]
    # A step without a save is one vote; a synchronous save adds the RNG gather and the agreement on
    # its success; the end also agrees that no background save failed. Nothing else, in this order.
    plain, save = ["sum"], ["sum", "gather", "any"]
    assert comm.calls == plain * 2 + save + plain * 2 + save + save + ["any"]


def test_a_stop_vote_saves_at_that_step_and_ends_the_run_as_stopped(tmp_path):
    mgr = manager(tmp_path, interval=0)
    assert run_steps(mgr, states(), 50, stop_at=4) == (4, "stopped")
    assert [s for s, _ in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [4]


def test_load_restores_every_state_and_a_fresh_folder_starts_fresh(tmp_path):
    assert manager(tmp_path).load(states()) is None
    run_steps(manager(tmp_path, interval=5), states(), 5)
    st = states()
    resumed = manager(tmp_path).load(st)
    assert resumed.step == 5 and st["counter"].value == 50 and st["train"].step == 5
    assert resumed.path.name == "step_00000005"


def test_a_failed_async_save_surfaces_at_the_next_boundary_and_stops_the_run(tmp_path, monkeypatch):
    real = storage.publish

    def failing(root, step, files, manifest):
        if step == 2:
            raise storage.CheckpointError("disk gone")
        return real(root, step, files, manifest)

    monkeypatch.setattr(storage, "publish", failing)
    mgr = manager(tmp_path, interval=1, **{"async_": True})
    st = states()
    mgr.after_step(1, st, stop=False, end=None)
    mgr.after_step(2, st, stop=False, end=None)  # the snapshot is taken; the write fails in the background
    mgr.wait()
    with pytest.raises(storage.CheckpointError, match="disk gone"):
        mgr.after_step(3, st, stop=False, end=None)


def test_an_async_end_of_run_waits_for_the_pending_write_and_writes_its_own_before_returning(tmp_path, monkeypatch):
    import threading

    release, real = threading.Event(), storage.publish

    def slow(root, step, *args):
        if step == 1:
            assert release.wait(10)
        return real(root, step, *args)

    monkeypatch.setattr(storage, "publish", slow)
    mgr = manager(tmp_path, interval=1, **{"async_": True})
    st = states()
    assert mgr.after_step(1, st, stop=False, end=None) is None  # step 1 is written in the background, held up
    timer = threading.Timer(0.3, release.set)
    timer.start()
    assert mgr.after_step(2, st, stop=True, end=None) == "stopped"
    # Returned only after both writes: the held-up one first, then the stop's own.
    assert release.is_set() and [s for s, _ in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [2, 1]
    for _, folder in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS):
        storage.verify(folder)


def test_a_checkpoint_of_another_seed_or_corpus_is_refused_naming_each_and_a_changed_lr_warns(tmp_path, caplog):
    run_steps(manager(tmp_path, interval=2), states(), 2)
    other = meta(seed=2)
    other.data_fingerprint = {"source_sha256": "xyz"}
    with pytest.raises(storage.CheckpointMismatch, match="seed is 1 in the checkpoint, 2 in this run; data source_sha256 is abc"):
        manager(tmp_path, run_meta=other).load(states())
    changed = meta(train={"lr": 0.2})
    manager(tmp_path, run_meta=changed).load(states())
    assert "train.lr was 0.1, now 0.2: the optimization differs" in caplog.text


def test_resume_never_over_checkpoints_is_refused_and_auto_over_only_damaged_ones_stops(tmp_path):
    run_steps(manager(tmp_path, interval=1, keep=2), states(), 2)
    with pytest.raises(storage.CheckpointMismatch, match="checkpoint.resume=never, but"):
        manager(tmp_path, resume="never").load(states())
    for _, folder in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS):
        (folder / storage.MANIFEST).write_text(json.dumps({"files": {}}))
    with pytest.raises(storage.CheckpointError, match="no checkpoint verifies"):
        manager(tmp_path).load(states())
    assert len(storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)) == 2


def test_the_run_id_of_the_checkpoint_is_kept_on_resume(tmp_path):
    run_steps(manager(tmp_path, interval=1), states(), 1)
    later = meta()
    later.run_id = "run-b"
    manager(tmp_path, run_meta=later).load(states())
    assert later.run_id == "run-a"


def test_load_restores_the_global_generators_each_rank_had_at_the_save(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    mgr = manager(tmp_path, interval=1)
    mgr.after_step(1, states(), stop=False, end=None)  # the generators' states are captured here
    expected = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    manager(tmp_path).load(states())
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def trained_pair(seed, lr=0.01):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}],
                            lr=lr, betas=(0.8, 0.95))
    return model, opt


def test_load_restores_the_optimizers_state_and_param_groups_exactly(tmp_path):
    model, opt = trained_pair(0)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.005  # as the LR schedule sets it each step
    manager(tmp_path, interval=1).after_step(3, {"model": model, "optimizer": opt, "train": Train(3)}, stop=False, end=None)

    fresh_model, fresh_opt = trained_pair(1, lr=0.5)
    manager(tmp_path).load({"model": fresh_model, "optimizer": fresh_opt, "train": Train()})
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1]
    for i, per_param in want["state"].items():
        assert sorted(got["state"][i]) == sorted(per_param) == ["exp_avg", "exp_avg_sq", "step"]
        for k, v in per_param.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert storage.model_sha256(fresh_model.state_dict()) == storage.model_sha256(model.state_dict())


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    run_steps(manager(tmp_path, interval=1, keep=5), states(), 3)
    newest = tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(3)
    data = bytearray((newest / storage.RESUME_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / storage.RESUME_FILE).write_bytes(bytes(data))
    st = states()
    resumed = manager(tmp_path).load(st)
    assert resumed.step == 2 and st["counter"].value == 20
    assert "skipping checkpoint step 3" in caplog.text and "does not match the manifest" in caplog.text


def test_a_resume_drops_the_metrics_lines_past_its_step(tmp_path):
    run_steps(manager(tmp_path, interval=3), states(), 4)  # a checkpoint at 3; step 4 was logged, then a kill
    metrics = tmp_path / runfolder.METRICS
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5)))
    assert manager(tmp_path).load(states()).step == 3
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_a_stop_signal_to_another_rank_stops_this_one_at_the_same_step(tmp_path):
    mgr = manager(tmp_path, AnotherRankSignalled(), interval=0)
    assert mgr.after_step(1, states(), stop=False, end=None) == "stopped"
    assert [s for s, _ in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [1]
