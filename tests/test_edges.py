"""Rough edges: each bad input is exit 2 with a message naming the input, no traceback, nothing
written; each tool says which checkpoint it used. The commands run through their main() in this
process (the same code users run with python -m), the training runs through train.main()."""
import contextlib
import errno
import io
import json
import os
import shutil
import stat

import pytest
import torch

import launch
from checkpoint import storage
from run import folder as runfolder
from run.metrics import truncate as truncate_metrics

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def halted(tmp_path_factory, tiny):
    """A run halted at step 8 with a checkpoint every 4 steps."""
    out = tmp_path_factory.mktemp("edges") / "run"
    assert launch.in_process(*tiny, "checkpoint.interval=4", "train.halt_at=8", f"out_dir={out}")[0] == 0
    return out


def cli(*args) -> tuple[int, str, str]:
    """`python -m checkpoint ARGS` through its main(), in this process: (exit code, stdout, stderr)."""
    from cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("flags, expected", [
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number >= 1e-06, got -1.0"),
    (["--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number >= 1e-06, got nan"),
    (["--temperature", "inf"], "--temperature must be 0 (greedy) or a finite number >= 1e-06, got inf"),
    # found by review: a logit divided by so little overflows to inf, and the draw was a traceback (exit 1)
    (["--temperature", "1e-40"], "--temperature must be 0 (greedy) or a finite number >= 1e-06, got 1e-40"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be from 1e-06 to 1e+06 (1: none), got 0.0"),
    (["--repetition-penalty", "inf"], "--repetition-penalty must be from 1e-06 to 1e+06 (1: none), got inf"),
    (["--repetition-penalty", "1e-40"], "--repetition-penalty must be from 1e-06 to 1e+06 (1: none), got 1e-40"),
    (["--tokens", "-3"], "--tokens must be >= 0, got -3"),
    (["--top-k", "-1"], "--top-k must be >= 0 (0: all ids), got -1"),
    (["--prompt", "x" * 40], "the prompt is 41 tokens, but the model's context is model.seq_len=32 positions"),
])
def test_generate_refuses_settings_outside_their_range_and_a_prompt_past_the_context(halted, flags, expected):
    code, out, err = cli("generate", halted, *flags)
    assert code == 2 and expected in err and "Traceback" not in err and out == ""


def test_the_tools_name_the_checkpoint_they_used_and_a_newer_one_skipped_as_damaged_once_each(tmp_path, halted):
    run = tmp_path / "run"
    shutil.copytree(halted, run)
    (run / "checkpoints" / "step_00000008" / "state" / "__0_0.distcp").write_bytes(b"damaged")
    for args in (["inspect", run], ["generate", run, "--tokens", "4"], ["chat", run, "--prompt", "hi", "--tokens", "4"],
                 ["export", run, "--format", "minimind", "--out", tmp_path / "w.pth"], ["status", run, "--exit-code", "--sample"]):
        code, _, err = cli(*args)
        assert code == 0, err
        # once each: the model and the tokenizer come from the one checkpoint found once (weights.load_model_and_tokenizer)
        assert err.count("using checkpoint step 4: ") == 1, (args[0], err)
        assert err.count("skipped checkpoint step 8, newer than the one used") == 1, (args[0], err)


def test_a_manifest_whose_config_describes_another_model_is_a_message_not_a_size_mismatch(tmp_path, halted):
    folder = tmp_path / "step"
    shutil.copytree(halted / "checkpoints" / "step_00000008", folder)
    manifest = json.loads((folder / storage.MANIFEST).read_text())
    manifest["config"]["model"]["dim"] = 64  # the manifest itself is not hashed: an edit passes verify
    (folder / storage.MANIFEST).write_text(json.dumps(manifest))
    code, _, err = cli("generate", folder)
    assert code == 1 and "does not fit the model" in err and "config describes" in err and "Traceback" not in err


def test_export_on_a_full_disk_names_enospc_and_writes_nothing(tmp_path, halted, monkeypatch):
    from weights import exports

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(exports.torch, "save", full)
    code, _, err = cli("export", halted, "--format", "minimind", "--out", tmp_path / "w.pth")
    assert code == 1 and "No space left on device" in err and "nothing was written" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no temporary file left either


def test_an_export_gets_ordinary_file_modes(tmp_path, halted):
    umask = os.umask(0)
    os.umask(umask)
    assert cli("export", halted, "--format", "hf", "--out", tmp_path / "hf")[0] == 0
    assert cli("export", halted, "--format", "minimind", "--out", tmp_path / "w.pth")[0] == 0
    for path in [*(tmp_path / "hf").iterdir(), tmp_path / "w.pth"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


@pytest.mark.parametrize("make, expected", [
    (lambda d: (d / "m.png", [{"step": 1, "lr": 0.1}]), "metrics.jsonl:1: a metrics line needs numeric 'step', 'loss' and 'lr'"),
    (lambda d: (d / "no" / "m.png", [{"step": 1, "loss": 1.0, "lr": 0.1}]), "the folder"),
    (lambda d: (d / "m.xyz", [{"step": 1, "loss": 1.0, "lr": 0.1}]), "unknown image extension '.xyz'"),
])
def test_plot_refuses_a_line_without_loss_a_missing_folder_and_an_unknown_extension(tmp_path, make, expected):
    out, rows = make(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / runfolder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = cli("plot", run, "--out", out)
    assert code == 2 and expected in err and "Traceback" not in err and not out.exists()


def test_plot_prints_the_file_it_wrote(tmp_path, halted):
    code, out, _ = cli("plot", halted, "--out", tmp_path / "curves.png")
    assert code == 0 and out.strip() == f"plot: {tmp_path / 'curves.png'}" and (tmp_path / "curves.png").stat().st_size > 0


def test_the_tokenizer_trainer_says_the_size_a_small_corpus_reached_and_keeps_an_existing_tokenizer(tmp_path, corpus, trained):
    from data.tokenizer.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--vocab-size", "60000", "--out", str(tmp_path / "big"), str(corpus)])
    assert code == 2 and "--vocab-size 60000: the corpus gives only" in err.getvalue() and not (tmp_path / "big" / "tokenizer.json").exists()
    before = trained.read_bytes()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--vocab-size", "300", "--out", str(trained.parent), str(corpus)])
    assert code == 2 and "already holds tokenizer.json, tokenizer_config.json" in err.getvalue() and trained.read_bytes() == before


def test_a_missing_validation_file_names_data_val_path(tmp_path, tiny):
    code, err = launch.in_process(*tiny, f"data.val_path={tmp_path / 'nope.jsonl'}", f"out_dir={tmp_path / 'run'}")
    assert code == 2 and f"data.val_path: corpus {tmp_path / 'nope.jsonl'} does not exist" in err


def test_a_resume_that_changes_the_reduction_or_deterministic_kernels_warns(tmp_path, tiny):
    assert launch.in_process(*tiny, "train.halt_at=3", f"out_dir={tmp_path}")[0] == 0
    code, err = launch.in_process(*tiny, "train.halt_at=4", "dist.reduce=canonical", "runtime.deterministic=true", f"out_dir={tmp_path}")
    assert code == 0
    assert "dist.reduce was ddp, now canonical: the gradients are summed in another order" in err
    assert "runtime.deterministic was False, now True" in err


def test_init_from_given_on_a_resume_of_a_run_that_began_without_it_is_ignored_and_not_recorded(tmp_path, tiny, halted):
    assert launch.in_process(*tiny, "train.halt_at=3", f"out_dir={tmp_path}")[0] == 0
    code, err = launch.in_process(*tiny, "train.halt_at=4", f"model.init_from={halted}", f"out_dir={tmp_path}")
    assert code == 0 and f"model.init_from={halted} is ignored" in err
    config = (tmp_path / runfolder.CONFIG).read_text()
    assert "init_from: ''" in config and str(halted) not in config


def test_a_metrics_log_with_a_gap_before_the_resumed_step_is_an_error_not_a_silent_gap(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 4, 5, 6))
    path.write_text(text)
    with pytest.raises(storage.CheckpointError, match=r"should hold steps 1..5 once each, but lacks steps \[3\]"):
        truncate_metrics(path, 5)
    assert path.read_text() == text  # nothing dropped
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4, 5, 6)))
    assert truncate_metrics(path, 4) == 4


def test_a_symlinked_checkpoints_folder_is_refused_at_start_with_nothing_written(tmp_path, tiny, halted):
    """Through the link the run saw no checkpoint, started again from step 0, truncated metrics.jsonl
    and wrote over the checkpoints at the other end."""
    elsewhere = tmp_path / "bigdisk"
    shutil.copytree(halted / "checkpoints", elsewhere)
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(halted / runfolder.METRICS, out / runfolder.METRICS)
    (out / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    metrics = (out / runfolder.METRICS).read_bytes()
    code, err = launch.in_process(*tiny, "checkpoint.interval=4", f"out_dir={out}")
    assert code == 2 and "is a symbolic link" in err and "nothing was written" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before
    assert (out / runfolder.METRICS).read_bytes() == metrics and sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl"]
