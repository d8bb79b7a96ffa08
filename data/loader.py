"""Each rank's micro-batches, optimizer step by optimizer step, from any step of any epoch on
(docs/design.md I4): a fresh loader per epoch over `sampler.set_epoch(epoch)`, with a
SkipBatchSampler that skips what this rank's stream already consumed, `step_in_epoch * accum`."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from . import repack
from .mix import MixDataset, MixSampler
from .sampler import BatchPlan, BlockDistributedSampler, SkipBatchSampler

log = logging.getLogger("minimind")


def make_sampler(dataset, plan: BatchPlan, rt, seed: int, order: str, train_state, ckpt):
    """The run's batch sampler and (epoch, step in epoch) where the loop continues: the corpus's
    (data/sampler.py), a mix's (data/mix.py), which continues from the resumed counts (and says so when
    the mix changed: a new phase), or the corpus's with a repacked epoch (data/repack.py: a resume at
    another model.seq_len, or a run that had one). `ckpt` is the checkpoint manager, after its load."""
    resumed = ckpt.resumed
    record, line = repack.phase(resumed and resumed.data_fingerprint, ckpt.meta.data_fingerprint, train_state,
                                plan.global_batch, order, seed)
    spe = plan.steps_per_epoch(len(dataset))
    sampler = BlockDistributedSampler(len(dataset), plan, rt.rank, seed, order)
    if record and record["epoch"] >= train_state.epoch:
        rem = repack.remainder(dataset, record, order, seed)
        sampler = Phased(dataset, sampler, rem, BlockDistributedSampler(len(rem), plan, rt.rank, seed, order), record["epoch"])
        if train_state.epoch == record["epoch"]:
            spe = plan.steps_per_epoch(len(rem))
    where = train_state.position(plan.global_batch, spe)
    if resumed:
        said, odd = train_state.resumed_from(resumed.world_size, resumed.micro_batch, plan, spe)
        log.info("%s", said)
        if line and rt.is_main:
            log.warning("%s", line)
        elif odd and not record:  # a repacked epoch's steps are not the corpus's
            log.warning("%s", odd)
    if not isinstance(dataset, MixDataset):
        return sampler, where
    dataset.order.g = plan.global_batch
    phase = dataset.start(train_state.step)
    if phase and rt.is_main:
        log.warning("%s", phase)
    return MixSampler(dataset, plan, rt.rank, train_state.step, *where), where


class Phased:
    """The corpus's sampler, but epoch `epoch` reads the repacked remainder (data/repack.py): the
    sampler of the epoch last given to `set_epoch` answers."""

    def __init__(self, dataset, sampler: BlockDistributedSampler, rem, rem_sampler: BlockDistributedSampler, epoch: int) -> None:
        self.parts, self.epoch, self.plan = {False: (dataset, sampler), True: (rem, rem_sampler)}, epoch, sampler.plan
        self.current = sampler

    def dataset_of(self, epoch: int):
        return self.parts[epoch == self.epoch][0]

    def set_epoch(self, epoch: int) -> None:
        self.current = self.parts[epoch == self.epoch][1]
        self.current.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.current)

    def iter_from(self, skip: int):
        return self.current.iter_from(skip)

    def step_indices(self, step_in_epoch: int) -> list[int]:
        return self.current.step_indices(step_in_epoch)


def step_batches(dataset, sampler: BlockDistributedSampler, epoch: int, first: int, num_workers: int, seed: int,
                 pin_memory: bool = False, worker_init_fn=None) -> Iterator[tuple[int, int, list]]:
    """(epoch, step_in_epoch, this rank's micro-batches) for every optimizer step from step `first`
    of `epoch` on. `worker_init_fn` runs in each DataLoader worker (the trainer's: ignore stop signals,
    so that a SIGTERM to the process group reaches the trainer's flag, not the workers mid-batch)."""
    plan = sampler.plan
    while True:
        sampler.set_epoch(epoch)  # before the loader's iterator exists, so workers prefetch this epoch
        data = sampler.dataset_of(epoch) if isinstance(sampler, Phased) else dataset
        spe = plan.steps_per_epoch(len(data))
        loader = DataLoader(data, batch_sampler=SkipBatchSampler(sampler, first * plan.accum), num_workers=num_workers,
                            pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed + epoch),
                            worker_init_fn=worker_init_fn if num_workers else None)
        it = iter(loader)
        for s in range(first, spe):
            yield epoch, s, [next(it) for _ in range(plan.accum)]
        epoch, first = epoch + 1, 0
