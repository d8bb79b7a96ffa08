"""train.py on a slow file system for packing: each batch the packer reads takes SLOW_PACK_S seconds
(default 4) longer, as a corpus on a busy network file system does, without using the CPU. Test
double for tests/test_corpora.py (a pack longer than dist.timeout_s); the trainer has no such switch."""
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data import prepare  # noqa: E402

_batches = prepare.batches


def _slow_batches(reader, batch_bytes):
    for batch in _batches(reader, batch_bytes):
        time.sleep(float(os.environ.get("SLOW_PACK_S", "4")))
        yield batch


prepare.batches = _slow_batches
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
