"""Where the run is: optimizer steps done and the data position (docs/design.md I2, I5)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TrainState:
    """Optimizer steps done (the LR is a function of it, I5), and the data position: the epoch of
    the last step and the samples of that epoch consumed so far, which is what a resume continues
    the data from. `metrics.jsonl` logs the same two after each step."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.samples_seen = int(state["step"]), int(state["epoch"]), int(state["samples_seen"])

    def position(self, global_batch: int, steps_per_epoch: int) -> tuple[int, int]:
        """(epoch, step in that epoch) where the data continues: a finished epoch continues at the next."""
        done = self.samples_seen // global_batch
        return (self.epoch + 1, 0) if done >= steps_per_epoch else (self.epoch, done)
