"""The order of the data, and where each rank reads from it.

docs/design.md I1-I4. Epoch e's order is `randperm(N)` from a generator seeded with `seed + e`
(DistributedSampler's rule), the same for every world size. Optimizer step s of the epoch consumes
the positions `[s*G, (s+1)*G)` of that order, cut into M = G / micro micro-batches; micro-batch i is
positions `[s*G + i*micro, s*G + (i+1)*micro)` and rank r computes those with i = r (mod W), in
order. A rank's stream is therefore a pure function of (seed, epoch, W, r, micro, G), and resuming
at step s means skipping the first `s * accum` micro-batches of it, whatever W was before.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler


class BatchPlanError(ValueError):
    pass


@dataclass(frozen=True)
class BatchPlan:
    """The batch geometry of a run: G fixed for the run, micro and W may change on resume."""

    global_batch: int
    micro_batch: int
    world_size: int

    def __post_init__(self) -> None:
        g, m, w = self.global_batch, self.micro_batch, self.world_size
        if g <= 0 or m <= 0:
            raise BatchPlanError(f"train.global_batch ({g}) and train.micro_batch ({m}) must be positive")
        if g % (m * w):
            ok = [d for d in range(1, g + 1) if g % (d * w) == 0]
            hint = f"micro batches that divide it on {w} process(es): {', '.join(map(str, ok))}" if ok else (
                f"no micro batch does: the global batch must be a multiple of the world size {w}")
            if g % m == 0:
                worlds = [v for v in range(1, g // m + 1) if (g // m) % v == 0]
                hint += f"; with micro batch {m} (M = {g // m} micro-batches per step) the world sizes that work are {', '.join(map(str, worlds))}"
            raise BatchPlanError(
                f"train.global_batch={g} is not divisible by train.micro_batch={m} x world size {w} = {m * w}; {hint}"
            )

    @property
    def micro_batches(self) -> int:
        """M: micro-batches per optimizer step, over all ranks."""
        return self.global_batch // self.micro_batch

    @property
    def accum(self) -> int:
        """Micro-batches each rank computes per optimizer step."""
        return self.micro_batches // self.world_size

    def steps_per_epoch(self, num_samples: int) -> int:
        """Optimizer steps in an epoch: the tail that does not fill a global batch is dropped."""
        return num_samples // self.global_batch


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order, one int64 tensor: DistributedSampler's `randperm` seeded with seed + epoch."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g)


class BlockDistributedSampler(Sampler[list[int]]):
    """Rank `rank`'s micro-batches for the current epoch (a batch sampler).

    Like DistributedSampler it is told the epoch with `set_epoch` before each epoch; unlike it, it
    shards by blocks of `micro_batch` samples, so that every world size consumes the same prefix of
    the order at every optimizer step.
    """

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int, seed: int) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} outside world size {plan.world_size}")
        self.num_samples, self.plan, self.rank, self.seed = num_samples, plan, rank, seed
        self.epoch = 0
        self._order: torch.Tensor | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._order = None
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        if self._order is None:
            self._order = epoch_order(self.num_samples, self.seed, self.epoch)
        return self._order

    def __len__(self) -> int:
        return self.plan.steps_per_epoch(self.num_samples) * self.plan.accum

    def global_position(self, k: int) -> int:
        """Start, in the epoch's order, of this rank's k-th micro-batch."""
        s, j = divmod(k, self.plan.accum)
        i = j * self.plan.world_size + self.rank
        return s * self.plan.global_batch + i * self.plan.micro_batch

    def iter_from(self, skip: int) -> Iterator[list[int]]:
        """This rank's micro-batches from the `skip`-th on; skipping costs nothing."""
        order, micro = self.order(), self.plan.micro_batch
        for k in range(skip, len(self)):
            start = self.global_position(k)
            yield order[start : start + micro].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return self.iter_from(0)

    def step_indices(self, step_in_epoch: int) -> list[int]:
        """The global sample indices that optimizer step `step_in_epoch` consumes, on all ranks."""
        g = self.plan.global_batch
        return self.order()[step_in_epoch * g : (step_in_epoch + 1) * g].tolist()


class SkipBatchSampler(Sampler[list[int]]):
    """MiniMind's SkipBatchSampler: the batches of `sampler` after the first `skip`, without loading them.

    `skip` is derived from the global position on resume (docs/design.md I4): `step_in_epoch * accum`
    for the current world size. That derivation is the world-size rescale.
    """

    def __init__(self, sampler: BlockDistributedSampler, skip: int) -> None:
        if skip < 0 or skip > len(sampler):
            raise ValueError(f"cannot skip {skip} of {len(sampler)} micro-batches")
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.iter_from(self.skip)

    def __len__(self) -> int:
        return len(self.sampler) - self.skip
