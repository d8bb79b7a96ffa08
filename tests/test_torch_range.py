"""The supported torch range (common/versions.py, docs/gpus.md): a launch on a torch outside it stops
with one line, and the multi-process exact-resume promises hold on the oldest torch of the range as
on the pinned one. The oldest lives in .venv/torch-oldest (scripts/env.sh's ensure_oldest_torch,
requirements-torch-oldest.txt), which scripts/test.sh makes under CI=true: there its absence fails
these tests; elsewhere they skip, naming how to make it (MINIMIND_OLDEST_TORCH=1 bash scripts/test.sh)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launch
from common import versions

OLDEST_PY = Path(os.environ.get("MINIMIND_OLDEST_PYTHON") or launch.ROOT / ".venv" / "torch-oldest" / "bin" / "python")
"""The oldest torch's python (MINIMIND_OLDEST_PYTHON: another, as scripts/mutants.py's copy of the repository passes)."""
CI = os.environ.get("CI") == "true"
needs_oldest = pytest.mark.skipif(not OLDEST_PY.exists() and not CI,
                                  reason=f"no oldest torch at {OLDEST_PY} (MINIMIND_OLDEST_TORCH=1 bash scripts/test.sh makes it)")


@pytest.mark.unit
def test_the_range_is_the_same_in_the_code_the_requirements_and_the_readme():
    pinned = re.search(r"^torch==(\d+\.\d+)", (launch.ROOT / "requirements.txt").read_text(), re.M).group(1)
    oldest = re.search(r"^torch==(\d+\.\d+)", (launch.ROOT / "requirements-torch-oldest.txt").read_text(), re.M).group(1)
    assert versions.refusal(pinned + ".0") is None and versions.parse(oldest) == versions.OLDEST
    assert versions.refusal(f"{versions.OLDEST[0]}.{versions.OLDEST[1] - 1}.1") is not None
    assert versions.refusal(f"{versions.NEWEST[0]}.{versions.NEWEST[1] + 1}.0") is not None
    assert versions.refusal(f"{versions.NEWEST[0]}.{versions.NEWEST[1]}.3+cu130") is None
    assert versions.refusal("2.11.0+cu130") is None  # the GPU image's torch (docs/gpus.md)
    for doc in ("requirements.txt", "README.md", "docs/gpus.md"):
        assert versions.supported() in (launch.ROOT / doc).read_text(), f"{doc} does not state the range as {versions.supported()}"


@pytest.mark.e2e
@pytest.mark.parametrize("version", ["2.9.1", "2.16.0"])
def test_a_launch_on_a_torch_outside_the_range_stops_before_any_work_with_one_line_and_exit_2(tmp_path, tiny, version):
    """The installed torch reports another version (set before train.py runs, as a wheel would): one
    line names it and the range, exit 2, no traceback, nothing written."""
    code = (f"import sys, runpy, torch; torch.__version__ = {version!r}; sys.argv = ['train.py', *sys.argv[1:]]; "
            f"runpy.run_path('train.py', run_name='__main__')")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", code, *tiny, f"out_dir={out}"], cwd=launch.ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: torch {version} is installed; this trainer supports {versions.supported()} "
                                                "(requirements.txt pins one of them)"]
    assert not out.exists()


def oldest(tmp_path, name: str, nproc: int, *args: str) -> None:
    assert OLDEST_PY.exists(), f"CI=true needs the oldest torch at {OLDEST_PY} (scripts/test.sh makes it under CI=true)"
    launch.run(nproc, *args, f"out_dir={tmp_path / name}", python=str(OLDEST_PY))


@needs_oldest
@pytest.mark.e2e
@pytest.mark.parametrize("strategy, reduce, first, then", [("ddp", "canonical", 2, 3), ("fsdp", "canonical", 2, 3), ("ddp", "ddp", 2, 2)])
def test_on_the_oldest_torch_a_run_halted_and_resumed_on_several_processes_is_the_uninterrupted_run(tmp_path, tiny, strategy, reduce,
                                                                                                     first, then):
    """On the oldest supported torch: dist.reduce=canonical under DDP and FSDP2, halted on 2 processes
    and resumed on 3, against the run on 1; and dist.reduce=ddp (DistributedDataParallel itself: the
    wrapper that crashed on torch 2.11 with a keyword of 2.13's) halted and resumed on 2 against 2
    throughout. Every loss and the weights' sha256 equal."""
    version = subprocess.run([str(OLDEST_PY), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    assert versions.parse(version) == versions.OLDEST, version
    args = [*tiny, f"dist.reduce={reduce}", f"dist.strategy={strategy}", "train.global_batch=12", "train.micro_batch=2", "train.steps=6"]
    oldest(tmp_path, "ref", 1 if reduce == "canonical" else then, *args)
    oldest(tmp_path, "moved", first, *args, "train.halt_at=3")
    oldest(tmp_path, "moved", then, *args)
    launch.assert_identical(tmp_path / "moved", tmp_path / "ref")
