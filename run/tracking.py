"""Curves to watch: TensorBoard or Weights & Biases, on global rank 0 only (`log.tracker`).

Both resume like `metrics.jsonl` (docs/design.md I15): TensorBoard purges every step past the
checkpoint the run resumed from, or every step on a fresh start (the writer's `purge_step`), W&B
continues the run whose id is the checkpoint's `run_id` (rewound where the W&B server allows it;
a warning says when it cannot be). A tracker that is not installed, cannot start or fails mid-run never stops
training: one warning, then it is off, and `metrics.jsonl` goes on.
"""
from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

log = logging.getLogger("minimind")
TAGS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "val_loss": "val/loss"}


class Tracker:
    """The interface, and the tracker of `log.tracker=none`."""

    name = "none"

    def log(self, step: int, values: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, out_dir: Path, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # purge_step: events at or past it, left by a run killed after its last checkpoint (or before
        # its first: a fresh start purges from step 1), are dropped
        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=resumed_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(TAGS.get(key, key), value, step)

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    name = "wandb"

    def __init__(self, out_dir: Path, project: str, run_id: str, resumed_step: int, config: dict) -> None:
        import wandb

        kwargs = dict(project=project, id=run_id, dir=str(out_dir), config=config)
        self.run = None
        can_rewind = "resume_from" in inspect.signature(wandb.init).parameters and \
            os.environ.get("WANDB_MODE", "online") not in ("offline", "dryrun", "disabled")
        if resumed_step and not can_rewind:
            log.warning("wandb: run %s cannot be rewound to step %d here (offline mode or a client without resume_from): "
                        "steps a killed run logged past it stay in its W&B history; metrics.jsonl and TensorBoard hold "
                        "each step once", run_id, resumed_step)
        if resumed_step and can_rewind:
            # Rewind the W&B run to the checkpoint's step, so that steps logged after it by a killed
            # run are replaced (a W&B server feature; refused where it is not enabled).
            try:
                self.run = wandb.init(resume_from=f"{run_id}?_step={resumed_step}", **kwargs)
            except Exception as e:  # noqa: BLE001 - fall back to resume="allow" below
                log.warning("wandb: rewinding run %s to step %d failed (%s); resuming it instead", run_id, resumed_step, e)
        if self.run is None:
            self.run = wandb.init(resume="allow", **kwargs)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({TAGS.get(key, key): value for key, value in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class Guarded(Tracker):
    """Any tracker, made harmless: its first failure is one warning, and it is off from then on."""

    def __init__(self, inner: Tracker) -> None:
        self.inner, self.name = inner, inner.name

    def _call(self, what: str, *args) -> None:
        if self.inner is None:
            return
        try:
            getattr(self.inner, what)(*args)
        except Exception as e:  # noqa: BLE001 - watching must never stop training
            log.warning("log.tracker=%s failed in %s (%s: %s); it is off for the rest of this run, metrics.jsonl goes on",
                        self.name, what, type(e).__name__, e)
            self.inner = None

    def log(self, step: int, values: dict[str, float]) -> None:
        self._call("log", step, values)

    def close(self) -> None:
        self._call("close")


def open_tracker(kind: str, out_dir: Path, project: str, run_id: str, resumed_step: int, config: dict) -> Tracker:
    """The tracker `log.tracker` names, on global rank 0; `Tracker()` (nothing) if it cannot start."""
    if kind == "none":
        return Tracker()
    try:
        inner = TensorBoard(out_dir, resumed_step) if kind == "tensorboard" else WandB(out_dir, project, run_id, resumed_step, config)
    except Exception as e:  # noqa: BLE001 - not installed, no permission, no network: train on
        log.warning("log.tracker=%s could not start (%s: %s); training goes on, metrics.jsonl has every step",
                    kind, type(e).__name__, e)
        return Tracker()
    log.info("log.tracker=%s: run %s%s", kind, run_id, f", resumed at step {resumed_step}" if resumed_step else "")
    return Guarded(inner)
