"""`python -m checkpoint convert` on checkpoints the previous release really wrote
(tests/fixtures/prev_release/, made by the release at commit aeff64a): the converted run resumes to
the bits of the uninterrupted run of today's code, a conversion killed at every step of its sequence
is finished by the rerun (and no resume in between loads an older step or deletes anything), and bad
input is named with the exit code of common/outcome.py."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml

import launch
from checkpoint import CheckpointConfig, CheckpointManager, RunMeta, storage
from checkpoint.manager import CONVERT_JOURNAL
from cli import convert as conv
from common.outcome import exit_code

pytestmark = pytest.mark.unit

FIXTURES = launch.ROOT / "tests" / "fixtures" / "prev_release"
RUNS = {"pretrain": "corpus.jsonl", "sft": "chats.jsonl"}
"""The fixture runs (halted at step 2 of 4, checkpoints at steps 1 and 2) and the corpus each trained on."""
POINTS = ("journal", "staged", "aside", "renamed", "cleaned", "converted")


def old_run(name: str, where: Path) -> Path:
    """A copy of a run folder the previous release wrote (its lock, which that release left, not copied)."""
    run = where / name
    shutil.copytree(FIXTURES / name, run)
    return run


def overrides(name: str, out: Path, cache: Path) -> list[str]:
    """The fixture run's own recorded config as command-line keys, on a corpus and cache of this test."""
    recorded = yaml.safe_load((FIXTURES / name / "config.yaml").read_text())
    here = {"out_dir": str(out), "data.cache_dir": str(cache), "data.path": str(FIXTURES / RUNS[name]), "train.halt_at": 0}
    flat = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(recorded, "")
    flat.update(here)
    return [f"{k}={v}" for k, v in flat.items()]


def cli(*argv: str) -> tuple[int, str, str]:
    """`python -m checkpoint ...` in this process: (exit code, stdout, stderr)."""
    from cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """Each fixture's config run to its end by today's code from scratch, uninterrupted."""
    base = tmp_path_factory.mktemp("reference")
    refs = {}
    for name in RUNS:
        refs[name] = base / name
        code, err = launch.in_process(*overrides(name, refs[name], base / "cache"))
        assert code == 0, err
    return refs


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_the_previous_release_wrote_converts_and_resumes_to_the_uninterrupted_runs_bits(name, tmp_path, reference):
    run = old_run(name, tmp_path)
    code, out, err = cli("convert", str(run))
    assert code == 0, err
    assert "train.objective=next_token" in out and "train.lora=" in out  # the keys filled are named
    here = launch.fixture_bits_here(run, overrides(name, tmp_path / "x", tmp_path / "cache"), tmp_path / "two")  # converted: format 3
    code, err = launch.in_process(*overrides(name, run, tmp_path / "cache"))
    assert code == 0, err
    assert [m["loss"] for m in launch.metrics(run)][:2] == [m["loss"] for m in launch.metrics(FIXTURES / name)]
    if here:
        launch.assert_identical(run, reference[name])  # every logged loss (steps 1-2 the old release's) and the final sha256
        return
    # Another CPU's bits in the fixture: the converted run halted at step 3 and resumed ends as the one resumed once.
    again = old_run(name, tmp_path / "again")
    assert cli("convert", str(again))[0] == 0
    assert launch.in_process(*overrides(name, again, tmp_path / "cache"), "train.halt_at=3")[0] == 0
    assert launch.metrics(again)[-1]["step"] == 3  # halted there
    assert launch.in_process(*overrides(name, again, tmp_path / "cache"))[0] == 0
    launch.assert_identical(run, again)


def test_the_converted_record_keeps_every_key_the_old_release_recorded_and_fills_the_rest_with_what_it_did(tmp_path):
    run = old_run("pretrain", tmp_path)
    assert cli("convert", str(run))[0] == 0
    old = storage.safe_load(next((run / storage.CHECKPOINTS / storage.MOVED_ASIDE).glob("step_00000002-*")) / "resume.pth")
    config = launch.storage_manifest(run, 2)["config"]

    def leaves(tree: dict, prefix: str = ""):
        for k, v in tree.items():
            yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    new = dict(leaves(config))
    assert all(new[k] == v for k, v in leaves(old["config"]))
    assert (new["train.objective"], new["train.lora.rank"], new["train.compile"], new["model.qk_norm"], new["model.moe.experts"]) == \
        ("next_token", 0, False, False, 0)


def states_for_resume(run: Path) -> tuple[CheckpointManager, dict]:
    """A manager of `run` that checks nothing of the record (what it loads is the question) and the states it fills."""
    config = yaml.safe_load((FIXTURES / "pretrain" / "config.yaml").read_text())
    config, _ = conv.completed(config)
    states, _, _ = conv.states_of(config)
    meta = RunMeta(world_size=1, global_batch=4, micro_batch=2, accum=2, threads=1, reduce="ddp")
    from runtime import Runtime

    return CheckpointManager(CheckpointConfig(), run, Runtime(), meta), states


def tree(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}


class Killed(BaseException):
    """What a kill does to the conversion: nothing after the point runs (not a cleanup, not a finally of ours)."""


def kill_at(monkeypatch, nth: int) -> list[str]:
    """Stop the next conversion at the nth point of its sequence it reaches (0-based); returns the points reached."""
    reached: list[str] = []

    def point(name: str) -> None:
        reached.append(name)
        if len(reached) == nth + 1:
            raise Killed(name)

    monkeypatch.setattr(conv, "_reached", point)
    return reached


@pytest.fixture(scope="module")
def converted_shas(tmp_path_factory) -> dict[int, str]:
    """model_sha256 of each step of the pretraining fixture converted without interruption."""
    run = old_run("pretrain", tmp_path_factory.mktemp("converted"))
    conv.convert(run)
    return {step: storage.verify(folder)["model_sha256"] for step, folder in storage.list_checkpoints(run / storage.CHECKPOINTS)}


@pytest.mark.parametrize("nth", range(2 * len(POINTS)))
def test_a_conversion_killed_at_any_step_is_finished_by_the_rerun_and_no_resume_meanwhile_loads_an_older_step(
        nth, tmp_path, monkeypatch, converted_shas):
    run = old_run("pretrain", tmp_path)
    reached = kill_at(monkeypatch, nth)
    with pytest.raises(Killed):
        conv.convert(run)
    assert len(reached) == nth + 1
    monkeypatch.setattr(conv, "_reached", lambda name: None)
    before = tree(run)
    manager, states = states_for_resume(run)
    try:
        resumed = manager.load(states)
    except storage.CheckpointError:  # refused: the journal, or no checkpoint of this layout yet
        resumed = None
    else:
        assert resumed is not None and resumed.step == 2, f"killed after {reached[-1]}: a resume loaded {resumed}"
    finally:
        manager.close()
    assert tree(run) == before  # the resume deleted nothing (the converted copy least of all)

    assert conv.convert(run) == 0
    root = run / storage.CHECKPOINTS
    found = {step: storage.verify(folder)["model_sha256"] for step, folder in storage.list_checkpoints(root)}
    assert found == converted_shas  # both steps, in this layout, the weights of an uninterrupted conversion
    assert not (root / CONVERT_JOURNAL).exists() and not (root / conv.STAGING).exists()
    aside = sorted(p.name.split("-")[0] for p in (root / storage.MOVED_ASIDE).iterdir())
    assert aside == ["step_00000001", "step_00000002"]  # each old folder kept whole
    for p in (root / storage.MOVED_ASIDE).iterdir():
        conv.read_old(p)  # every file there, its sha256 its manifest's


def test_a_resume_is_refused_while_a_conversion_journal_is_there_even_with_no_other_checkpoint(tmp_path, monkeypatch):
    run = old_run("pretrain", tmp_path)
    shutil.rmtree(run / storage.CHECKPOINTS / "step_00000001")
    kill_at(monkeypatch, POINTS.index("aside"))  # the old folder moved away, the new one not yet renamed in
    with pytest.raises(Killed):
        conv.convert(run)
    before = tree(run)
    manager, states = states_for_resume(run)
    try:
        with pytest.raises(storage.CheckpointMismatch, match=f"{CONVERT_JOURNAL}.*interrupted.*python -m checkpoint convert {run}"):
            manager.load(states)  # not a fresh start over the run
    finally:
        manager.close()
    assert tree(run) == before


def test_convert_refuses_a_path_that_is_not_a_run_folder_naming_it_with_exit_2(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "file", tmp_path / "empty"):
        code, out, err = cli("convert", str(path))
        assert code == exit_code("bad_input") == 2
        assert f"error: {path}: neither a run folder" in err and "Traceback" not in err


def test_convert_of_a_run_folder_without_checkpoints_says_there_is_nothing_to_convert_with_exit_2(tmp_path):
    (tmp_path / storage.CHECKPOINTS).mkdir()
    code, out, err = cli("convert", str(tmp_path))
    assert code == exit_code("bad_input")
    assert f"{tmp_path}: no checkpoint in {tmp_path / storage.CHECKPOINTS}; nothing to convert" in err


def test_converting_again_says_nothing_to_convert_with_exit_0_and_changes_nothing(tmp_path):
    run = old_run("pretrain", tmp_path)
    assert cli("convert", str(run))[0] == 0
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    code, out, err = cli("convert", str(run))
    assert code == exit_code("finished") == 0
    assert "no checkpoint of the earlier layout; nothing to convert" in out
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_a_damaged_file_of_the_old_layout_is_named_and_nothing_changes(tmp_path):
    run = old_run("pretrain", tmp_path)
    pth = run / storage.CHECKPOINTS / "step_00000002" / "resume.pth"
    data = bytearray(pth.read_bytes())
    data[-100] ^= 1
    pth.write_bytes(bytes(data))
    before = tree(run)
    code, out, err = cli("convert", str(run))
    assert code != 0 and f"{pth}: does not match its manifest (damaged); not converted" in err and "Traceback" not in err
    assert tree(run) == before  # no journal written, the old folder where it was


def test_a_rerun_rebuilds_the_new_checkpoint_from_the_folder_moved_aside_when_the_staged_one_is_gone(tmp_path, monkeypatch,
                                                                                                     converted_shas):
    run = old_run("pretrain", tmp_path)
    kill_at(monkeypatch, POINTS.index("aside"))
    with pytest.raises(Killed):
        conv.convert(run)
    monkeypatch.setattr(conv, "_reached", lambda name: None)
    root = run / storage.CHECKPOINTS
    shutil.rmtree(root / conv.STAGING)  # lost (a user's clean-up): the journal still says where the old folder went
    code, out, err = cli("convert", str(run))
    assert code == 0, err
    assert f"finished the interrupted conversion of {root / 'step_00000002'}" in out
    assert {step: storage.verify(f)["model_sha256"] for step, f in storage.list_checkpoints(root)} == converted_shas
