"""Checkpoints: atomic publish, manifest and hashes, safe load, the manager, the stop protocol."""
from .io import CheckpointError, CheckpointMismatch, model_sha256, safe_load, verify
from .manager import CheckpointManager, Resumed, TrainState, new_run_id
from .stop import EXIT_STOPPED, StopFlag

__all__ = [
    "EXIT_STOPPED", "CheckpointError", "CheckpointMismatch", "CheckpointManager", "Resumed", "StopFlag", "TrainState",
    "model_sha256", "new_run_id", "safe_load", "verify",
]
