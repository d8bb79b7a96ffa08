"""The state files' byte layout (checkpoint/format.py, docs/design.md "One save path"): a run written
in format 2 (tests/fixtures/format2/) still loads and resumes to the uninterrupted run's bits."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

import launch
from checkpoint import storage

pytestmark = pytest.mark.unit

FORMAT2 = launch.ROOT / "tests" / "fixtures" / "format2" / "pretrain"
CORPUS = launch.ROOT / "tests" / "fixtures" / "prev_release" / "corpus.jsonl"


def overrides(out: Path, cache: Path) -> list[str]:
    """The fixture run's recorded config as command-line keys, on this test's folders, run to its end."""
    flat: dict = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(yaml.safe_load((FORMAT2 / "config.yaml").read_text()), "")
    flat.update({"out_dir": str(out), "data.cache_dir": str(cache), "data.path": str(CORPUS), "train.halt_at": 0})
    return [f"{k}={v}" for k, v in flat.items()]


def test_a_run_written_in_format_2_resumes_to_the_uninterrupted_runs_bits(tmp_path):
    run = tmp_path / "format2"
    shutil.copytree(FORMAT2, run)
    newest = run / storage.CHECKPOINTS / storage.step_dir_name(2)
    assert storage.verify(newest)["format"] == 2  # the fixture is what it says
    code, err = launch.in_process(*overrides(run, tmp_path / "cache"))
    assert code == 0, err
    ref = tmp_path / "reference"
    code, err = launch.in_process(*overrides(ref, tmp_path / "cache"))
    assert code == 0, err
    launch.assert_identical(run, ref)  # every logged loss (steps 1-2 format 2's) and the final identity
    assert [m["loss"] for m in launch.metrics(run)][:2] == [m["loss"] for m in launch.metrics(FORMAT2)]
