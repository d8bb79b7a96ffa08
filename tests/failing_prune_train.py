"""train.py whose pruning fails on rank 0 after a checkpoint is published (an OSError, as an NFS
hiccup gives): a failure on one rank alone, which every rank must hear of at once. Test double for
tests/test_checkpoint_safety.py; the trainer has no such switch."""
import errno
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import storage  # noqa: E402


def _failing_prune(root, keep, owned, later=None):
    raise OSError(errno.EIO, "Input/output error (injected)", str(root))


storage.prune = _failing_prune
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
