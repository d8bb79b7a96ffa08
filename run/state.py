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

    def resumed_from(self, world_size: int, micro_batch: int, plan, steps_per_epoch: int) -> tuple[str, str | None]:
        """The line that says where the data continues after a resume from a checkpoint written on
        `world_size` processes with `micro_batch`, and the world-size rescale that gets it there
        (docs/design.md I4); and a warning when the saved position is not where the step would be."""
        epoch, first = self.position(plan.global_batch, steps_per_epoch)
        where = (f"step {self.step} resumes at sample {first * plan.global_batch} of epoch {epoch}, skipping "
                 f"{first * plan.accum} micro-batches per rank")
        if world_size != plan.world_size or micro_batch != plan.micro_batch:
            where = f"world size {world_size} → {plan.world_size}, micro batch {micro_batch} → {plan.micro_batch}: {where}"
        odd = None
        if epoch * steps_per_epoch + first != self.step:
            odd = (f"the saved data position (epoch {self.epoch}, {self.samples_seen} samples in) is not where step {self.step} "
                   f"would be: the data continues from the saved position")
        return where, odd
