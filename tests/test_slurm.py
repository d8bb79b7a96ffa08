"""Slurm, for real: a one-node cluster (scripts/slurm/local_cluster.sh, started by .ci/run) runs
scripts/slurm/train.sbatch. Requeues, a time-limit warning, a config error and scancel; every job
that finishes is compared with the uninterrupted reference bit for bit."""
import os
import random
import re
import shutil
import subprocess
import time

import pytest

import launch

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


LOCAL_CONF = "/var/spool/slurm-local/slurm.conf"  # scripts/slurm/local_cluster.sh's own configuration


def cluster_up() -> bool:
    if not shutil.which("sbatch"):
        return False
    if "SLURM_CONF" not in os.environ and os.path.isfile(LOCAL_CONF):
        os.environ["SLURM_CONF"] = LOCAL_CONF  # the local cluster, started by hand; jobs inherit it
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """Asked when a test of this module runs, not when it is collected (sinfo waits 9 s for a
    controller that is not there: every pytest worker would pay that under -m unit)."""
    if not cluster_up():
        if os.environ.get("CI") == "true":  # CI starts the cluster (.ci/run): absent there is a failure, not a skip
            raise RuntimeError("no Slurm cluster: .ci/run should have started one (scripts/slurm/local_cluster.sh start)")
        pytest.skip("no Slurm here: start one with `sudo bash scripts/slurm/local_cluster.sh start` "
                    "(its clients read SLURM_CONF=/var/spool/slurm-local/slurm.conf)")


def submit(tmp_path, *overrides, sbatch=(), env=None) -> str:
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in (env or {}).items())])
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'job.log'}", f"--export={exports}", *sbatch,
                           "scripts/slurm/train.sbatch", *overrides], cwd=launch.ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(job_id: str, states: tuple[str, ...], timeout: float = 300) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        info = job(job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {job(job_id)}")


def wait_steps(out, n: int, job_id: str, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while launch.lines(out / "metrics.jsonl") < n:
        if time.monotonic() > end:
            subprocess.run(["scancel", job_id])
            raise AssertionError(f"job {job_id}: fewer than {n} steps logged after {timeout} s: {job(job_id)}")
        time.sleep(0.2)


SLOW = {"TRAIN_PY": launch.SLOW_SAVE, "SLOW_SAVE_S": "0.15"}  # every step saved, each file 0.15 s longer


def test_a_job_requeued_twice_at_random_steps_finishes_with_the_uninterrupted_sha256(tmp_path, epochs, reference):
    out, rnd = tmp_path / "run", random.Random(18)
    job_id = submit(tmp_path, *epochs, "checkpoint.interval=1", f"out_dir={out}", env=SLOW)
    for restarts in (1, 2):
        wait_job(job_id, ("RUNNING",))
        before = launch.lines(out / "metrics.jsonl")
        wait_steps(out, before + rnd.randint(2, 4), job_id)
        assert subprocess.run(["scontrol", "requeue", job_id], timeout=30).returncode == 0
        end = time.monotonic() + 120
        while int(job(job_id).get("Restarts", 0)) < restarts and time.monotonic() < end:
            time.sleep(0.5)
    info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"))
    log = (tmp_path / "job.log").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", log[-3000:]
    assert "restart 1 (SLURM_RESTART_COUNT)" in log and "restart 2 (SLURM_RESTART_COUNT)" in log
    assert log.count("loaded ") == 2
    launch.assert_identical(out, reference(2))


def test_a_time_limit_warning_saves_requeues_the_job_and_it_finishes_bit_identical(tmp_path, epochs, reference):
    out = tmp_path / "run"
    # Three minutes, the warning 100 s before the end, which Slurm sends up to 30-60 s early (71 s
    # into the job in one run here); the first run is slowed (about 7.5 s a step) so that it lands
    # mid-run, the requeued run is not, and finishes before its own warning.
    job_id = submit(tmp_path, *epochs, "checkpoint.interval=1", f"out_dir={out}", sbatch=["--time=3", "--signal=B:USR1@100"],
                    env={**SLOW, "SLOW_SAVE_S": "2.5", "SLOW_SAVE_FIRST_JOB_ONLY": "1"})
    info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=400)
    log = (tmp_path / "job.log").read_text()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, log[-3000:]
    assert "time-limit warning (USR1)" in log and "requeueing job" in log
    stopped = int(re.search(r"stopped on SIGTERM at step (\d+)", log).group(1))
    assert stopped < 20 and f"loaded {out}/checkpoints/step_{stopped:08d}" in log  # mid-run, and resumed there
    launch.assert_identical(out, reference(2))


def test_a_job_with_a_config_error_fails_once_and_is_not_requeued(tmp_path, epochs):
    job_id = submit(tmp_path, *epochs, "train.steps=many", f"out_dir={tmp_path / 'run'}")
    info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=120)
    log = (tmp_path / "job.log").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["Restarts"] == "0", log[-2000:]
    assert "train.steps: expected int, got 'many'" in log and "not requeued" in log


def test_scancel_leaves_a_published_checkpoint_and_no_process_behind(tmp_path, epochs):
    out = tmp_path / "run"
    job_id = submit(tmp_path, *epochs, "train.steps=400", "checkpoint.interval=0", f"out_dir={out}")
    wait_job(job_id, ("RUNNING",))
    wait_steps(out, 3, job_id)
    assert subprocess.run(["scancel", job_id], timeout=30).returncode == 0
    wait_job(job_id, ("CANCELLED",), timeout=120)
    launch.wait_for(lambda: subprocess.run(["pgrep", "-f", str(out)], capture_output=True).returncode != 0, timeout=60)
    stopped = launch.lines(out / "metrics.jsonl")
    from checkpoint import storage
    from run import folder as runfolder

    record = runfolder.read_status(out)
    assert record["state"] == "stopped" and record["step"] == stopped
    newest = storage.list_checkpoints(out / "checkpoints")[0]
    assert newest[0] == stopped
    storage.verify(newest[1])
