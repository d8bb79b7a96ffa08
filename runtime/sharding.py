"""dist.strategy=fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) and the two reductions under it
(docs/sharding.md).

Each transformer block is one FSDP unit, then the root (the tied embedding and head, the final
norm). `train.dtype=bfloat16` becomes a MixedPrecisionPolicy (bf16 parameters in the forward, fp32
gradient reduction); float32 runs in fp32.

- `dist.reduce=ddp` -> `FSDPReduce`: FSDP's own reduce-scatter, gradient sync on the last
  micro-batch only, SUM then a division by the world size (gloo's AVG is not relied on). Exact on
  the same world size.
- `dist.reduce=canonical` -> `FSDPCanonicalReduce`: every micro-batch's gradient is summed in the
  order i = 0..M-1 of the sampler plan whatever the world size, as `CanonicalReduce` does for DDP.
  It uses FSDP's public hook for a custom reduce-scatter: FSDP hands it this rank's micro-batch
  gradient (unsharded, laid out as W blocks, block r for rank r); an all-to-all gives each rank
  block r of every rank's micro-batch, which it adds to its running sum in micro-batch order, and
  the sum is handed back to FSDP on the last micro-batch (zeros before). On one process FSDP calls
  no reduce-scatter and accumulates the micro-batches' gradients itself, in the same order.
  Gradient clipping takes the global norm from each parameter's full gradient (gathered one
  parameter at a time), so it does not depend on the sharding either.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from .setup import Runtime, mean_over_ranks

STRATEGIES = ("ddp", "fsdp")


def shard(model: torch.nn.Module, dtype: str, reshard_after_forward: bool) -> torch.nn.Module:
    """Apply fully_shard to each block, then to the root; returns the same (now sharded) module."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = {"bfloat16": torch.bfloat16, "float32": None}[dtype]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def load_full(model: torch.nn.Module, full_state: dict, strict: bool = True) -> None:
    """Every rank holds the same whole state dict (or, not strict, part of it): each keeps its shards of it.
    The tensors are scattered one collective per key in the dict's order, so every rank hands them over
    in the model's own order: a dict read from a file or built through a set may list them otherwise on
    another rank (string hashing differs per process), and the ranks' collectives would not match."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    order = list(model.state_dict())
    ordered = {k: full_state[k] for k in order if k in full_state} | {k: v for k, v in full_state.items() if k not in set(order)}
    set_model_state_dict(model, ordered, options=StateDictOptions(full_state_dict=True, strict=strict))


def fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class FSDPReduce:
    """dist.reduce=ddp under fsdp: FSDP's reduce-scatter on the last micro-batch of the step."""

    def __init__(self, model: torch.nn.Module, rt: Runtime, accum: int) -> None:
        self.rt, self.accum, self.model, self.net = rt, accum, model, model
        for m in fsdp_modules(model):
            m.set_force_sum_reduction_for_comms(True)  # SUM, then / W: never the backend's AVG
        self._loss = 0.0

    def index(self, j: int) -> int:
        """Micro-batch j of this rank is micro-batch j * W + rank of the step (docs/design.md I4)."""
        return j * self.rt.world_size + self.rt.rank

    def no_sync(self, j: int):
        self.model.set_requires_gradient_sync(j == self.accum - 1)
        return nullcontext()

    def backward(self, loss: torch.Tensor, j: int, scale=None) -> None:
        scaled = loss / self.accum
        (scale(scaled) if scale else scaled).backward()
        self._loss = self._loss + scaled.detach()

    def reduce(self) -> torch.Tensor:
        local, self._loss = self._loss, 0.0
        return mean_over_ranks(local, self.rt)

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


class _OrderedReduceScatter:
    """The custom reduce-scatter of one FSDP unit (FSDPModule.set_custom_reduce_scatter): see the
    module docstring. Called once per micro-batch (gradient sync on every micro-batch)."""

    def __init__(self, owner: "FSDPCanonicalReduce") -> None:
        self.owner, self.running, self.calls = owner, None, 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op: bool = False):
        w = dist.get_world_size(group)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)  # block s: rank s's micro-batch, my shard
        blocks = received.view(w, -1)
        j = self.calls % self.owner.accum
        if j == 0:
            self.running = blocks[0].clone()
            first = 1
        else:
            first = 0
        for s in range(first, w):  # micro-batch i = j * W + s: the global order
            self.running += blocks[s]
        if j == self.owner.accum - 1:
            output_tensor.copy_(self.running)
            self.running = None
        else:
            output_tensor.zero_()
        self.calls += 1
        return None


class FSDPCanonicalReduce:
    """dist.reduce=canonical under fsdp: bit-identical on any world size (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, rt: Runtime, accum: int) -> None:
        self.rt, self.accum, self.model, self.net = rt, accum, model, model
        self.micro_batches = accum * rt.world_size
        for m in fsdp_modules(model):
            m.set_gradient_divide_factor(1.0)  # the sum, divided by M below as CanonicalReduce does
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            if rt.world_size > 1:
                m.set_custom_reduce_scatter(_OrderedReduceScatter(self))
        self._losses: list[torch.Tensor] = []

    def index(self, j: int) -> int:
        """Micro-batch j of this rank is micro-batch j * W + rank of the step (docs/design.md I4)."""
        return j * self.rt.world_size + self.rt.rank

    def no_sync(self, j: int):
        self.model.set_requires_gradient_sync(True)  # every micro-batch's gradient goes through the ordered sum
        return nullcontext()

    def backward(self, loss: torch.Tensor, j: int, scale=None) -> None:
        (scale(loss) if scale else loss).backward()
        self._losses.append(loss.detach().float().reshape(1))

    def reduce(self) -> torch.Tensor:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(self.micro_batches)
        local = torch.cat(self._losses)
        self._losses = []
        w = self.rt.world_size
        if w > 1:
            gathered = torch.empty(w * self.accum, dtype=local.dtype, device=local.device)
            dist.all_gather(list(gathered.view(w, self.accum).unbind(0)), local)
            rows = gathered.view(w, self.accum).transpose(0, 1).reshape(-1)  # i = j * W + r
        else:
            rows = local
        total = rows[0].clone()
        for i in range(1, rows.shape[0]):
            total += rows[i]
        total /= rows.shape[0]
        return total  # on the device: read at the next log step (run/metrics.py)

    def clip(self, max_norm: float) -> None:
        """torch's clip_grad_norm_ on the full gradients, computed one parameter at a time."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norms = []
        for g in grads:
            full = g.full_tensor() if hasattr(g, "full_tensor") else g
            norms.append(torch._foreach_norm([full], 2.0)[0] if full.is_cuda else torch.linalg.vector_norm(full, 2.0))
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), max_norm, total)
