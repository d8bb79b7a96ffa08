"""Distributed set-up and the few collectives the loop and the checkpoint manager agree through.

torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...) decides the topology; plain
`python train.py` is world size 1 without a process group. gloo on CPU, nccl on CUDA.
"""
from __future__ import annotations

import datetime
import inspect
import logging
import os
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from configs import ConfigError, RuntimeConfig


@dataclass
class Runtime:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    threads: int = 1

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
        """All-reduced sums of a few floats (one collective)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        if self.distributed:
            dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank passed True (DESIGN.md I9)."""
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


def default_threads(cfg: RuntimeConfig, reduce: str, local_world_size: int) -> int:
    """Intra-op threads. Thread counts change floating-point results, so the count is always
    pinned: torchrun sets OMP_NUM_THREADS=1 for N > 1 while plain python uses every core."""
    if cfg.threads:
        return cfg.threads
    if reduce == "canonical":
        return 1  # the same in every process whatever W, so that W does not change the bits
    return max(1, (os.cpu_count() or 1) // local_world_size)


def attempt_store(env, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store for this restart attempt when torchrun shares its own TCPStore with the workers.

    torchrun (2.13) keeps one shared store for all of a job's restart attempts and, unlike older
    releases, no longer gives each attempt a key prefix of its own: after `--max-restarts` restarts
    the workers, the new process group can read the previous attempt's keys (the dead workers'
    addresses) and hang in its first connect. TORCHELASTIC_RESTART_COUNT, the prefix torch once
    used, is counted per node and differs between nodes when one node restarts for a failure and
    another for the membership change, so the workers agree on a fresh prefix instead
    (`agree_on_attempt`). None: the default env:// set-up is safe (torchrun without a shared
    store, or no torchrun).
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt/{agree_on_attempt(client, rank, world_size, timeout)}", client)


def agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """A name that every rank of this launch gets and no earlier launch on `store` had.

    Rank 0 draws it; each other rank asks with a nonce of its own and waits for the answer under a
    key named after that nonce, which no earlier launch can have written. Whatever an earlier
    launch left in the store (its requests, its answers) is never read as this launch's.
    """
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"attempt-ask/{rank}", nonce)
        store.wait([f"attempt-answer/{nonce}"], timeout)
        name = store.get(f"attempt-answer/{nonce}").decode()
        store.set(f"attempt-joined/{name}/{rank}", "1")
        return name
    name, answered, pending = uuid.uuid4().hex, set(), set(range(1, world_size))
    end = time.monotonic() + timeout.total_seconds()
    while pending:
        for r in sorted(pending):
            if store.check([f"attempt-ask/{r}"]):
                nonce = store.get(f"attempt-ask/{r}").decode()  # maybe a dead process's: answered in vain
                if nonce not in answered:
                    store.set(f"attempt-answer/{nonce}", name)
                    answered.add(nonce)
            if store.check([f"attempt-joined/{name}/{r}"]):
                pending.discard(r)
        if pending:
            if time.monotonic() > end:
                raise RuntimeError(f"ranks {sorted(pending)} did not join the process group within {timeout}")
            time.sleep(0.01)
    return name


def setup(cfg: RuntimeConfig, backend: str, reduce: str, timeout_s: int) -> Runtime:
    """Read torchrun's environment, pick the device and backend, start the process group."""
    env = os.environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    rank, local_rank = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device=cuda but CUDA is not available (use auto or cpu)")
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
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    threads = default_threads(cfg, reduce, local_world_size)
    torch.set_num_threads(threads)

    chosen = None
    if world_size > 1 or "RANK" in env:
        chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        if chosen == "nccl":
            if not use_cuda:
                raise ConfigError("dist.backend=nccl needs CUDA; use dist.backend=gloo (or auto) on CPU")
            if local_world_size > torch.cuda.device_count():
                raise ConfigError(
                    f"dist.backend=nccl: nccl refuses two ranks on one GPU: {local_world_size} local processes, "
                    f"{torch.cuda.device_count()} GPU(s); use dist.backend=gloo to share a GPU"
                )
        timeout = datetime.timedelta(seconds=timeout_s)
        store = attempt_store(env, rank, world_size, timeout)
        if store is None:
            dist.init_process_group(chosen, timeout=timeout)
        else:
            dist.init_process_group(chosen, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return Runtime(rank, local_rank, world_size, local_world_size, device, chosen, threads)


def teardown(rt: Runtime, clean: bool = False) -> None:
    """Destroy the process group. After a clean end (every rank got there), a barrier first: a rank
    that closes its gloo connections while a peer still finishes the last collective can abort
    that peer ("terminate called without an active exception", seen once in 117 tests on 3 ranks)."""
    if rt.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


class _TqdmAwareHandler(logging.StreamHandler):
    """Writes through tqdm, so a log line never lands in the middle of the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def setup_logging(rt: Runtime) -> None:
    """Human lines on rank 0; other ranks only warn, with their rank in front."""
    fmt = "%(asctime)s %(message)s" if rt.is_main else f"%(asctime)s [rank {rt.rank}] %(message)s"
    handler = _TqdmAwareHandler()
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logging.basicConfig(handlers=[handler], level=logging.INFO if rt.is_main else logging.WARNING, force=True)


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
            # RoPE tables are constants: no need to sync buffers every forward (the keyword was
            # renamed in torch 2.13; 2.4 knows only the old one).
            params = inspect.signature(DDP.__init__).parameters
            no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
            self.net = DDP(model, device_ids=ids, **no_buffer_sync)
        self._loss = 0.0

    def no_sync(self, j: int):
        last = j == self.accum - 1
        return self.net.no_sync() if (self.net is not self.model and not last) else nullcontext()

    def backward(self, loss: torch.Tensor, j: int, scale=None) -> None:
        scaled = loss / self.accum
        (scale(scaled) if scale else scaled).backward()
        self._loss = self._loss + scaled.detach()  # a tensor: no device sync per micro-batch

    def reduce(self) -> float:
        """Gradients are already averaged by DDP; return the step's loss averaged over ranks."""
        local, self._loss = float(self._loss), 0.0
        return self.rt.sum([local])[0] / self.rt.world_size


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

    def no_sync(self, j: int):
        return nullcontext()

    def backward(self, loss: torch.Tensor, j: int, scale=None) -> None:
        (scale(loss) if scale else loss).backward()
        row, offset = self.local[j], 0
        for p in self.params:
            n = p.numel()
            row[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
            p.grad = None
        row[self.numel] = loss.detach().float()

    def reduce(self) -> float:
        w = self.rt.world_size
        if self.rt.distributed and w > 1:
            # all_gather into views of one buffer (all_gather_into_tensor is deprecated in 2.13, absent in gloo on 2.4).
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
        for p in self.params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).clone()
            offset += n
        return float(total[self.numel])
