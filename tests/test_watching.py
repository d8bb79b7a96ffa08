"""Watching a run: a validation loss that changes nothing in training and is the same on any world
size, TensorBoard curves that resume without a duplicate step, one W&B run across launches, a
tracker that fails without stopping the run, and the plot."""
import signal
import subprocess
from pathlib import Path

import pytest

import launch
from checkpoint import storage

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def watched(epochs):
    """The epochs run with 16 samples held out (so 8 steps/epoch still) and a validation loss every 5
    steps, with dropout on (what evaluation must not apply, nor draw for)."""
    return [*[o for o in epochs if not o.startswith("data.num_samples")], "data.num_samples=86", "data.val_samples=16",
            "eval.interval=5", "model.dropout=0.1"]


@pytest.fixture(scope="module")
def plain_and_evaluated(tmp_path_factory, watched):
    """The same run without and with evaluation, in this process."""
    outs = {}
    for name, extra in (("plain", ["eval.interval=0"]), ("evaluated", [])):
        out = tmp_path_factory.mktemp(name)
        assert launch.in_process(*watched, *extra, "checkpoint.interval=4", f"out_dir={out}")[0] == 0
        outs[name] = out
    return outs


def test_evaluating_changes_no_training_bit_and_logs_val_loss_at_its_steps(plain_and_evaluated):
    plain, evaluated = plain_and_evaluated["plain"], plain_and_evaluated["evaluated"]
    assert launch.losses(evaluated) == launch.losses(plain)
    assert launch.inspect(evaluated)["model_sha256"] == launch.inspect(plain)["model_sha256"]
    assert [m["step"] for m in launch.metrics(evaluated) if "val_loss" in m] == [5, 10, 15, 20]
    assert not any("val_loss" in m for m in launch.metrics(plain))
    # The logged validation loss is the model's in eval mode (no dropout): recomputed here, independently.
    import torch
    import torch.nn.functional as F

    from data import PackedDataset
    from weights import checkpoint_weights

    folder, manifest, cfg, state = checkpoint_weights(evaluated)
    from model import MiniMindLM

    model = MiniMindLM(cfg)
    model.load_state_dict(state)
    fp, data = manifest["data_fingerprint"], manifest["config"]["data"]
    from data import pack, resolve_source

    bin_path, _ = pack(resolve_source(data["path"], Path(data["cache_dir"])), cfg.seq_len, Path(data["cache_dir"]))  # packed already
    val = PackedDataset(bin_path, cfg.seq_len, fp["num_samples"] + fp["val_samples"], start=fp["num_samples"])
    with torch.no_grad():
        x, y = torch.stack([val[i][0] for i in range(len(val))]), torch.stack([val[i][1] for i in range(len(val))])
        per_sample = F.cross_entropy(model.eval()(x)[0].flatten(0, 1), y.flatten(), reduction="none").view(len(val), -1).double().mean(1)
    logged = [m["val_loss"] for m in launch.metrics(evaluated) if m["step"] == 20][0]
    assert abs(per_sample.mean().item() - logged) < 1e-6 * logged  # the same arithmetic but the batching: equal to float rounding


def test_an_interrupted_runs_validation_losses_equal_the_uninterrupted_runs(tmp_path, watched, plain_and_evaluated):
    assert launch.in_process(*watched, "checkpoint.interval=4", "train.halt_at=7", f"out_dir={tmp_path}")[0] == 0
    code, err = launch.in_process(*watched, "checkpoint.interval=4", f"out_dir={tmp_path}")
    assert code == 0 and "validation loss" in err.splitlines()[-1]
    want = [(m["step"], m["val_loss"]) for m in launch.metrics(plain_and_evaluated["evaluated"]) if "val_loss" in m]
    assert [(m["step"], m["val_loss"]) for m in launch.metrics(tmp_path) if "val_loss" in m] == want


@pytest.mark.parametrize("reduce", ["canonical"])  # ddp's weights differ in the last bits (1.0e-8 measured): canonical is the proof
def test_the_validation_loss_is_the_same_on_one_and_two_processes(tmp_path, watched, reduce):
    runs = {}
    for nproc in (0, 2):
        out = tmp_path / f"w{nproc}"
        if nproc:
            launch.run(nproc, *watched, f"dist.reduce={reduce}", "train.steps=10", f"out_dir={out}")
        else:  # one process: train.main here, the same code path without a launch
            assert launch.in_process(*watched, f"dist.reduce={reduce}", "train.steps=10", f"out_dir={out}")[0] == 0
        runs[nproc] = [m["val_loss"] for m in launch.metrics(out) if "val_loss" in m]
    assert len(runs[0]) == 2
    gap = max(abs(a - b) for a, b in zip(runs[0], runs[2]))
    print(f"{reduce}: validation loss on 1 vs 2 processes, max |diff| = {gap:.3e}")
    if reduce == "canonical":
        assert runs[0] == runs[2]  # the same weights, the same sum in the same order
    else:
        # The weights differ in the last bits (1 vs 2 processes reduce in another order): within 10x of
        # the 1.0e-8 measured here.
        assert gap < 1e-7


def tensorboard_scalars(out, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_curves_of_a_sigkilled_and_resumed_run_hold_every_step_once_with_the_uninterrupted_values(tmp_path, watched):
    ref, out = tmp_path / "ref", tmp_path / "run"
    args = [*watched, "checkpoint.interval=4", "log.tracker=tensorboard"]
    assert launch.in_process(*args, f"out_dir={ref}")[0] == 0
    # A slow disk keeps the run alive long enough to be killed past its step-8 checkpoint.
    proc = launch.start(launch.command(0, *args, f"out_dir={out}", script=launch.SLOW_SAVE), tmp_path / "log",
                        env={"SLOW_SAVE_S": "0.3"})
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 10, proc=proc)
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    killed_at = launch.lines(out / "metrics.jsonl")
    resumed_from = storage.list_checkpoints(out / "checkpoints")[0][0]
    assert resumed_from < killed_at  # the killed run logged steps past its last checkpoint
    launch.run(0, *args, f"out_dir={out}")
    for tag in ("train/loss", "train/lr", "val/loss"):
        got, want = tensorboard_scalars(out, tag), tensorboard_scalars(ref, tag)
        assert [s for s, _ in got] == sorted({s for s, _ in got}), tag  # every step once, in order
        assert got == want, tag


def test_a_run_killed_before_its_first_checkpoint_and_started_again_shows_each_step_once_in_tensorboard(tmp_path, watched):
    ref, out = tmp_path / "ref", tmp_path / "run"
    args = [*watched, "train.steps=60", "checkpoint.interval=0", "eval.interval=0", "log.tracker=tensorboard"]
    assert launch.in_process(*args, f"out_dir={ref}")[0] == 0
    proc = launch.start(launch.command(0, *args, f"out_dir={out}"), tmp_path / "log")
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 3, proc=proc)
    launch.kill_tree(proc.pid, signal.SIGKILL)  # long before step 60: no checkpoint yet
    proc.wait(timeout=60)
    assert not storage.list_checkpoints(out / "checkpoints") and tensorboard_scalars(out, "train/loss")
    launch.run(0, *args, f"out_dir={out}")  # a fresh start in the same folder
    got, want = tensorboard_scalars(out, "train/loss"), tensorboard_scalars(ref, "train/loss")
    assert [s for s, _ in got] == list(range(1, 61))  # steps 1..k of the killed run are purged, not shown twice
    assert got == want


def test_two_launches_in_wandb_offline_mode_write_under_the_checkpoints_run_id(tmp_path, watched, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = [*watched, "checkpoint.interval=4", "log.tracker=wandb", f"out_dir={tmp_path}"]
    assert launch.in_process(*args, "train.halt_at=8")[0] == 0
    code, err = launch.in_process(*args)
    assert code == 0 and "could not start" not in err and "failed in" not in err
    assert "cannot be rewound to step 8 here (offline mode" in err  # said, not silently left in W&B's history
    run_id = launch.inspect(tmp_path)["run_id"]
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs


def test_a_tracker_that_raises_on_log_does_not_stop_the_run(tmp_path, watched, monkeypatch, plain_and_evaluated):
    from torch.utils.tensorboard import SummaryWriter

    def broken(self, *args, **kwargs):
        raise OSError("the tracker's disk went away")

    monkeypatch.setattr(SummaryWriter, "add_scalar", broken)
    code, err = launch.in_process(*watched, "checkpoint.interval=4", "log.tracker=tensorboard", f"out_dir={tmp_path}")
    assert code == 0 and err.count("log.tracker=tensorboard failed in log") == 1
    assert launch.losses(tmp_path) == launch.losses(plain_and_evaluated["evaluated"])


def test_plot_draws_the_curves_of_several_runs(tmp_path, plain_and_evaluated):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    proc = subprocess.run([launch.PY, "-m", "checkpoint", "plot", str(plain_and_evaluated["plain"]),
                           str(plain_and_evaluated["evaluated"]), "--out", str(png)], cwd=launch.ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
