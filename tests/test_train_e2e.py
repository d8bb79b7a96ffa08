"""End-to-end: the two launch commands train, and bad input fails clearly."""
import json

import yaml

import pytest

import launch

pytestmark = pytest.mark.e2e


def test_torchrun_on_two_processes_trains_twenty_steps_and_the_loss_falls(reference):
    out = reference(2)
    rows = launch.metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 21))
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in rows)
    assert len(rows[0]["sample_ids"]) == 8
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["train"]["steps"] == 20 and cfg["model"]["dim"] == 32
    info = launch.inspect(out)
    assert info["step"] == 20 and info["world_size"] == 2 and info["accum"] == 2


def test_plain_python_runs_as_world_size_one(tmp_path, tiny):
    proc = launch.run(0, *tiny, "train.steps=4", f"out_dir={tmp_path}")
    assert "world size 1 (no process group" in proc.stderr
    assert "parameters" in proc.stderr and "unigram entropy" in proc.stderr
    assert [r["step"] for r in launch.metrics(tmp_path)] == [1, 2, 3, 4]
    assert launch.inspect(tmp_path)["world_size"] == 1


def test_a_bad_config_key_exits_non_zero_naming_the_key(tmp_path, tiny):
    proc = launch.run(0, *tiny, "train.stepz=4", f"out_dir={tmp_path}", expect=2)
    assert "unknown key 'train.stepz'" in proc.stderr
    proc = launch.run(0, "--config", str(tmp_path / "nope.yaml"), expect=2)
    assert "nope.yaml does not exist" in proc.stderr


def test_bad_data_exits_non_zero_naming_the_file_and_line(tmp_path, tiny):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + "{broken\n")
    proc = launch.run(0, *tiny, f"data.path={bad}", f"out_dir={tmp_path / 'run'}", expect=2)
    assert f"{bad}:2: line is not valid JSON" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_global_batch_that_does_not_divide_suggests_micro_batches_that_do(tmp_path, tiny):
    proc = launch.run(0, *tiny, "train.micro_batch=3", f"out_dir={tmp_path}", expect=2)
    assert "train.global_batch=8 is not divisible by train.micro_batch=3" in proc.stderr
    assert "1, 2, 4, 8" in proc.stderr
