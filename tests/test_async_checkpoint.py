"""checkpoint.async: the same checkpoints as a synchronous save, drained at the end and on a stop."""
import re
import signal

import torch

import pytest

import launch
from checkpoint import storage as io

pytestmark = pytest.mark.e2e


def test_an_async_run_writes_the_same_checkpoints_as_a_sync_run(tmp_path, tiny):
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        assert launch.in_process(*tiny, "checkpoint.interval=3", "checkpoint.keep=10", f"checkpoint.async={mode}", f"out_dir={out}")[0] == 0
        runs[mode] = out
    sync, async_ = (io.list_checkpoints(runs[m] / "checkpoints") for m in ("false", "true"))
    assert [s for s, _ in sync] == [s for s, _ in async_] == [20, 18, 15, 12, 9, 6, 3]
    for (_, a), (_, b) in zip(sync, async_):
        pa, pb = io.safe_load(a / io.RESUME_FILE), io.safe_load(b / io.RESUME_FILE)
        assert io.model_sha256(pa["model"]) == io.model_sha256(pb["model"])
        for sa, sb in zip(pa["optimizer"]["state"].values(), pb["optimizer"]["state"].values()):
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert pa["train"] == pb["train"]
        assert (a / io.WEIGHTS_FILE).read_bytes() == (b / io.WEIGHTS_FILE).read_bytes()
    assert launch.losses(runs["false"]) == launch.losses(runs["true"])


def test_a_stop_drains_the_pending_async_save_before_its_own_and_resumes_exactly(tmp_path, epochs, reference):
    out = tmp_path / "run"
    args = [*epochs, "checkpoint.async=true", "checkpoint.interval=2", f"out_dir={out}"]
    proc = launch.start(launch.command(0, *args, script=launch.SLOW_SAVE), tmp_path / "log", env={"SLOW_SAVE_S": "0.5"})
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 3, proc=proc)
    launch.kill_tree(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    stopped = launch.lines(out / "metrics.jsonl")
    saved = [int(s) for s in re.findall(r"saved \S+/step_(\d+): step", (tmp_path / "log").read_text())]
    assert saved[0] == 2 and saved[-1] == stopped and saved == sorted(saved)  # the pending save finished first
    assert io.list_checkpoints(out / "checkpoints")[0][0] == stopped
    for _, folder in io.list_checkpoints(out / "checkpoints"):
        io.verify(folder)
    launch.run(0, *args)
    assert launch.losses(out) == launch.losses(reference(0))
    assert launch.inspect(out)["model_sha256"] == launch.inspect(reference(0))["model_sha256"]
