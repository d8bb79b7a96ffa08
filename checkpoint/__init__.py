"""Checkpoints: atomic publish, manifest and hashes, safe load (storage.py), the manager (manager.py),
the run folder's layout, lock and status (runfolder.py), the stop protocol (stop.py), per-rank RNG
state (rng.py). A leaf: it imports nothing of this repository outside itself (__main__.py aside)."""
from .config import CheckpointConfig
from .manager import CheckpointManager, Collectives, Resumed, RunMeta, new_run_id
from .stop import EXIT_STOPPED, StopFlag
from .storage import CheckpointError, CheckpointMismatch, find_checkpoint, model_sha256, safe_load, verify

__all__ = [
    "EXIT_STOPPED", "CheckpointConfig", "CheckpointError", "CheckpointManager", "CheckpointMismatch", "Collectives",
    "Resumed", "RunMeta", "StopFlag", "find_checkpoint", "model_sha256", "new_run_id", "safe_load", "verify",
]
