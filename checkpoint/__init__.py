"""Checkpoints: saving, loading, verifying and the format. One format for every strategy (DCP,
format.py), atomic publishing, the manifest, verification and discovery (storage.py), the manager
behind the loop's two calls (manager.py), the states of a module, an optimizer and the generators
(states.py). It imports nothing of this repository but the shared room (common/)."""
from .config import CheckpointConfig
from .manager import CheckpointManager, Collectives, Resumed, RunMeta, half_weights, new_run_id
from .states import ModelState, OptimizerState
from .storage import CheckpointError, CheckpointMismatch, find_checkpoint, model_sha256, safe_load, verify

__all__ = [
    "CheckpointConfig", "CheckpointError", "CheckpointManager", "CheckpointMismatch", "Collectives", "ModelState",
    "OptimizerState", "Resumed", "RunMeta", "find_checkpoint", "half_weights", "model_sha256", "new_run_id", "safe_load", "verify",
]
