"""The checkpoint package's own settings (the `checkpoint.*` keys), as `model/` owns ModelConfig."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.store import is_url, parse


@dataclass
class CheckpointConfig:
    interval: int = 50
    """Save every N optimizer steps (0: only at the end, at train.halt_at and on a stop signal)."""
    keep: int = 3
    """Newest valid checkpoints kept (at least 2); older ones are pruned after a new one is published."""
    async_: bool = field(default=False, metadata={"key": "async"})
    """Serialize, hash and publish in a background thread after a copy to CPU memory."""
    resume: str = "auto"
    """auto (newest valid checkpoint in out_dir; none there: a fresh start) | never (a fresh start;
    an error if out_dir holds checkpoints) | a checkpoint folder."""
    lock_timeout_s: float = 120.0
    """How long a launch waits for another run holding out_dir (e.g. one finishing its final save)
    before it refuses (exit 2)."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval: expected a non-negative number, got {self.interval}")
        if self.lock_timeout_s < 0:
            raise ValueError(f"checkpoint.lock_timeout_s: expected a non-negative number, got {self.lock_timeout_s}")
        if self.keep < 2:
            raise ValueError(f"checkpoint.keep: expected at least 2, got {self.keep}")
        if self.resume not in ("auto", "never") and is_url(self.resume):
            try:
                parse(self.resume, "checkpoint.resume")  # a step folder in the store: its form here, the rest at the load
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 - StoreRefused: bad input, said as the other keys' errors are
                raise ValueError(str(e)) from None
        elif self.resume not in ("auto", "never"):
            # Checked here, before data preparation and before anything is written to out_dir.
            path = Path(self.resume)
            if not path.exists():
                raise ValueError(f"checkpoint.resume: {path} does not exist (expected auto, never, or a checkpoint folder)")
            if not path.is_dir():
                raise ValueError(f"checkpoint.resume: {path} is a file (expected auto, never, or a checkpoint folder "
                                 "such as OUT/checkpoints/step_00000060)")
