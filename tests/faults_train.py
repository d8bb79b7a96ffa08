"""train.py with one failure injected on one rank (FAULT_RANK, default 0), chosen by FAULT: what the
failure protocol must carry to every other rank (tests/test_protocol.py). The trainer has no such
switch.

    FAULT=tokenizer     the packer's tokenizer raises an exception of its own type (RuntimeError)
    FAULT=metrics       appending the metrics line of step 3 finds the disk full (OSError ENOSPC)
    FAULT=setup         set-up raises on this rank (a bug: RuntimeError) while rank 0 packs, slowly
    FAULT=background    this rank's background write of a checkpoint fails (OSError EIO), step 4
"""
import errno
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAULT, HERE = os.environ["FAULT"], int(os.environ.get("RANK", "0")) == int(os.environ.get("FAULT_RANK", "0"))

if FAULT == "tokenizer" and HERE:
    from data.tokenizer import ByteTokenizer

    def _exploding(self, texts):
        raise RuntimeError("the tokenizer's own failure (injected)")

    ByteTokenizer.pack_batch = _exploding
elif FAULT == "metrics" and HERE:
    from run.metrics import Metrics

    _step = Metrics.step

    def _disk_full(self, record, seconds, *args):
        if record["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")
        return _step(self, record, seconds, *args)

    Metrics.step = _disk_full
elif FAULT == "setup":
    import runtime.board
    from data import prepare

    if HERE:  # while it waits for rank 0's packer, after the collective that starts the packing
        def _failing_wait(*args, **kwargs):
            time.sleep(1)
            raise RuntimeError("this rank's set-up failed (injected)")

        runtime.board.wait_for = _failing_wait  # the packing hand-off's wait (runtime.board.hand_off)
    _batches = prepare.batches

    def _slow_batches(reader, batch_bytes):
        for batch in _batches(reader, batch_bytes):
            time.sleep(30)
            yield batch

    prepare.batches = _slow_batches
elif FAULT == "background" and HERE:
    from checkpoint import format

    _write_items = format._write_items

    def _failing(path, relative, items, planner):
        if "step_00000004" in str(path):
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))
        return _write_items(path, relative, items, planner)

    format._write_items = _failing

sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
