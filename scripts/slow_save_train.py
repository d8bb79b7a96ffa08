"""train.py on a slow disk: every checkpoint file takes SLOW_SAVE_S seconds (default 1) longer to
write, which opens a window to kill a run inside a save. For preemption drills and tests only
(`scripts/preempt.sh --during-save`, tests/); the trainer itself has no such switch. With
SLOW_SAVE_FIRST_JOB_ONLY=1 only a Slurm job's first run is slowed (tests/test_slurm.py). With
SLOW_SAVE_UNTIL=PATH every file waits instead until PATH exists (at most 300 s): a test opens that
gate once what it needs to see inside the save has happened, however loaded the machine is.

    SLOW_SAVE_S=1 torchrun --standalone --nproc_per_node=2 scripts/slow_save_train.py [train.py arguments]
"""
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import format, storage  # noqa: E402

_write_file = storage.write_file


def _slow_write_file(path, obj, *rest):
    entry = _write_file(path, obj, *rest)
    # SLOW_SAVE_FIRST_JOB_ONLY=1: slow only in a Slurm job's first run (SLURM_RESTART_COUNT unset)
    if not (os.environ.get("SLOW_SAVE_FIRST_JOB_ONLY") and os.environ.get("SLURM_RESTART_COUNT")):
        gate = os.environ.get("SLOW_SAVE_UNTIL")
        if gate:
            end = time.monotonic() + 300
            while not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.05)
        else:
            time.sleep(float(os.environ.get("SLOW_SAVE_S", "1")))
    return entry


storage.write_file = format.write_file = _slow_write_file  # the manifest, the fp16 weights, DCP's .metadata
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
