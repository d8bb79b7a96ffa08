"""checkpoint.async: the same checkpoints as a synchronous save, a resume from one written in the
background, drained at the end and on a stop."""
import re
import signal

import pytest

import launch
from checkpoint import storage

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, tiny):
    """20 steps, a checkpoint every 3 written in the background (the last, at 20, directly)."""
    out = tmp_path_factory.mktemp("async")
    code, err = launch.in_process(*tiny, "checkpoint.interval=3", "checkpoint.keep=10", "checkpoint.async=true", f"out_dir={out}")
    assert code == 0
    return out, err


def test_an_async_run_writes_the_same_checkpoints_as_a_sync_run(tmp_path, tiny, async_run):
    async_out, _ = async_run
    sync_out = tmp_path / "sync"
    assert launch.in_process(*tiny, "checkpoint.interval=3", "checkpoint.keep=10", f"out_dir={sync_out}")[0] == 0
    sync, async_ = (storage.list_checkpoints(out / "checkpoints") for out in (sync_out, async_out))
    assert [s for s, _ in sync] == [s for s, _ in async_] == [20, 18, 15, 12, 9, 6, 3]
    for (_, a), (_, b) in zip(sync, async_):
        # The states (model, optimizer state and param groups, step and data position, every rank's
        # generators) are the same bytes; so are the fp16 weights. Only the manifest (the run's
        # identity, the async switch itself) and DCP's metadata (a save id) may differ.
        for name in ("__0_0.distcp", "__0_1.distcp"):
            state_a, state_b = (a / "state" / name).read_bytes(), (b / "state" / name).read_bytes()
            assert len(state_a) > 100_000 and state_a == state_b
        assert (a / storage.WEIGHTS_FILE).read_bytes() == (b / storage.WEIGHTS_FILE).read_bytes()
        ma, mb = storage.verify(a), storage.verify(b)
        assert {k: v for k, v in ma.items() if k not in ("run_id", "config", "created_unix", "files")} == \
               {k: v for k, v in mb.items() if k not in ("run_id", "config", "created_unix", "files")}
    assert launch.losses(sync_out) == launch.losses(async_out)


def test_a_resume_from_a_checkpoint_written_in_the_background_ends_bit_identical(tmp_path, tiny, async_run):
    async_out, err = async_run
    assert "checkpoint step 9: snapshot taken" in err and "writing in the background" in err
    step9 = async_out / "checkpoints" / storage.step_dir_name(9)
    out = tmp_path / "from9"
    code, err = launch.in_process(*tiny, "checkpoint.interval=3", "checkpoint.async=true", f"checkpoint.resume={step9}", f"out_dir={out}")
    assert code == 0 and "step 9 resumes at sample 72" in err
    assert [m["step"] for m in launch.metrics(out)] == list(range(10, 21))
    assert launch.losses(out) == launch.losses(async_out)[9:]
    assert launch.inspect(out)["model_sha256"] == launch.inspect(async_out)["model_sha256"]


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
    assert storage.list_checkpoints(out / "checkpoints")[0][0] == stopped
    for _, folder in storage.list_checkpoints(out / "checkpoints"):
        storage.verify(folder)
    launch.run(0, *args)
    launch.assert_identical(out, reference(0))
