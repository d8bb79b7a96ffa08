"""Each rank's micro-batches, optimizer step by optimizer step, from any step of any epoch on
(docs/design.md I4): a fresh loader per epoch over `sampler.set_epoch(epoch)`, with a
SkipBatchSampler that skips what this rank's stream already consumed, `step_in_epoch * accum`."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from .mix import MixDataset, MixSampler
from .sampler import BatchPlan, BlockDistributedSampler, SkipBatchSampler

log = logging.getLogger("minimind")


def make_sampler(dataset, plan: BatchPlan, rt, seed: int, order: str, train_state, where: tuple[int, int]):
    """The run's batch sampler: the corpus's (data/sampler.py), or a mix's (data/mix.py), which
    continues from the resumed counts (and says so when the mix changed: a new phase). `where` is
    (epoch, step in epoch) where the loop continues."""
    if not isinstance(dataset, MixDataset):
        return BlockDistributedSampler(len(dataset), plan, rt.rank, seed, order)
    dataset.order.g = plan.global_batch
    phase = dataset.start(train_state.step)
    if phase and rt.is_main:
        log.warning("%s", phase)
    return MixSampler(dataset, plan, rt.rank, train_state.step, *where)


def step_batches(dataset, sampler: BlockDistributedSampler, epoch: int, first: int, num_workers: int, seed: int,
                 pin_memory: bool = False, worker_init_fn=None) -> Iterator[tuple[int, int, list]]:
    """(epoch, step_in_epoch, this rank's micro-batches) for every optimizer step from step `first`
    of `epoch` on. `worker_init_fn` runs in each DataLoader worker (the trainer's: ignore stop signals,
    so that a SIGTERM to the process group reaches the trainer's flag, not the workers mid-batch)."""
    plan, spe = sampler.plan, sampler.plan.steps_per_epoch(len(dataset))
    while True:
        sampler.set_epoch(epoch)  # before the loader's iterator exists, so workers prefetch this epoch
        loader = DataLoader(dataset, batch_sampler=SkipBatchSampler(sampler, first * plan.accum), num_workers=num_workers,
                            pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed + epoch),
                            worker_init_fn=worker_init_fn if num_workers else None)
        it = iter(loader)
        for s in range(first, spe):
            yield epoch, s, [next(it) for _ in range(plan.accum)]
        epoch, first = epoch + 1, 0
