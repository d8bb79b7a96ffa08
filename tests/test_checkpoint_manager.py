"""The checkpoint manager on its own, with a one-process fake of the collectives it agrees through:
the two calls the loop makes (load, after_step), what they decide, and what they refuse."""
import json
import random

import numpy as np
import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, RunMeta, storage
from run import folder as runfolder

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
    return RunMeta(world_size=1, global_batch=8, micro_batch=2, accum=4, threads=1, reduce="ddp",
                   config={"seed": 1, "train": {"lr": 0.1}, **config}, data_fingerprint={"source_sha256": "abc"}, run_id="run-a",
                   must_match={"config.seed": "seed", "data_fingerprint.source_sha256": "data source_sha256"},
                   may_change={"config.train.lr": ("train.lr", "the optimization differs")})


def states(step=0, value=0):
    return {"model": ModelState(torch.nn.Linear(2, 2)), "counter": Counter(value), "train": Train(step)}


def manager(tmp_path, comm=None, run_meta=None, **cfg):
    return CheckpointManager(CheckpointConfig(**cfg), tmp_path, comm or OneProcess(), run_meta or meta())


def run_steps(mgr, st, steps, end_at=None):
    for step in range(1, steps + 1):
        st["train"].step, st["counter"].value = step, step * 10
        end = "finished" if step == end_at else None
        mgr.after_step(step, st, end)
        if end:
            return step
    return steps


def test_after_step_saves_on_the_interval_and_at_the_end_and_agrees_only_where_it_must(tmp_path):
    comm = OneProcess()
    mgr = manager(tmp_path, comm, interval=3, keep=10)
    assert run_steps(mgr, states(), 7, end_at=7) == 7
    assert [s for s, _ in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [7, 6, 3]
    # A step without a save costs the manager no collective (the boundary's vote is the loop's:
    # run/protocol.py); a save gathers every rank's RNG states (DCP agrees on its outcome itself);
    # the end agrees that no background save failed. The first collective names the launch's temporaries.
    assert comm.calls == ["broadcast", "gather", "gather", "gather", "any"]


def test_load_restores_every_state_and_a_fresh_folder_starts_fresh(tmp_path):
    assert manager(tmp_path).load(states()) is None
    run_steps(manager(tmp_path, interval=5), states(), 5)
    st = states()
    resumed = manager(tmp_path).load(st)
    assert resumed.step == 5 and st["counter"].value == 50 and st["train"].step == 5
    assert resumed.path.name == "step_00000005"


def test_a_failed_async_save_is_reported_to_the_boundary_and_raised_before_the_next_save(tmp_path, monkeypatch):
    real = storage.publish

    def failing(root, step, files, manifest, **kw):
        if step == 2:
            raise storage.CheckpointError("disk gone")
        return real(root, step, files, manifest, **kw)

    monkeypatch.setattr(storage, "publish", failing)
    mgr = manager(tmp_path, interval=1, **{"async_": True})
    st = states()
    mgr.after_step(1, st, None)
    mgr.after_step(2, st, None)  # the snapshot is taken; the write fails in the background
    mgr.wait()
    assert "disk gone" in str(mgr.failure())  # what the loop votes on at the next boundary
    with pytest.raises(storage.CheckpointError, match="saving step 2: disk gone"):
        mgr.after_step(3, st, None)
    assert [s for s, _ in storage.list_checkpoints(tmp_path / runfolder.CHECKPOINTS)] == [1]
    assert not list((tmp_path / runfolder.CHECKPOINTS).glob(".tmp-*"))


def test_an_async_end_of_run_waits_for_the_pending_write_and_writes_its_own_before_returning(tmp_path, monkeypatch):
    import threading

    release, real = threading.Event(), storage.publish

    def slow(root, step, *args, **kw):
        if step == 1:
            assert release.wait(10)
        return real(root, step, *args, **kw)

    monkeypatch.setattr(storage, "publish", slow)
    mgr = manager(tmp_path, interval=1, **{"async_": True})
    st = states()
    mgr.after_step(1, st, None)  # step 1 is written in the background, held up
    timer = threading.Timer(0.3, release.set)
    timer.start()
    mgr.after_step(2, st, "stopped")
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
    mgr.after_step(1, states(), None)  # the generators' states are captured here
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
    manager(tmp_path, interval=1).after_step(3, {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": Train(3)}, None)

    fresh_model, fresh_opt = trained_pair(1, lr=0.5)
    manager(tmp_path).load({"model": ModelState(fresh_model), "optimizer": OptimizerState(fresh_model, fresh_opt), "train": Train()})
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1]
    for i, per_param in want["state"].items():
        assert sorted(got["state"][i]) == sorted(per_param) == ["exp_avg", "exp_avg_sq", "step"]
        for k, v in per_param.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert storage.model_sha256(fresh_model.state_dict(), {}) == storage.model_sha256(model.state_dict(), {})


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_fresh_adams_load_target_is_the_state_its_first_step_makes_without_the_step(amsgrad):
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    made = {}
    for way in ("ours", "dcp"):
        model, opt = trained_pair(0)
        opt.param_groups[0]["amsgrad"] = opt.param_groups[1]["amsgrad"] = amsgrad
        model.bias.requires_grad_(False)  # a frozen parameter gets no state either way
        if way == "ours":
            OptimizerState(model, opt).load_target()
        else:
            _init_optim_state(opt)
        made[way] = {name: {k: (v.shape, v.dtype, v.device) for k, v in opt.state[p].items()}
                     for name, p in model.named_parameters() if p in opt.state}
        assert all(p.grad is None for p in model.parameters())
    assert made["ours"] == made["dcp"] and list(made["ours"]) == ["weight"]
    assert ("max_exp_avg_sq" in made["ours"]["weight"]) is amsgrad


def test_an_optimizer_saved_before_its_first_step_resumes_to_take_that_step_as_a_fresh_one(tmp_path):
    # A stop inside the GRPO family's first rollout publishes step 0, its optimizer never stepped
    # (issue 59): the resumed run's first step must be Adam's first (its bias corrections), not its second.
    x = torch.randn(5, 4)
    model, opt = trained_pair(0, lr=0.1)
    mgr = manager(tmp_path, interval=1, keep=5)
    mgr.after_step(0, {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": Train()}, "stopped")
    mgr.wait()
    resumed, resumed_opt = trained_pair(1, lr=0.1)  # a fresh process: other weights until the load
    st = {"model": ModelState(resumed), "optimizer": OptimizerState(resumed, resumed_opt), "train": Train()}
    assert manager(tmp_path).load(st).step == 0
    assert [float(s["step"]) for s in resumed_opt.state.values()] == [0.0, 0.0]
    fresh, fresh_opt = trained_pair(0, lr=0.1)  # the uninterrupted run's first step
    for m, o in ((resumed, resumed_opt), (model, opt), (fresh, fresh_opt)):
        m(x).square().sum().backward()
        o.step()
    for m in (resumed, model):  # the resumed process and the one that saved and went on
        assert torch.equal(m.weight, fresh.weight) and torch.equal(m.bias, fresh.bias)


def test_a_fallback_after_a_damaged_load_restores_the_previous_optimizer_state_exactly(tmp_path):
    # The load target is left uninitialised; a load cut short by a damaged file fills part of it, and
    # the previous checkpoint's load must overwrite every byte.
    model, opt = trained_pair(0)
    st = {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": Train()}
    mgr, want = manager(tmp_path, interval=1, keep=5), None
    for step in (1, 2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        st["train"].step = step
        mgr.after_step(step, st, None)
        if step == 1:
            want = {i: {k: v.clone() for k, v in per.items()} for i, per in opt.state_dict()["state"].items()}
    mgr.wait()
    newest = tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(2) / "state" / "__0_0.distcp"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0x01  # the last byte: everything before it has been read into place when the hash fails
    newest.write_bytes(bytes(data))
    fresh_model, fresh_opt = trained_pair(1)
    resumed = manager(tmp_path).load({"model": ModelState(fresh_model), "optimizer": OptimizerState(fresh_model, fresh_opt), "train": Train()})
    assert resumed.step == 1
    got = fresh_opt.state_dict()["state"]
    for i, per in want.items():
        for k, v in per.items():
            assert got[i][k].dtype == v.dtype and torch.equal(got[i][k], v), (i, k)


def test_the_states_reused_names_give_dcps_own_dicts_while_the_module_and_parameters_stay_and_after_they_change():
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from checkpoint.states import _same

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model[0].parameters(), lr=0.01)
    ms, os_ = ModelState(model), OptimizerState(model, opt)
    for step in range(3):
        model(torch.randn(2, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        opt.param_groups[0]["lr"] = 0.01 / (step + 2)  # as the schedule sets it
        assert _same(ms.state_dict(), get_model_state_dict(model)) and _same(os_.state_dict(), get_optimizer_state_dict(model, opt))
    assert ms._names and os_._names  # reused since the first call
    opt.add_param_group({"params": model[1].parameters(), "lr": 0.5})  # another parameter list: the names again
    model(torch.randn(2, 4)).square().sum().backward()
    opt.step()
    want = get_optimizer_state_dict(model, opt)
    assert sorted(want["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"] and _same(os_.state_dict(), want)
    wrapped = torch.nn.Sequential(model)  # other keys for the same module: the names again
    ms.model = wrapped
    assert list(ms.state_dict())[0] == "0.0.weight" and _same(ms.state_dict(), get_model_state_dict(wrapped))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    run_steps(manager(tmp_path, interval=1, keep=5), states(), 3)
    newest = tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(3) / "state" / "__0_0.distcp"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    st = states()
    resumed = manager(tmp_path).load(st)
    assert resumed.step == 2 and st["counter"].value == 20
    assert "skipping checkpoint" in caplog.text and "step_00000003" in caplog.text and "does not match the manifest" in caplog.text


@pytest.mark.parametrize("resume", ["auto", "the damaged step folder"])
def test_a_resume_verifies_every_file_the_manifest_lists_not_only_the_states_it_reads(tmp_path, caplog, resume):
    """The fp16 weights (not read by a resume) with a byte flipped, its size kept: a run that looks
    for its newest checkpoint falls back to the previous one naming the file; a run told to resume
    from that folder refuses it (a tool or a run: exit 1). Either way it is never counted as valid."""
    run_steps(manager(tmp_path, interval=1, keep=5), states(), 3)
    folder = tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(3)
    weights = folder / storage.WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    st = states()
    if resume == "auto":
        resumed = manager(tmp_path).load(st)
        assert resumed.step == 2 and st["counter"].value == 20
        assert "skipping checkpoint" in caplog.text and f"{weights}: sha256" in caplog.text and "does not match the manifest" in caplog.text
    else:
        with pytest.raises(storage.CheckpointError, match=f"{weights}: sha256 .* does not match the manifest"):
            manager(tmp_path, resume=str(folder)).load(st)


def test_any_number_of_managers_in_one_process_each_make_and_free_their_own_thread_and_group(tmp_path):
    """No module global outlives its run: two runs one after the other in one process, each with
    background saves, each drains and closes."""
    for run in ("a", "b"):
        mgr = manager(tmp_path / run, interval=1, **{"async_": True})
        run_steps(mgr, states(), 3)
        mgr.after_step(4, states(4), "finished")
        mgr.close()
        assert mgr._pool is None and mgr._group is None
        assert [s for s, _ in storage.list_checkpoints(tmp_path / run / runfolder.CHECKPOINTS)] == [4, 3, 2]


def test_a_checkpoint_of_the_earlier_layout_is_refused_with_the_command_that_converts_it(tmp_path):
    old = tmp_path / runfolder.CHECKPOINTS / "step_00000005"
    old.mkdir(parents=True)
    (old / storage.MANIFEST).write_text(json.dumps({"format": 1, "step": 5, "files": {"resume.pth": {"bytes": 1, "sha256": "0" * 64}}}))
    with pytest.raises(storage.CheckpointError, match=f"earlier layout.*python -m checkpoint convert {tmp_path}"):
        manager(tmp_path).load(states())
    assert old.exists()  # nothing deleted, nothing trained over


# ---------------------------------------------------------------- verified before applied (issue 59, item 4)
def _rng_now() -> tuple:
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


@pytest.mark.parametrize("damaged", ["the fp16 weights", "a state file"])
def test_a_checkpoint_that_fails_its_checks_applies_nothing_to_the_model_optimizer_scaler_or_generators(tmp_path, damaged):
    """A load checks every file (and the loaded states' identities) before it applies anything: a
    checkpoint that fails leaves every state as it was, also what the DCP read had already filled."""
    model, opt = trained_pair(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    mgr = manager(tmp_path, interval=1)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    mgr.after_step(1, {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "scaler": scaler, "train": Train(1)}, None)
    mgr.wait()
    folder = tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(1)
    hurt = folder / (storage.WEIGHTS_FILE if damaged == "the fp16 weights" else "state/__0_0.distcp")
    data = bytearray(hurt.read_bytes())
    data[-1] ^= 0x01  # the last byte: all else of the file was read into place before its hash fails
    hurt.write_bytes(bytes(data))
    fresh_model, fresh_opt = trained_pair(1)
    weights = {k: v.clone() for k, v in fresh_model.state_dict().items()}
    fresh_scaler = torch.amp.GradScaler("cpu")
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    generators = _rng_now()
    st = {"model": ModelState(fresh_model), "optimizer": OptimizerState(fresh_model, fresh_opt), "scaler": fresh_scaler, "train": Train()}
    with pytest.raises(storage.CheckpointError, match="does not match the manifest"):
        manager(tmp_path, resume=str(folder)).load(st)
    assert all(torch.equal(v, weights[k]) for k, v in fresh_model.state_dict().items())
    assert not fresh_opt.state  # not even the load's own target is left behind
    assert fresh_scaler.get_scale() == 2.0 ** 16 and st["train"].step == 0
    assert _rng_now() == generators


class Forged:
    """A state whose item at step 2 does not load (a forged item that passes every hash), as a state
    applied after the scaler would fail."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        if state["value"] == 2:
            raise ValueError("a forged item")
        self.value = state["value"]


def test_a_fallback_restores_everything_the_previous_checkpoint_holds_and_an_optional_state_it_lacks_starts_fresh(tmp_path, caplog):
    """Step 1 was saved without a GradScaler (a bfloat16 run), step 2 with one (the run continued in
    float16) and a state that does not load: the scaler step 2 set before its failure is not kept by
    the fallback to step 1, which has none: it starts fresh."""
    import logging

    mgr = manager(tmp_path, interval=1, keep=5)
    mgr.after_step(1, {"model": ModelState(torch.nn.Linear(2, 2)), "forged": Forged(1), "train": Train(1)}, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 5)
    mgr.after_step(2, {"model": ModelState(torch.nn.Linear(2, 2)), "scaler": scaler, "forged": Forged(2), "train": Train(2)}, None)
    mgr.wait()
    fresh = torch.amp.GradScaler("cpu")
    st = {"model": ModelState(torch.nn.Linear(2, 2)), "scaler": fresh, "forged": Forged(), "train": Train()}
    with caplog.at_level(logging.WARNING, logger="minimind"):
        resumed = manager(tmp_path).load(st)
    assert resumed.step == 1 and st["forged"].value == 1
    assert "step_00000002: its states do not load" in caplog.text
    assert fresh.get_scale() == 2.0 ** 16  # fresh: not step 2's 32


def test_a_format_3_manifest_without_its_identity_is_a_damaged_checkpoint_and_falls_back_naming_it(tmp_path, caplog):
    run_steps(manager(tmp_path, interval=1, keep=5), states(), 2)
    path = tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(2) / storage.MANIFEST
    body = json.loads(path.read_text())
    assert body["format"] == 3
    del body["identity"]
    path.write_text(json.dumps(body))
    st = states()
    resumed = manager(tmp_path).load(st)
    assert resumed.step == 1 and st["counter"].value == 10
    assert "skipping checkpoint" in caplog.text and "step_00000002" in caplog.text and "records no model identity" in caplog.text


def test_an_optimizer_state_whose_moments_were_swapped_with_the_files_hash_rewritten_is_refused_and_falls_back(tmp_path, caplog):
    import hashlib

    from checkpoint.format import METADATA, read_metadata

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))  # two moments of one shape
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    st = {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": Train()}
    mgr = manager(tmp_path, interval=1, keep=5)
    for step in (1, 2):
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        st["train"].step = step
        mgr.after_step(step, st, None)
        if step == 1:
            want = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    mgr.wait()
    folder = tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(2)
    manifest = json.loads((folder / storage.MANIFEST).read_text())
    assert len(manifest["optimizer_sha256"]) == 64
    md = read_metadata((folder / "state" / METADATA).read_bytes(), folder / "state" / METADATA)
    where = {k.fqn: v for k, v in md.storage_data.items()}
    a, b = where["optimizer.state.0.weight.exp_avg"], where["optimizer.state.1.weight.exp_avg"]
    assert a.length == b.length
    files = {f"state/{x.relative_path}": bytearray((folder / "state" / x.relative_path).read_bytes()) for x in (a, b)}
    bytes_a = files[f"state/{a.relative_path}"][a.offset:a.offset + a.length]
    bytes_b = files[f"state/{b.relative_path}"][b.offset:b.offset + b.length]
    files[f"state/{a.relative_path}"][a.offset:a.offset + a.length] = bytes_b
    files[f"state/{b.relative_path}"][b.offset:b.offset + b.length] = bytes_a
    for name, data in files.items():  # each file verifies; the two moments are swapped
        (folder / name).write_bytes(bytes(data))
        manifest["files"][name]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (folder / storage.MANIFEST).write_text(json.dumps(manifest))
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    resumed = manager(tmp_path).load({"model": ModelState(fresh), "optimizer": OptimizerState(fresh, fresh_opt), "train": Train()})
    assert resumed.step == 1
    assert "step_00000002" in caplog.text and "the loaded optimizer state's identity" in caplog.text
    assert all(torch.equal(fresh_opt.state[fresh[0].weight][k], v) for k, v in want.items())
