"""The order of the data, and where each rank reads from it.

docs/design.md I1-I4. Epoch e's order is `randperm(N)` from a generator seeded with `seed + e`
(DistributedSampler's rule), the same for every world size; or, with `data.order=bijective`, a keyed
bijection of [0, N) seeded the same way and computed a micro-batch at a time (`BijectiveOrder`:
constant memory, any position at once). Optimizer step s of the epoch consumes
the positions `[s*G, (s+1)*G)` of that order, cut into M = G / micro micro-batches; micro-batch i is
positions `[s*G + i*micro, s*G + (i+1)*micro)` and rank r computes those with i = r (mod W), in
order. A rank's stream is therefore a pure function of (seed, epoch, W, r, micro, G), and resuming
at step s means skipping the first `s * accum` micro-batches of it, whatever W was before.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler

from common.outcome import BadInput

ORDERS = ("randperm", "bijective")


class BatchPlanError(BadInput, ValueError):
    pass


@dataclass(frozen=True)
class BatchPlan:
    """The batch geometry of a run: G fixed for the run, micro and W may change on resume."""

    global_batch: int
    micro_batch: int
    world_size: int
    repeat: int = 1
    """Optimizer steps on each global batch (GRPO's updates_per_rollout): the order advances every `repeat` steps."""

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
            near = [b for b in (g // (m * w) * m * w, (g // (m * w) + 1) * m * w) if b > 0]  # the nearest multiples of m x w
            hint += f"; on {w} process(es) with micro batch {m}, the nearest global batches that work are {' and '.join(map(str, near))}"
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
        return num_samples // self.global_batch * self.repeat


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order, one int64 tensor: DistributedSampler's `randperm` seeded with seed + epoch."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g)


_MASK64 = (1 << 64) - 1


def _mix64(x):
    """splitmix64's finalizer: a bijective avalanche of 64-bit words (Python ints or uint64 arrays)."""
    if isinstance(x, int):
        x &= _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        return x ^ (x >> 31)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class BijectiveOrder:
    """A keyed permutation of [0, N): a balanced Feistel network on the smallest even number of bits
    that covers N, with cycle walking (a value that lands at N or past it is permuted again until it
    falls inside; the walk ends because the network is a permutation of its whole domain). Grain's
    index_shuffle works the same way. `take(start, n)` costs O(n) whatever `start`; nothing is
    stored but the round keys."""

    ROUNDS = 6

    def __init__(self, num_samples: int, key: int) -> None:
        if num_samples <= 0:
            raise ValueError(f"an order needs at least one sample, got {num_samples}")
        self.n = num_samples
        self.half = max(1, ((num_samples - 1).bit_length() + 1) // 2)  # the domain is 4**half >= N
        self.mask = np.uint64((1 << self.half) - 1)
        base = _mix64(key * 0x9E3779B97F4A7C15 + 1)
        self.keys = [np.uint64(_mix64(base + r)) for r in range(self.ROUNDS)]

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right, shift = x >> np.uint64(self.half), x & self.mask, np.uint64(self.half)
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << shift) | right

    def take(self, start: int, n: int) -> list[int]:
        """Positions [start, start + n) of the order."""
        if start < 0 or start + n > self.n:
            raise IndexError(f"positions [{start}, {start + n}) outside an order of {self.n}")
        y = self._permute(np.arange(start, start + n, dtype=np.uint64))
        while (out := y >= np.uint64(self.n)).any():
            y[out] = self._permute(y[out])
        return y.astype(np.int64).tolist()


class RandpermOrder:
    """`epoch_order` held whole (8 bytes a sample), read by position."""

    def __init__(self, num_samples: int, key: int) -> None:
        g = torch.Generator()
        g.manual_seed(key)
        self.perm = torch.randperm(num_samples, generator=g)

    def take(self, start: int, n: int) -> list[int]:
        return self.perm[start : start + n].tolist()


def make_order(kind: str, num_samples: int, seed: int, epoch: int):
    """Epoch `epoch`'s order of `kind` (`data.order`), keyed by seed + epoch either way."""
    if kind not in ORDERS:
        raise ValueError(f"data.order: expected one of {', '.join(ORDERS)}, got {kind!r}")
    return (RandpermOrder if kind == "randperm" else BijectiveOrder)(num_samples, seed + epoch)


class BlockDistributedSampler(Sampler[list[int]]):
    """Rank `rank`'s micro-batches for the current epoch (a batch sampler).

    Like DistributedSampler it is told the epoch with `set_epoch` before each epoch; unlike it, it
    shards by blocks of `micro_batch` samples, so that every world size consumes the same prefix of
    the order at every optimizer step.
    """

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int, seed: int, order: str = "randperm") -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} outside world size {plan.world_size}")
        if order not in ORDERS:
            raise ValueError(f"data.order: expected one of {', '.join(ORDERS)}, got {order!r}")
        self.num_samples, self.plan, self.rank, self.seed, self.kind = num_samples, plan, rank, seed, order
        self.epoch = 0
        self._order: RandpermOrder | BijectiveOrder | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._order = None
        self.epoch = epoch

    def order(self) -> RandpermOrder | BijectiveOrder:
        if self._order is None:
            self._order = make_order(self.kind, self.num_samples, self.seed, self.epoch)
        return self._order

    def __len__(self) -> int:
        return self.plan.steps_per_epoch(self.num_samples) * self.plan.accum

    def global_position(self, k: int) -> int:
        """Start, in the epoch's order, of this rank's k-th micro-batch."""
        s, j = divmod(k, self.plan.accum)
        i = j * self.plan.world_size + self.rank
        return s // self.plan.repeat * self.plan.global_batch + i * self.plan.micro_batch

    def iter_from(self, skip: int) -> Iterator[list[int]]:
        """This rank's micro-batches from the `skip`-th on; skipping costs nothing."""
        order, micro = self.order(), self.plan.micro_batch
        for k in range(skip, len(self)):
            yield order.take(self.global_position(k), micro)

    def __iter__(self) -> Iterator[list[int]]:
        return self.iter_from(0)

    def step_indices(self, step_in_epoch: int) -> list[int]:
        """The global sample indices that optimizer step `step_in_epoch` consumes, on all ranks."""
        g = self.plan.global_batch
        return self.order().take(step_in_epoch // self.plan.repeat * g, g)


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
