"""One run per folder, and nothing lost: the lock, no silent fresh start, pruning that deletes only
what it owns, a manifest confined to its folder, and the exit code a scheduler sees. Real launches
(plain python and torchrun, and the README's scripts/train.sh); resumed runs are compared with the
uninterrupted reference bit for bit."""
import json
import os
import shutil
import signal
import subprocess

import pytest

import launch
from checkpoint import storage
from run import folder as runfolder

pytestmark = pytest.mark.e2e


def snapshot(folder):
    """Every file under folder with its bytes (the lock and the status aside): what "nothing was
    deleted or changed" compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in (runfolder.LOCK, runfolder.STATUS)}


@pytest.fixture(scope="module")
def halted(tmp_path_factory, epochs):
    """A plain-python run halted at step 8 with a checkpoint every 4 steps: copied by each test."""
    out = tmp_path_factory.mktemp("halted")
    launch.run(0, *epochs, "checkpoint.interval=4", "train.halt_at=8", f"out_dir={out}")
    return out


def copy_of(halted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(halted, out, ignore=shutil.ignore_patterns(runfolder.LOCK))
    return out


def test_a_second_launch_on_a_held_folder_waits_then_refuses_naming_the_holder_and_the_first_finishes_exactly(tmp_path, epochs, reference):
    out = tmp_path / "run"
    first = launch.start(launch.command(0, *epochs, "checkpoint.interval=2", f"out_dir={out}", script=launch.SLOW_SAVE),
                         tmp_path / "first.log", env={"SLOW_SAVE_S": "0.3"})  # ~1 s per saved step: a long first run
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 1, proc=first)
    second = launch.run(0, *epochs, "checkpoint.lock_timeout_s=1", f"out_dir={out}", expect=2)
    assert f"is held by pid {first.pid} on host" in second.stderr and "waiting up to 1 s" in second.stderr
    assert "another run is using this folder" in second.stderr and "Traceback" not in second.stderr
    assert first.wait(timeout=120) == 0
    assert [m["step"] for m in launch.metrics(out)] == list(range(1, 21))
    launch.assert_identical(out, reference(0))
    assert runfolder.read_status(out)["state"] == "finished"


def test_a_relaunch_while_the_first_run_is_inside_a_slowed_save_waits_for_it_and_resumes_exactly(tmp_path, epochs, reference):
    out, gate = tmp_path / "run", tmp_path / "gate"
    # Every file of the first run's saves waits for the gate, opened once the relaunch has reported the
    # held lock: the window is the test's, not the machine's load.
    first = launch.start(launch.command(2, *epochs, "checkpoint.interval=4", f"out_dir={out}", script=launch.SLOW_SAVE),
                         tmp_path / "first.log", env={"SLOW_SAVE_UNTIL": str(gate)})
    launch.wait_for(lambda: any((out / "checkpoints").glob(".tmp-step_*")), proc=first)
    launch.kill_tree(first.pid, signal.SIGTERM)  # preempted inside a save; the scheduler relaunches at once
    second_log = tmp_path / "second.log"
    second = launch.start(launch.command(2, *epochs, f"out_dir={out}"), second_log)
    launch.wait_for(lambda: "is held by pid" in second_log.read_text(), proc=second)  # it waits
    assert first.poll() is None  # the first is still inside its save
    gate.touch()
    first.wait(timeout=120)  # torchrun itself exits 1 on SIGTERM; its workers log the 75 checked below
    assert second.wait(timeout=launch.TIMEOUT) == 0
    assert "left by an interrupted save" not in second_log.read_text()
    assert "stopped on SIGTERM" in (tmp_path / "first.log").read_text()  # the first saved and left on its own
    launch.assert_identical(out, reference(2))


def test_when_every_checkpoint_is_damaged_the_run_stops_with_each_fault_and_trains_and_deletes_nothing(tmp_path, epochs, halted):
    out = copy_of(halted, tmp_path)
    for step in (4, 8):
        target = out / "checkpoints" / f"step_{step:08d}" / "state" / "__0_0.distcp"
        target.write_bytes(target.read_bytes()[:100])
    before = snapshot(out)
    proc = launch.run(0, *epochs, "checkpoint.interval=4", f"out_dir={out}", expect=1)
    assert "no checkpoint verifies" in proc.stderr and "will not start fresh" in proc.stderr
    assert "step_00000008/state/__0_0.distcp: 100 bytes" in proc.stderr and "step_00000004/state/__0_0.distcp: 100 bytes" in proc.stderr
    assert "checkpoint.resume=<a checkpoint folder you trust>, or a new out_dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(out) == before  # no metrics line, no checkpoint, no config written or removed
    status = runfolder.read_status(out)
    assert status["state"] == "failed" and status["exit_code"] == 1 and "no checkpoint verifies" in status["cause"]


def test_resume_never_in_a_folder_that_holds_checkpoints_is_an_error_that_deletes_nothing(tmp_path, epochs, halted):
    out = copy_of(halted, tmp_path)
    before = snapshot(out)
    proc = launch.run(0, *epochs, "checkpoint.resume=never", f"out_dir={out}", expect=2)
    assert "checkpoint.resume=never, but" in proc.stderr and "step_00000008, step_00000004" in proc.stderr
    assert "nothing was deleted" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(out) == before


def test_a_symlinked_step_folder_is_skipped_and_nothing_outside_is_opened_or_deleted(tmp_path, epochs, halted, reference):
    out, outside = copy_of(halted, tmp_path), tmp_path / "outside"
    shutil.copytree(out / "checkpoints" / "step_00000008", outside / "step_00000040")  # valid, and newest by name
    manifest = json.loads((outside / "step_00000040" / storage.MANIFEST).read_text())
    (outside / "step_00000040" / storage.MANIFEST).write_text(json.dumps({**manifest, "step": 40}))
    storage.verify(outside / "step_00000040")
    link = out / "checkpoints" / "step_00000040"
    link.symlink_to(outside / "step_00000040", target_is_directory=True)
    before = snapshot(outside)
    proc = launch.run(0, *epochs, "checkpoint.interval=4", "checkpoint.keep=2", f"out_dir={out}")
    assert "step_00000040: a symbolic link" in proc.stderr and "step 8 resumes at sample" in proc.stderr
    assert snapshot(outside) == before and link.is_symlink()  # pruning (keep=2) went past it
    assert [s for s, _ in storage.list_checkpoints(out / "checkpoints")] == [20, 16]
    launch.assert_identical(out, reference(0))


def test_sigterm_to_torchrun_or_the_whole_tree_at_any_moment_makes_train_sh_exit_75_and_the_run_ends_bit_identical(tmp_path, epochs, reference):
    """Five launches of scripts/train.sh on one run folder, the first four stopped: in set-up (torchrun
    alone, while its workers import torch), while the corpus is packed (the whole tree, a slowed
    packer), in the loop (torchrun alone) and inside the final save (the whole tree, a slowed save);
    the fifth has nothing to do. Each stop exits 75 and leaves a folder that resumes, and the run
    equals the uninterrupted reference."""
    out, cache = tmp_path / "run", tmp_path / "cache"  # a cache of its own: this run's corpus is packed by it
    cmd = ["bash", "scripts/train.sh", *epochs, f"data.cache_dir={cache}", "checkpoint.interval=4", f"out_dir={out}"]

    def agent(proc):
        found = [p for p in launch.children(proc.pid) if "runtime.launch" in launch.cmdline(p)]
        return found[0] if found else None

    stops = [  # (where, whom, the test double of train.py, when to signal)
        ("set-up", "torchrun", "train.py", lambda proc: agent(proc) is not None),
        ("packing", "tree", "tests/slow_pack_train.py", lambda proc: any(cache.glob("*.bin.tmp-*")) or any(cache.glob(".*.bin.tmp-*"))),
        ("the loop", "torchrun", "train.py", lambda proc: launch.lines(out / "metrics.jsonl") >= 6),
        ("the final save", "tree", launch.SLOW_SAVE, lambda proc: any((out / "checkpoints").glob(".tmp-step_00000020-*/state/.metadata"))),
    ]
    for where, whom, script, ready in stops:
        proc = launch.start(cmd, tmp_path / f"log-{where}", env={"TRAIN_PY": script, "SLOW_SAVE_S": "1", "SLOW_PACK_S": "1"})
        launch.wait_for(lambda: ready(proc), proc=proc, every=0.02)
        if whom == "tree":
            launch.kill_tree(proc.pid, signal.SIGTERM)
        else:
            os.kill(agent(proc), signal.SIGTERM)
        log = lambda: (tmp_path / f"log-{where}").read_text()[-3000:]  # noqa: E731
        assert proc.wait(timeout=120) == 75, (where, log())
        status = runfolder.read_status(out)
        assert status is None or status["state"] == "stopped", (where, status)
        if where == "packing":  # no half-written cache is left, nor a cache that would be used
            assert not any(cache.glob(".*.tmp-*")) and not any(cache.glob("*.bin")), sorted(p.name for p in cache.iterdir())
    assert launch.lines(out / "metrics.jsonl") == 20  # the last stop came inside the save of the last step
    code = subprocess.run(cmd, cwd=launch.ROOT, capture_output=True, text=True, timeout=300)
    assert code.returncode == 0 and "nothing to do: the run is at step 20 of 20" in code.stderr
    launch.assert_identical(out, reference(2))
    status = subprocess.run([launch.PY, "-m", "checkpoint", "status", str(out)], cwd=launch.ROOT, capture_output=True, text=True)
    assert json.loads(status.stdout)["state"] == "finished" and json.loads(status.stdout)["held_by"] is None


# ---------------------------------------------------------------- clear errors, no traceback, nothing written
@pytest.mark.parametrize("setting, expected", [
    ("checkpoint.resume={missing}", "checkpoint.resume: {missing} does not exist"),
    ("checkpoint.resume={file}", "checkpoint.resume: {file} is a file"),
    ("out_dir={file}", "out_dir: {file} is a regular file"),
])
def test_a_resume_path_that_is_missing_or_a_file_and_an_out_dir_that_is_a_file_are_config_errors_before_anything_is_written(
        tmp_path, tiny, setting, expected):
    names = {"missing": tmp_path / "no-such-checkpoint", "file": tmp_path / "a-file"}
    names["file"].write_text("x")
    out = tmp_path / "run"
    args = [*tiny, f"out_dir={out}", setting.format(**names)]
    code, err = launch.in_process(*args)
    assert code == 2 and expected.format(**names) in err and "Traceback" not in err
    assert not out.exists() and "data:" not in err  # refused before data preparation and before out_dir


def test_more_samples_than_the_corpus_holds_is_an_error_naming_the_key_and_the_count(tmp_path, tiny):
    code, err = launch.in_process(*tiny, "data.num_samples=99999", f"out_dir={tmp_path}")
    assert code == 2 and "data.num_samples=99999, but the corpus packs into only" in err


def test_a_text_line_with_a_lone_surrogate_is_an_error_naming_the_file_and_line(tmp_path, tiny):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "broken \\ud800 here"}\n')
    code, err = launch.in_process(*tiny, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}")
    assert code == 2 and f"{corpus}:2: the text holds a lone surrogate" in err
    assert not list((tmp_path / "cache").glob("*.bin")) and not list((tmp_path / "cache").glob(".*tmp*"))


def test_a_packing_temp_file_left_by_a_killed_preparation_is_removed_at_the_next_start(tmp_path, corpus, tiny):
    from data.prepare import pack

    cache = tmp_path / "cache"
    bin_path, _ = pack(corpus, 32, cache)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone, as a killed preparation's is
    leftover = bin_path.with_name(f".{bin_path.name}.tmp-{os.uname().nodename}-{dead.pid}")
    leftover.write_bytes(b"half a packed file")
    bin_path.unlink()  # so that the next start packs again
    pack(corpus, 32, cache)
    assert not leftover.exists() and bin_path.exists()


def test_a_resume_under_a_changed_optimizer_setting_warns_with_the_old_and_new_values(tmp_path, tiny):
    assert launch.in_process(*tiny, "train.halt_at=2", f"out_dir={tmp_path}")[0] == 0
    code, err = launch.in_process(*tiny, "train.halt_at=3", "train.lr=1e-3", "train.beta2=0.99", f"out_dir={tmp_path}")
    assert code == 0
    assert "train.lr was 0.003, now 0.001" in err and "train.beta2 was 0.95, now 0.99" in err
    assert "train.grad_clip was" not in err


def test_the_refusal_of_pickled_code_does_not_suggest_weights_only_false(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    import torch

    torch.save({"x": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(storage.CheckpointError) as e:
        storage.safe_load(tmp_path / "evil.pth")
    assert "refused without running them" in str(e.value) and "weights_only" not in str(e.value)


def run_cli(*args, in_process: bool = False):
    """`python -m checkpoint ARGS` as users run it, or its main() in this process (the same code)."""
    if not in_process:
        return subprocess.run([launch.PY, "-m", "checkpoint", *map(str, args)], cwd=launch.ROOT, capture_output=True, text=True, timeout=120)
    import contextlib
    import io

    from cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(map(str, args)))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_a_tampered_manifest_is_a_damaged_checkpoint_for_inspect_and_generate_exit_1_named(tmp_path, halted):
    out = copy_of(halted, tmp_path)
    folder = out / "checkpoints" / "step_00000008"
    manifest = json.loads((folder / storage.MANIFEST).read_text())
    manifest["files"]["state/__0_0.distcp"] = "not an entry"
    (folder / storage.MANIFEST).write_text(json.dumps(manifest))
    for verb in ("inspect", "generate"):
        proc = run_cli(verb, folder)
        assert proc.returncode == 1 and "the entry for state/__0_0.distcp is not" in proc.stderr and "Traceback" not in proc.stderr


def test_compare_tells_an_unreadable_metrics_file_from_runs_that_differ(tmp_path, halted):
    a, b = copy_of(halted, tmp_path / "a"), copy_of(halted, tmp_path / "b")
    assert run_cli("compare", a, b, in_process=True).returncode == 0
    lines = (b / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps({**json.loads(lines[-1]), "loss": 9.0})]) + "\n")
    assert run_cli("compare", a, b, in_process=True).returncode == 1
    (b / "metrics.jsonl").write_text("{not json\n")
    proc = run_cli("compare", a, b)  # the command itself
    assert proc.returncode == 2 and "metrics.jsonl:1: not a metrics line" in proc.stderr and "Traceback" not in proc.stderr


def test_a_folder_locked_by_another_process_is_refused_naming_it(tmp_path):
    """The lock on its own, in seconds: another process holds out_dir; acquiring it here waits the
    timeout, then refuses naming that process; once it is gone the folder is free."""
    holder = subprocess.Popen(
        [launch.PY, "-c", "import sys, time; from pathlib import Path; from run import folder as runfolder; "
                          "runfolder.acquire(Path(sys.argv[1]), 0); print('held', flush=True); time.sleep(60)", str(tmp_path)],
        cwd=launch.ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(runfolder.RunFolderError, match=f"is held by pid {holder.pid} on host .*waited 0.3 s"):
            runfolder.acquire(tmp_path, 0.3, poll_s=0.05)
    finally:
        holder.kill()
        holder.wait()
    runfolder.acquire(tmp_path, 5).release()


def catches(pid: int, sig: int) -> bool:
    """Has process `pid` installed a handler for `sig` (its SigCgt mask in /proc)?"""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


# A stop while the corpus is packed: test_sigterm_to_torchrun_or_the_whole_tree_at_any_moment (a slowed packer).
@pytest.mark.parametrize("stage", ["before the launch", "waiting for the run folder's lock"])
def test_a_stop_before_the_run_is_under_way_makes_scripts_train_sh_exit_75_with_nothing_lost(tmp_path, epochs, stage):
    """A scheduler's SIGTERM in the first seconds must mean "resume me" (75), never "bad input" (2)
    or a death by signal (143): nothing was lost, and no half-written file is left."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = [*epochs, f"data.cache_dir={cache}", f"out_dir={out}"]
    holder = None
    if stage == "waiting for the run folder's lock":
        holder = subprocess.Popen(
            [launch.PY, "-c", "import sys, time; from pathlib import Path; from run import folder as runfolder; "
                              "runfolder.acquire(Path(sys.argv[1]), 0); print('held', flush=True); time.sleep(120)", str(out)],
            cwd=launch.ROOT, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        args.append("checkpoint.lock_timeout_s=120")
    proc = launch.start(["bash", "scripts/train.sh", *args], tmp_path / "log")
    try:
        if stage == "before the launch":
            launch.wait_for(lambda: catches(proc.pid, signal.SIGTERM), proc=proc)  # the trap is in place
            os.kill(proc.pid, signal.SIGTERM)  # to the script alone, while it sets up
        else:
            launch.wait_for(lambda: "is held by" in (tmp_path / "log").read_text(), proc=proc, timeout=120)
            launch.kill_tree(proc.pid, signal.SIGTERM)  # as a scheduler does: every process of the job
        assert proc.wait(timeout=120) == 75, (tmp_path / "log").read_text()[-3000:]
    finally:
        if holder:
            holder.kill()
            holder.wait()
    log = (tmp_path / "log").read_text()
    assert 'train.py", line' not in log  # no traceback through our code (torchrun's agent prints its own on a signal)
    if stage == "before the launch":
        assert "stopped before the run started" in log and not out.exists()
    else:
        assert "during set-up: nothing to save" in log
        assert not list(out.glob("checkpoints/*")) and not (out / "metrics.jsonl").exists()


# ---------------------------------------------------------------- an out_dir the run cannot write: an I/O failure, exit 1
def unwritable(kind: str, folder) -> list[str]:
    """The command prefix under which `folder` cannot be written, by a real cause: "read-only" bind-
    mounts it read-only in a mount namespace of the command's own (EROFS, as a read-only disk gives);
    "denied" takes its write permission away (chmod 555) and, for root, the capability that ignores
    permissions (EACCES). Where this machine cannot do it the test skips, except under CI=true."""
    if kind == "read-only":
        prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                  'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"', str(folder)]
    else:
        folder.chmod(0o555)
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    probe = subprocess.run([*prefix, "sh", "-c", f'touch "{folder}/.probe"'], capture_output=True, text=True)
    if probe.returncode == 0 or not any(w in probe.stderr for w in ("Read-only", "Permission denied")):
        (folder / ".probe").unlink(missing_ok=True)
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot make {folder} {kind} here: {probe.stderr.strip()}")
        pytest.skip(f"cannot make {folder} {kind} here: {probe.stderr.strip()}")
    return prefix


@pytest.mark.parametrize("kind", ["read-only", "denied"])
@pytest.mark.parametrize("held", [False, True], ids=["empty", "held-a-run"])
@pytest.mark.parametrize("launcher", ["train.py", "scripts/train.sh"])
def test_an_out_dir_that_cannot_be_written_is_an_io_failure_exit_1_naming_the_path_in_the_trainer_and_the_launcher(
        tmp_path, tiny, halted, kind, held, launcher):
    out = copy_of(halted, tmp_path) if held else tmp_path / "run"
    out.mkdir(exist_ok=True)
    before = snapshot(out)
    try:
        prefix = unwritable(kind, out)
        command = [launch.PY, "train.py"] if launcher == "train.py" else ["bash", "scripts/train.sh", "--nproc", "1"]
        proc = subprocess.run([*prefix, *command, *tiny, "train.steps=12", f"out_dir={out}"], cwd=launch.ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "VIRTUAL_ENV": str(launch.ROOT / ".venv")})
    finally:
        out.chmod(0o755)
    cause = "Read-only file system" if kind == "read-only" else "Permission denied"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"{out / runfolder.LOCK}: {cause}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and snapshot(out) == before
