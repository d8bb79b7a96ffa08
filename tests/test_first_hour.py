"""A newcomer's first hour (issue 42): the documented commands work as written (scripts/preempt.sh in
both modes, --help; the README's resume demo runs in tests/test_docs.py), an error stays the last line on screen, a refused
launch leaves no run folder behind, `status` says where a run is (running, or SIGKILLed), and the
small things a person watching sees (the bar's figures, the dropped metrics lines, GRPO's reward)."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import signal
import subprocess
import sys

import pytest

import launch
from run import folder as runfolder

SCRIPT_TIMEOUT = 600


VENV = {"MINIMIND_VENV": sys.prefix}
"""The scripts run in this interpreter's virtual environment (scripts/env.sh), also from a copy of the repository."""


def bash(*args: str, env: dict | None = None, timeout: int = SCRIPT_TIMEOUT) -> subprocess.CompletedProcess:
    """A repository script, as the docs run it (from the repository root)."""
    return subprocess.run(["bash", *args], cwd=launch.ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**launch.os.environ, **VENV, **(env or {})})


def checkpoint_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([launch.PY, "-m", "checkpoint", *args], cwd=launch.ROOT, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------------------------------------- scripts/preempt.sh

@pytest.mark.e2e
@pytest.mark.parametrize("mode", [[], ["--signal", "KILL", "--during-save"]], ids=["default", "kill-during-save"])
def test_preempt_sh_prints_pass_and_exits_0_in_both_documented_modes(tmp_path, tiny, mode):
    """The commands of docs/preemption.md, with one kill and the tests' tiny model (key=value
    overrides, which the script passes to both runs): PASS must come with exit 0."""
    proc = bash("scripts/preempt.sh", *mode, "--kills", "1", "--max-delay", "0.3", "--out", str(tmp_path / "preempt"),
                *tiny, "train.steps=60", "checkpoint.interval=5")
    assert "[preempt] PASS" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert re.search(r"\[preempt\] 1 kill\(s\) landed", proc.stdout), proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- --help

@pytest.mark.e2e
def test_train_sh_help_prints_the_help_once_and_exits_0(tmp_path):
    proc = bash("scripts/train.sh", "--help", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("usage: train.py") == 1 and out.count("  train.global_batch = 32") == 1
    assert "--nproc N" in out and "File name too long" not in out


def flat_keys(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.unit
def test_python_m_configs_help_lists_every_key_with_its_default_and_a_description_under_its_group():
    from configs import Config, to_dict
    from configs.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = out.getvalue()
    lines = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^  (\S+) = (.*?)  # (.+)$", text, re.M)}
    keys = flat_keys(to_dict(Config()))
    assert set(keys) <= set(lines), f"keys without a described line: {sorted(set(keys) - set(lines))}"
    for key, default in keys.items():
        assert lines[key][0] == repr(default) and len(lines[key][1]) > 10, key
    groups, current = set(), None
    for line in text.splitlines():  # each key under the header of its own group
        if header := re.match(r"^(\S+)(?: \(docs/[^)]*\))?:$", line):
            current = header.group(1)
            groups.add(current)
        elif key := re.match(r"^  (\S+) = ", line):
            assert (key.group(1).rpartition(".")[0] or "run") == current, line
    assert {"run", "model", "train", "train.lora", "data", "checkpoint", "dist", "runtime", "log", "eval"} <= groups


# ---------------------------------------------------------------------------------------------- errors stay on screen

@pytest.mark.e2e
def test_a_launch_refused_for_bad_input_before_training_leaves_no_run_folder_and_ends_with_its_line(tmp_path, tiny):
    runs = tmp_path / "runs"  # neither runs/ nor runs/new exists: the launch makes both, and takes both back
    proc = bash("scripts/train.sh", *tiny, f"data.path={tmp_path / 'missing.jsonl'}", f"out_dir={runs / 'new'}", timeout=180)
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    assert not runs.exists()
    assert "ChildFailedError" not in err and "Root Cause" not in err and "Traceback" not in err
    tail = err.strip().splitlines()
    assert tail[-1].startswith(f"[status] no run folder at {runs / 'new'}") and tail[-1].endswith("exit 2")
    # both ranks refuse the same input: which one exits first is a race (rank 1 did, once, in CI)
    assert re.match(r"torchrun: train\.py failed: rank [01] exited with 2 first", tail[-2]), tail[-2]
    assert sum("missing.jsonl does not exist" in line and "[rank" not in line for line in tail) == 1


@pytest.mark.e2e
def test_a_relaunch_on_a_world_size_the_global_batch_does_not_divide_exits_2_naming_what_works_and_keeps_the_run(tmp_path, tiny):
    out = tmp_path / "run"
    assert launch.in_process(*tiny, "train.steps=4", "checkpoint.interval=2", f"out_dir={out}")[0] == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    proc = bash("scripts/train.sh", "--nproc", "3", *tiny, "train.steps=4", f"out_dir={out}", timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"[status] {out}: failed (its last checkpoint: step 4): error: train.global_batch=8 is not divisible")
    assert "the world sizes that work are 1, 2, 4" in last and "the nearest global batches that work are 6 and 12" in last
    assert last.endswith("; exit 2") and "Traceback" not in proc.stderr and "Root Cause" not in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # a run folder that existed is never taken back
    shown = json.loads(checkpoint_cli("status", str(out)).stdout)
    assert shown["state"] == "failed" and shown["step"] == 4 and shown["published_step"] == 4  # the step that stands


@pytest.mark.unit
def test_a_refused_launch_takes_back_only_a_folder_it_made_that_holds_nothing_trained(tmp_path):
    made = runfolder.acquire(tmp_path / "a" / "new", 0)
    runfolder.write_status(made.out_dir, "running")
    runfolder.finish(made, "bad_input", None, "error: refused")
    made.release()
    assert not (tmp_path / "a").exists()  # the parent it made too

    existing = tmp_path / "existing"
    existing.mkdir()
    lock = runfolder.acquire(existing, 0)
    runfolder.finish(lock, "bad_input", None, "error: refused")
    lock.release()
    assert runfolder.read_status(existing)["outcome"] == "bad_input"  # a folder that was there: its status says why

    trained = runfolder.acquire(tmp_path / "trained", 0)
    (trained.out_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    runfolder.finish(trained, "bad_input", None, "error: refused")
    trained.release()
    assert (trained.out_dir / "checkpoints" / "step_00000002").is_dir() and runfolder.read_status(trained.out_dir)["state"] == "failed"

    failed = runfolder.acquire(tmp_path / "failed", 0)
    runfolder.finish(failed, "failed", None, "error: disk")  # not bad input: recorded, kept
    failed.release()
    assert runfolder.read_status(failed.out_dir)["outcome"] == "failed"


@pytest.mark.e2e
def test_a_config_error_under_torchrun_is_printed_once_not_once_per_rank(tmp_path, tiny):
    proc = launch.run(2, *tiny, "train.no_such_key=1", f"out_dir={tmp_path / 'run'}", expect=None)
    assert proc.stderr.count("unknown key 'train.no_such_key'") == 1, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- status

@pytest.mark.e2e
def test_status_shows_a_running_runs_step_loss_speed_checkpoint_and_eta_and_a_sigkilled_run_as_stopped(tmp_path, tiny):
    out = tmp_path / "run"
    proc = launch.start(launch.command(2, *tiny, "train.steps=100000", "checkpoint.interval=4", f"out_dir={out}"), tmp_path / "log")
    launch.wait_for(lambda: launch.lines(out / "metrics.jsonl") >= 6 and (out / "checkpoints" / "step_00000004").exists(), proc=proc)
    running = json.loads(checkpoint_cli("status", str(out)).stdout)
    assert running["state"] == "running" and running["held_by"]["pid"]
    assert running["step"] >= 6 and running["steps"] == 100000 and isinstance(running["loss"], float)
    assert running["tokens_per_s"] > 0 and running["published_step"] >= 4 and running["since_checkpoint_s"] >= 0
    assert running["eta_s"] > 0 and running["summary"].startswith(f"running: step {running['step']} of 100000, loss ")
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    launch.wait_for(lambda: runfolder.wait_until_free(out, 0), timeout=60)
    published = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    killed = json.loads(checkpoint_cli("status", str(out)).stdout)
    assert killed["state"] == "stopped (no process holds the lock)" and killed["recorded_state"] == "running"
    assert killed["step"] == published == killed["published_step"] and killed["eta_s"] is None and killed["held_by"] is None
    assert killed["summary"].startswith(f"stopped (no process holds the lock): last published step {published}")


# ---------------------------------------------------------------------------------------------- what a person watching sees

class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def grpo_record(step: int) -> dict:
    return {"step": step, "epoch": 0, "loss": 0.5 / step, "lr": 1e-3, "samples_seen": step, "reward/mean": 0.1 * step, "reward/std": 0.0}


@pytest.mark.unit
def test_the_progress_bar_shows_the_objectives_figures_on_a_terminal_and_nothing_elsewhere(monkeypatch, tmp_path):
    from run import tracking
    from run.metrics import Metrics

    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    m = Metrics(tmp_path / "metrics.jsonl", tracking.Tracker(), 10, 0, 5, 100, True)
    m.step(grpo_record(1), 0.01)
    assert not m.bar.disable and m.bar.postfix == "reward=0.1000, loss=0.5000"
    m.step({"step": 2, "epoch": 0, "loss": 0.25, "lr": 1e-3, "samples_seen": 2, "rewards/accuracies": 0.75}, 0.01)  # DPO's
    assert m.bar.postfix == "loss=0.2500, accuracy=0.7500"
    m.close()
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a log file: no bar, whatever log.progress says
    assert Metrics(None, tracking.Tracker(), 10, 0, 5, 100, True).bar.disable


@pytest.mark.unit
def test_grpos_closing_line_reports_the_reward(caplog):
    from run import tracking
    from run.metrics import Metrics

    m = Metrics(None, tracking.Tracker(), 3, 0, 5, 100, False)
    for step in (1, 2, 3):
        m.step(grpo_record(step), 0.01)
    with caplog.at_level(logging.INFO, logger="minimind"):
        m.report("finished", 3, float("nan"))
    assert "finished at step 3: reward 0.3000, mean of the last 3 steps 0.2000, loss 0.1667" in caplog.text


@pytest.mark.unit
def test_a_resume_says_how_many_metrics_lines_it_dropped_and_why(tmp_path, caplog):
    from run.metrics import truncate

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    with caplog.at_level(logging.INFO, logger="minimind"):
        assert truncate(path, 4) == 4
    assert f"{path}: dropped 3 lines past the resumed step 4 (logged after the last checkpoint" in caplog.text
    assert "and 1 half-written or unreadable line" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minimind"):
        truncate(path, 4)
    assert "dropped" not in caplog.text  # nothing to drop, nothing said


@pytest.mark.unit
def test_a_run_that_ends_with_0_prints_its_models_greedy_reply_above_the_outcome_line_and_an_empty_prompt_none(tmp_path, tiny):
    """scripts/train.sh's closing status (--exit-code --sample): what the recipe's model now says."""
    from cli import main
    from cli.generate import generate_text
    from weights import load_model, load_tokenizer

    def closing(run) -> list[str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main(["status", str(run), "--exit-code", "--sample"]) == 0
        return err.getvalue().strip().splitlines()[-2:]

    run = tmp_path / "run"
    assert launch.in_process(*tiny, "train.steps=3", f"out_dir={run}")[0] == 0
    sample, outcome = closing(run)
    reply = generate_text(load_model(run), "The ", 27, 0.0, 0, load_tokenizer(run))[len("The "):]  # 32 positions: 5 for BOS + "The "
    assert sample == f"[sample] 'The ' -> {reply!r} (greedy; log.sample_prompt)" and outcome.startswith("[status]")
    quiet = tmp_path / "quiet"
    assert launch.in_process(*tiny, "train.steps=3", "log.sample_prompt=", f"out_dir={quiet}")[0] == 0
    assert closing(quiet)[0] == "[sample] (log.sample_prompt is empty: none)"


@pytest.mark.unit
@pytest.mark.parametrize("argv, expected", [
    (["serve", "RUN", "--port", "99999"], "argument --port: expected an integer from 0 to 65535, got '99999'"),
    (["serve", "RUN", "--slots", "0"], "argument --slots: expected an integer at least 1, got '0'"),
    (["serve", "RUN", "--queue", "-1"], "argument --queue: expected an integer at least 0, got '-1'"),
    (["status", "RUN", "--exit-code", "--wait-s", "inf"], "argument --wait-s: expected a number at least 0, got 'inf'"),
    (["eval", "RUN", "--limit", "many"], "argument --limit: expected an integer, got 'many'"),
])
def test_a_tools_flag_out_of_its_range_is_argparses_exit_2_naming_the_flag_before_anything_is_read(argv, expected, capsys):
    import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and expected in err and "Traceback" not in err, err


@pytest.mark.unit
def test_status_of_a_folder_that_holds_no_run_is_bad_input_naming_what_a_run_folder_holds(tmp_path, capsys):
    import cli

    (tmp_path / "notes.txt").write_text("not a run\n")
    assert cli.main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: not a run folder (none of .lock, status.json, config.yaml, metrics.jsonl, checkpoints in it)" in err, err


# ---------------------------------------------------------------------------------------------- a fresh machine
@pytest.mark.e2e
def test_the_unit_tier_draws_on_a_machine_where_matplotlib_never_ran(tmp_path):
    """matplotlib's first import on a machine runs `fc-list` to build its font cache; the unit tier's
    guard refuses a process a test starts, so the drawing unit tests get matplotlib from a session
    fixture (conftest.py: matplotlib_ready) set up before the guard. An empty MPLCONFIGDIR is that
    fresh machine."""
    fresh = tmp_path / "mplconfig"
    fresh.mkdir()
    proc = subprocess.run([launch.PY, "-m", "pytest", "tests/test_distill.py", "-m", "unit", "-k", "plot", "-q", "-p", "no:xdist",
                           "-p", "no:cacheprovider"], cwd=launch.ROOT, capture_output=True, text=True, timeout=300,
                          env={**launch.os.environ, "MPLCONFIGDIR": str(fresh)})
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
    assert list(fresh.glob("fontlist-*.json")), "the font cache was not built here: this was not a fresh machine"


@pytest.mark.e2e
def test_the_referee_tests_fail_under_ci_where_minimind_s_code_is_missing_and_skip_elsewhere(tmp_path):
    """The comparisons with MiniMind's own code (PPO's, the agent's, its model's; conftest.needs_referee)
    cannot pass by not running in CI: MINIMIND_SHARED pointed at nothing is a machine without them."""
    def run(ci: str) -> str:
        env = {k: v for k, v in launch.os.environ.items() if k != "CI"}
        proc = subprocess.run([launch.PY, "-m", "pytest", "tests/test_ppo.py", "tests/test_agent.py", "tests/test_models.py", "-m", "referee",
                               "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-rfs"], cwd=launch.ROOT, capture_output=True, text=True,
                              timeout=300, env={**env, "MINIMIND_SHARED": str(tmp_path / "nothing"), **({"CI": ci} if ci else {})})
        return proc.stdout

    ci, plain = run("true"), run("")
    failed = re.search(r"(\d+) errors?", ci)  # failed in set-up: the suite fails
    assert failed and int(failed.group(1)) >= 4 and " passed" not in ci and "skipped" not in ci, ci[-3000:]
    assert "MiniMind's train_ppo.py is not at" in ci and "MiniMind's train_agent.py is not at" in ci and "CI=true needs the referee" in ci
    assert re.search(rf"{failed.group(1)} skipped", plain) and " failed" not in plain and " passed" not in plain, plain[-3000:]
