"""Signed checkpoints (checkpoint/storage.py: sign, check_mac; docs/run_folder.md, "Signed checkpoints"): with
a key in MINIMIND_CHECKPOINT_KEY every manifest carries an HMAC-SHA256 of its content, and a manifest
without a valid one is not loaded (a run falls back naming it, a tool exits 1); without a key nothing changes;
the key is never written or logged."""
from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest

import launch
from checkpoint import storage
from run import folder as runfolder
from test_checkpoint_manager import manager, run_steps, states

KEY = "correct horse battery staple 59"


def edit(run: Path, step: int, change) -> Path:
    """Rewrite checkpoint `step`'s manifest with `change(body)` applied (its files untouched: they still verify)."""
    path = run / runfolder.CHECKPOINTS / storage.step_dir_name(step) / storage.MANIFEST
    body = json.loads(path.read_text())
    change(body)
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return path


@pytest.mark.unit
@pytest.mark.parametrize("how", ["a field edited", "its MAC removed", "signed with another key"])
def test_with_the_key_set_a_manifest_without_its_valid_mac_is_named_and_the_run_falls_back(tmp_path, monkeypatch, caplog, how):
    monkeypatch.setenv(storage.KEY_VARIABLE, KEY)
    run_steps(manager(tmp_path, interval=1, keep=5), states(), 2)
    body = json.loads((tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(2) / storage.MANIFEST).read_text())
    assert body[storage.MAC].startswith("hmac-sha256:") and len(body[storage.MAC]) == len("hmac-sha256:") + 64
    changes = {"a field edited": lambda b: b.update(world_size=2),
               "its MAC removed": lambda b: b.pop(storage.MAC),
               "signed with another key": lambda b: b.update({storage.MAC: storage.mac_of(b, b"another key")})}
    path = edit(tmp_path, 2, changes[how])
    st = states()
    with caplog.at_level(logging.WARNING, logger="minimind"):
        resumed = manager(tmp_path).load(st)
    assert resumed.step == 1 and st["counter"].value == 10
    assert "skipping checkpoint" in caplog.text and f"{path}: " in caplog.text and storage.KEY_VARIABLE in caplog.text
    assert ("carries no MAC" if how == "its MAC removed" else "not its content's under this key") in caplog.text
    assert KEY not in caplog.text
    monkeypatch.delenv(storage.KEY_VARIABLE)  # without a key nothing is checked: the edited manifest loads as before
    assert manager(tmp_path).load(states()).step == 2


@pytest.mark.unit
def test_without_a_key_nothing_is_signed_and_with_one_an_unsigned_run_folder_does_not_resume(tmp_path, monkeypatch):
    monkeypatch.delenv(storage.KEY_VARIABLE, raising=False)
    run_steps(manager(tmp_path, interval=1, keep=5), states(), 2)
    body = json.loads((tmp_path / runfolder.CHECKPOINTS / storage.step_dir_name(2) / storage.MANIFEST).read_text())
    assert storage.MAC not in body
    monkeypatch.setenv(storage.KEY_VARIABLE, KEY)
    with pytest.raises(storage.CheckpointError, match="no checkpoint verifies") as e:  # not a fresh start over them either
        manager(tmp_path).load(states())
    assert "carries no MAC" in str(e.value) and "step_00000002" in str(e.value) and "step_00000001" in str(e.value)


@pytest.mark.unit
def test_a_tool_exits_1_naming_a_manifest_without_its_valid_mac_while_the_key_is_set(tmp_path, monkeypatch):
    from cli import main

    monkeypatch.setenv(storage.KEY_VARIABLE, KEY)
    run_steps(manager(tmp_path, interval=1, keep=5), states(), 1)
    path = edit(tmp_path, 1, lambda b: b.update(world_size=2))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["inspect", str(path.parent)])
    assert code == 1 and f"{path}: has a MAC that is not its content's" in err.getvalue() and KEY not in err.getvalue(), err.getvalue()


@pytest.mark.e2e
def test_a_signed_run_resumes_exactly_never_writes_or_logs_its_key_and_falls_back_over_an_edited_manifest(tmp_path, monkeypatch):
    args = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=64", "train.global_batch=4",
            "train.micro_batch=2", "train.warmup_steps=1", "checkpoint.interval=1", "checkpoint.keep=10", "log.progress=false",
            "runtime.threads=1", f"data.cache_dir={tmp_path / 'cache'}"]
    code, _ = launch.in_process(*args, "train.steps=4", f"out_dir={tmp_path / 'ref'}")
    assert code == 0
    monkeypatch.setenv(storage.KEY_VARIABLE, KEY)
    code, first = launch.in_process(*args, "train.steps=4", "train.halt_at=3", f"out_dir={tmp_path / 'run'}")
    assert code == 0, first[-3000:]
    edit(tmp_path / "run", 3, lambda b: b.update(samples_seen=0))  # someone who can write the run folder, without the key
    code, second = launch.in_process(*args, "train.steps=4", f"out_dir={tmp_path / 'run'}")
    assert code == 0, second[-3000:]
    assert "skipping checkpoint" in second and "step_00000003" in second and "loaded" in second and "step_00000002" in second
    assert launch.inspect(tmp_path / "run")["signed"] is True
    monkeypatch.delenv(storage.KEY_VARIABLE)  # the reference run is unsigned: read without the key
    launch.assert_identical(tmp_path / "run", tmp_path / "ref")  # resumed from step 2: the same bits
    for text in (first, second, *(p.read_bytes().decode("latin-1") for p in (tmp_path / "run").rglob("*") if p.is_file())):
        assert KEY not in text
