"""The two gradient reductions (docs/resuming.md, "Two reduction modes"): DDP, and the canonical sum that
does not depend on the world size."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from .setup import Runtime, mean_over_ranks


class DDPReduce:
    """dist.reduce=ddp: DistributedDataParallel, gradients all-reduced on the last micro-step only.

    Bit-identical for the same world size; another world size sums in another order (close, not equal).
    """

    def __init__(self, model: torch.nn.Module, rt: Runtime, accum: int) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.rt, self.accum, self.model = rt, accum, model
        self.net = model
        if rt.distributed and rt.world_size > 1:
            ids = [rt.device.index] if rt.device.type == "cuda" else None
            # RoPE tables are constants: no need to sync buffers every forward. broadcast_buffers, not
            # torch 2.13's forward_sync_buffers: every torch of the supported range has it (common/versions.py).
            self.net = DDP(model, device_ids=ids, broadcast_buffers=False)
        self._loss = 0.0

    def index(self, j: int) -> int:
        """Micro-batch j of this rank is micro-batch j * W + rank of the step (docs/design.md I4)."""
        return j * self.rt.world_size + self.rt.rank

    def no_sync(self, j: int):
        last = j == self.accum - 1
        return self.net.no_sync() if (self.net is not self.model and not last) else nullcontext()

    def backward(self, loss: torch.Tensor, j: int, scale=None) -> None:
        scaled = loss / self.accum
        (scale(scaled) if scale else scaled).backward()
        self._loss = self._loss + scaled.detach()  # a tensor: no device sync per micro-batch

    def reduce(self) -> torch.Tensor:
        """Gradients are already averaged by DDP; return the step's loss averaged over ranks."""
        local, self._loss = self._loss, 0.0
        return mean_over_ranks(local, self.rt)

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


class CanonicalReduce:
    """dist.reduce=canonical: every micro-batch's gradient is kept apart, all-gathered, and summed by
    every rank in the order i = 0..M-1 of the sampler plan, so the result does not depend on W.

    Memory: a buffer of accum x (P + 1) floats per rank for its own micro-batches and
    M x (P + 1) for the gathered ones (P = parameters; the extra float carries the loss).
    """

    def __init__(self, model: torch.nn.Module, rt: Runtime, accum: int) -> None:
        self.rt, self.accum, self.model, self.net = rt, accum, model, model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.local = torch.zeros(accum, self.numel + 1, dtype=torch.float32, device=rt.device)
        many = rt.distributed and rt.world_size > 1
        self.gathered = torch.zeros(rt.world_size * accum if many else 0, self.numel + 1, dtype=torch.float32, device=rt.device)

    @property
    def buffer_bytes(self) -> int:
        return (self.local.numel() + self.gathered.numel()) * 4

    def index(self, j: int) -> int:
        """Micro-batch j of this rank is micro-batch j * W + rank of the step (docs/design.md I4)."""
        return j * self.rt.world_size + self.rt.rank

    def no_sync(self, j: int):
        return nullcontext()

    def backward(self, loss: torch.Tensor, j: int, scale=None) -> None:
        (scale(loss) if scale else loss).backward()
        row = self.local[j]
        torch.cat([p.grad.reshape(-1) for p in self.params], out=row[: self.numel])  # one copy kernel, not one per parameter
        for p in self.params:
            p.grad = None
        row[self.numel] = loss.detach().float()

    def reduce(self) -> torch.Tensor:
        w = self.rt.world_size
        if self.rt.distributed and w > 1:
            # all_gather into views of one buffer (all_gather_into_tensor is deprecated in torch 2.13).
            dist.all_gather(list(self.gathered.view(w, self.accum, -1).unbind(0)), self.local)
            # Rank r's row j is micro-batch i = j * W + r: reorder rows to i = 0..M-1.
            rows = self.gathered.view(w, self.accum, -1).transpose(0, 1).reshape(w * self.accum, -1)
        else:
            rows = self.local
        total = rows[0].clone()
        for i in range(1, rows.shape[0]):
            total += rows[i]
        total /= rows.shape[0]
        offset = 0
        for p in self.params:  # views into this step's own sum (a new tensor every step): no copy
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p)
            offset += n
        return total[self.numel].clone()  # the loss, on the device: read at the next log step, not here

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


def make_reducer(strategy: str, reduce: str, model: torch.nn.Module, rt: Runtime, accum: int, fingerprint=None, step: int = 0):
    """The gradient reduction of dist.strategy and dist.reduce around `model` (made after the load,
    so that every rank starts from the weights it loaded). Under canonical ddp every rank must hold
    the same bits: `fingerprint(model)` (a hash of its weights) is compared across ranks first."""
    if strategy == "ddp" and reduce == "canonical" and fingerprint is not None:
        hashes = rt.all_gather(fingerprint(model))
        if len(set(hashes)) > 1:
            raise RuntimeError(f"dist.reduce=canonical: ranks hold different weights at step {step}: {hashes}")
    if strategy == "fsdp":
        from .sharding import FSDPCanonicalReduce, FSDPReduce

        return (FSDPReduce if reduce == "ddp" else FSDPCanonicalReduce)(model, rt, accum)
    return (DDPReduce if reduce == "ddp" else CanonicalReduce)(model, rt, accum)
