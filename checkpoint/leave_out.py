"""The resume lab's ablations: resume with one piece of state deliberately left out.

Used only when `lab.leave_out` is set (scripts/resume_lab.py); each function undoes exactly one
thing that `CheckpointManager.load` restored, so the lab measures it through the real trainer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import io
from .manager import Resumed, TrainState

log = logging.getLogger("minimind")


@dataclass
class Plan:
    """Where the resumed loop starts: its step counter, the data position and the LR's origin."""

    start: int
    data_start: int
    lr_origin: int = 0


def states_to_load(states: dict, leave_out: str) -> dict:
    """The optimizer ablation: a fresh AdamW, as if only the weights had been saved."""
    return {k: v for k, v in states.items() if not (leave_out == "optimizer" and k == "optimizer")}


def apply(leave_out: str, resumed: Resumed | None, model: torch.nn.Module, train: TrainState,
          steps_per_epoch: int, world_size: int) -> Plan:
    start = train.step
    if resumed is None or leave_out in ("none", "optimizer"):
        return Plan(start, start)
    log.warning("lab.leave_out=%s: this resume is deliberately NOT exact", leave_out)
    if leave_out == "data_position":
        # The batch order rewound to the start of the epoch: what a loader without a skip does.
        return Plan(start, start - start % steps_per_epoch)
    if leave_out == "fp16_weights":
        # MiniMind's resume file holds half-precision weights: round them, keep everything else.
        weights = io.safe_load(resumed.path / io.WEIGHTS_FILE)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        return Plan(start, start)
    if leave_out == "lr_schedule":
        return Plan(start, start, lr_origin=start)
    if leave_out == "minimind_world_size_rule":
        # MiniMind rescales its step counter by old // new world size, which is right when the
        # per-GPU batch is fixed; here the global batch is fixed, so the counter needs no rescale.
        rescaled = start * resumed.world_size // world_size
        log.warning("MiniMind's rule: step %d x %d // %d = %d", start, resumed.world_size, world_size, rescaled)
        train.step = rescaled
        return Plan(rescaled, rescaled)
    raise ValueError(f"lab.leave_out={leave_out}")
