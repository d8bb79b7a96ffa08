"""train.py with a slow precompute: each row of a precomputed table (DPO's reference, distillation's
top-k) takes SLOW_TABLE_S seconds (default 0.2) longer, as a large reference on a slow device does.
Test double for tests/test_tables.py (a SIGTERM inside the precompute); the trainer has no such switch."""
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from objectives import tables  # noqa: E402

_precompute = tables.precompute


def _slow_precompute(files, needed, compute, *args, **kwargs):
    def slowly(row):
        time.sleep(float(os.environ.get("SLOW_TABLE_S", "0.2")))
        return compute(row)

    return _precompute(files, needed, slowly, *args, **kwargs)


tables.precompute = _slow_precompute
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
