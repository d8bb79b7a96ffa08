"""train.py on a slow disk: every checkpoint file takes SLOW_SAVE_S seconds (default 1) longer to
write, which opens a window to kill a run inside a save. For preemption drills and tests only
(`scripts/preempt.sh --during-save`, tests/); the trainer itself has no such switch.

    SLOW_SAVE_S=1 torchrun --standalone --nproc_per_node=2 scripts/slow_save_train.py [train.py arguments]
"""
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import storage  # noqa: E402

_write_file = storage._write_file


def _slow_write_file(path, obj, *rest):
    entry = _write_file(path, obj, *rest)
    time.sleep(float(os.environ.get("SLOW_SAVE_S", "1")))
    return entry


storage._write_file = _slow_write_file
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
