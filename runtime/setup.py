"""Distributed set-up and the few collectives the loop and the checkpoint manager agree through.

torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...) decides the topology; plain
`python train.py` is world size 1 without a process group. gloo on CPU, nccl on CUDA.
"""
from __future__ import annotations

import datetime
import os
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.outcome import BadInput

from .board import Board

from .elastic import attempt_store


class SetupError(BadInput, ValueError):
    """A device or backend setting this machine cannot honour; the message names the key."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""train.dtype -> the torch dtype autocast computes in."""


def autocast(device: torch.device, dtype: str):
    """The context a forward pass runs in for train.dtype: autocast to it, or nothing for float32."""
    return torch.autocast(device.type, dtype=DTYPES[dtype]) if dtype != "float32" else nullcontext()


def choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """A setting that must be one of `allowed`: ValueError naming the key (configs turns it into a ConfigError)."""
    if value not in allowed:
        raise ValueError(f"{key}: expected one of {', '.join(allowed)}, got {value!r}")


MAX_THREADS = 4096
"""More intra-op threads than any machine has cores (torch takes a C int; billions end in an overflow or a crash)."""
MAX_TIMEOUT_S = 2**31 - 1
"""The longest collective timeout, in seconds (68 years: a C int, which every layer below takes)."""


@dataclass
class RuntimeConfig:
    device: str = "auto"
    """auto (CUDA when present) | cpu | cuda."""
    threads: int = 0
    """Intra-op threads per process; 0: 1 under dist.reduce=canonical, else cores / local processes."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) and, on CUDA, CUBLAS_WORKSPACE_CONFIG and cuDNN flags."""

    def __post_init__(self) -> None:
        choice("runtime.device", self.device, ("auto", "cpu", "cuda"))
        if not 0 <= self.threads <= MAX_THREADS:
            raise ValueError(f"runtime.threads: expected 0 (the default) to {MAX_THREADS} threads, got {self.threads}")


@dataclass
class DistConfig:
    reduce: str = "ddp"
    """ddp (DistributedDataParallel) | canonical (world-size-invariant gradient sum)."""
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU) | gloo | nccl."""
    timeout_s: int = 600
    """Collective timeout."""
    strategy: str = "ddp"
    """ddp (every rank holds the whole model and optimizer) | fsdp (FSDP2: parameters, gradients and optimizer
    state sharded over the ranks, sharded checkpoints; docs/sharding.md). Fixed for a run."""
    reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward (less memory, one more all-gather in the backward)."""

    def __post_init__(self) -> None:
        choice("dist.reduce", self.reduce, ("ddp", "canonical"))
        choice("dist.strategy", self.strategy, ("ddp", "fsdp"))
        choice("dist.backend", self.backend, ("auto", "gloo", "nccl"))
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"dist.timeout_s: expected 1 to {MAX_TIMEOUT_S} seconds (a C int), got {self.timeout_s}")


class SetupConfig(Protocol):
    """What `setup` reads: a config with a `runtime` and a `dist` part (the run's whole config is one)."""

    runtime: RuntimeConfig
    dist: DistConfig


@dataclass
class Runtime:
    """Where this process stands in the run (rank, world, device), the collectives it agrees
    through, and the launch's board (runtime/board.py)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    threads: int = 1
    board: Board = field(default_factory=lambda: Board(None, "solo"))
    control: Any = None
    """A gloo group beside nccl's for the loop's agreements (`sum`): their few floats stay on the host, so a
    step boundary's vote never waits for the GPU (docs/performance.md). None: the default group does."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def comm_device(self) -> torch.device:
        """Where collective tensors live: nccl needs CUDA tensors, gloo takes CPU ones."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def sum(self, values: list[float]) -> list[float]:
        """All-reduced sums of a few floats (one collective, on the host under nccl too)."""
        t = torch.tensor(values, dtype=torch.float64, device="cpu" if self.control is not None else self.comm_device)
        if self.distributed:
            dist.all_reduce(t, group=self.control)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank passed True (docs/design.md I9)."""
        return self.sum([float(flag)])[0] > 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0; None elsewhere."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def mean_over_ranks(local: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """The mean over ranks of each rank's step loss (a 0-dim tensor), in float64 as a 0-dim tensor,
    without reading it to the host: the loop reads losses at its log steps only (run/metrics.py).
    nccl sums on the device; gloo takes CPU tensors (a copy, as before)."""
    if not (rt.distributed and rt.world_size > 1):
        return local.detach().double() / 1  # on its own device: a single process reads nothing here
    t = local.detach().reshape(1).to(rt.comm_device, torch.float64)
    dist.all_reduce(t)
    return t[0] / rt.world_size


def default_threads(cfg: RuntimeConfig, reduce: str, local_world_size: int) -> int:
    """Intra-op threads. Thread counts change floating-point results, so the count is always
    pinned: torchrun sets OMP_NUM_THREADS=1 for N > 1 while plain python uses every core."""
    if cfg.threads:
        return cfg.threads
    if reduce == "canonical":
        return 1  # the same in every process whatever W, so that W does not change the bits
    return max(1, (os.cpu_count() or 1) // local_world_size)


def setup(config: SetupConfig) -> Runtime:
    """Read torchrun's environment, pick the device and backend, start the process group."""
    cfg, backend, reduce, timeout_s = config.runtime, config.dist.backend, config.dist.reduce, config.dist.timeout_s
    env = os.environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    rank, local_rank = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SetupError("runtime.device=cuda but CUDA is not available (use auto or cpu)")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        # Any number of GPUs per node: ranks beyond the count share devices (gloo only, see below).
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        if cfg.deterministic:
            # Must be set before the first cuBLAS call.
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        # Deterministic mode also fills every new tensor with NaN (a check for reads of memory never
        # written): a kernel launch per allocation, which no kernel's result depends on here (docs/performance.md).
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    threads = default_threads(cfg, reduce, local_world_size)
    torch.set_num_threads(threads)

    chosen = None
    if world_size > 1 or "RANK" in env:
        chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        if chosen == "nccl":
            if not use_cuda:
                raise SetupError("dist.backend=nccl needs CUDA; use dist.backend=gloo (or auto) on CPU")
            if local_world_size > torch.cuda.device_count():
                raise SetupError(
                    f"dist.backend=nccl: nccl refuses two ranks on one GPU: {local_world_size} local processes, "
                    f"{torch.cuda.device_count()} GPU(s); use dist.backend=gloo to share a GPU"
                )
        timeout = datetime.timedelta(seconds=timeout_s)
        store = attempt_store(env, rank, world_size, timeout)
        if store is None:
            dist.init_process_group(chosen, timeout=timeout)
        else:
            dist.init_process_group(chosen, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif getattr(config.dist, "strategy", "ddp") == "fsdp":  # FSDP needs a process group, even of one (plain python)
        chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    rt = Runtime(rank, local_rank, world_size, local_world_size, device, chosen, threads)
    if chosen is not None:
        # The store the process group was made with (every rank holds it); the prefix is drawn
        # by rank 0 for this launch, so that nothing an earlier launch left there is read.
        from torch.distributed import distributed_c10d

        rt.board = Board(distributed_c10d._get_default_store(), f"minimind/{rt.broadcast(uuid.uuid4().hex)}")
        if chosen == "nccl":
            rt.control = dist.new_group(backend="gloo")
    return rt


def teardown(rt: Runtime, clean: bool = False) -> None:
    """Destroy the process group. After a clean end (every rank got there), a barrier first: a rank
    that closes its gloo connections while a peer still finishes the last collective can abort
    that peer ("terminate called without an active exception", seen once in 117 tests on 3 ranks)."""
    if rt.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


