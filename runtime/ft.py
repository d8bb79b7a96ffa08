"""Live recovery's membership and gradient sum (docs/fault_tolerance.md): replica groups in a per-step
quorum on torchft's Lighthouse and Manager, micro-batch i of step s given to a participant by a pure
function of (s, i, participants), and every micro-batch's gradient gathered from the groups and summed
in the canonical order, so who computed what never changes a bit.

torchft is used for what keeps the bits: its Lighthouse (membership), Manager (quorum, heal transport,
the commit vote) and reconfigurable gloo process group. Its gradient average (divided by the current
participants) and its lossy sampler are not used: the sum and the data position are ours.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from common.outcome import BadInput, Stopped

from .reduce import CanonicalReduce
from .setup import Runtime

log = logging.getLogger("minimind")


@dataclass
class FTConfig:
    lighthouse: str = ""
    """host:port of the Lighthouse (`python -m runtime.lighthouse --port PORT`); "" (the default): no live recovery."""
    group: int = 0
    """This replica group's id, 0 .. ft.groups - 1 (a group is one torchrun job of any size)."""
    groups: int = 1
    """The replica groups the run is sized for."""
    min_groups: int = 1
    """The fewest groups that may take a step; fewer wait for the quorum to grow."""
    timeout_s: float = 30.0
    """Collectives across groups and the heal's transfer; a group that hangs longer is left out of the next quorum."""
    quorum_timeout_s: float = 120.0
    """How long a group waits for a quorum (the Lighthouse gone, too few groups) before it stops with 75, named."""

    def __post_init__(self) -> None:
        if self.lighthouse:
            host, _, port = self.lighthouse.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"ft.lighthouse: expected host:port (e.g. 127.0.0.1:29510), got {self.lighthouse!r}")
        if self.groups < 1:
            raise ValueError(f"ft.groups: expected at least 1 group, got {self.groups}")
        if not 0 <= self.group < self.groups:
            raise ValueError(f"ft.group: expected 0 .. ft.groups - 1 = {self.groups - 1}, got {self.group}")
        if not 1 <= self.min_groups <= self.groups:
            raise ValueError(f"ft.min_groups: expected 1 .. ft.groups = {self.groups}, got {self.min_groups}")
        for key in ("timeout_s", "quorum_timeout_s"):
            if not 0 < getattr(self, key) <= 86400:
                raise ValueError(f"ft.{key}: expected 0 < seconds <= 86400, got {getattr(self, key)}")


class QuorumLost(Stopped):
    """No quorum within ft.quorum_timeout_s (the Lighthouse gone, or too few groups): the run stops with 75, resumable
    (nothing is lost: the last committed step is every live group's, and the writer's checkpoints stand)."""


class HealRefused(BadInput, RuntimeError):
    """A group that cannot take part in this run (another config, other code, state that does not verify)."""


def assign(s: int, i: int, participants: tuple[int, ...]) -> int:
    """The group that computes micro-batch i of step s: a pure function of (s, i, participants), so
    every group knows every other's share without being told (docs/design.md, membership)."""
    return participants[(s + i) % len(participants)]


def shares(s: int, m: int, participants: tuple[int, ...]) -> dict[int, list[int]]:
    """Each participant's micro-batches of step s, in micro-batch order."""
    out: dict[int, list[int]] = {g: [] for g in participants}
    for i in range(m):
        out[assign(s, i, participants)].append(i)
    return out


def group_of(replica_id: str) -> int:
    """The ft.group of a Manager's replica id (`group<N>:<uuid>`)."""
    return int(replica_id.split(":")[0].removeprefix("group"))


class _Recorder:
    """The Manager's client, recording each quorum's answer (the Manager keeps the participants to itself)."""

    def __init__(self, client) -> None:
        self.client, self.last = client, None

    def _quorum(self, *args, **kwargs):
        self.last = self.client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name):
        return getattr(self.client, name)


def _safe_transport(timeout: timedelta):
    """torchft's HTTP heal transport, read with `weights_only=True` (docs/design.md I10: loading never runs code)."""
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing._serialization import _streaming_load
    import urllib.request

    class SafeHTTPTransport(HTTPTransport):
        seconds = 0.0
        """How long the last transfer took (the fetch and its read)."""

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            t0 = time.monotonic()
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                got = _streaming_load(f, weights_only=True)
            cls.seconds = time.monotonic() - t0
            return got

    return SafeHTTPTransport(timeout=timeout, num_chunks=0)


class Membership:
    """This group's seat in the run: a torchft Manager on the group's store, asked for a quorum before
    each step; the heal (state in and out) goes through `state_fn` / `load_fn` (run/live.py)."""

    def __init__(self, cfg: FTConfig, rt: Runtime, state_fn, load_fn, step: int) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.cfg, self.rt = cfg, rt
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):  # a line per step each, and a traceback for
            logging.getLogger(name).setLevel(logging.CRITICAL)  # a failed heal it handles: ours say what changed and what failed
        timeout = timedelta(seconds=cfg.timeout_s)
        if rt.world_size > 1:  # the group's own torchrun store
            addr, port, self._store = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
        else:  # a store of our own for a one-process group, reachable by the other groups' processes
            self._store = torch.distributed.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            addr, port = os.environ.get("MINIMIND_FT_HOST") or socket.gethostname(), self._store.port
        self.pg = ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = self._manager(Manager, cfg, rt, timeout, addr, port)
        except RuntimeError as e:  # torchft's server could not reach the Lighthouse (it waited its connect timeout)
            raise QuorumLost(f"ft: group {cfg.group} cannot reach the Lighthouse at {cfg.lighthouse} "
                             f"({str(e).splitlines()[0][:200]}); stopped before its first step, resumable") from None
        self.transport = self.manager._checkpoint_transport
        self.manager._client = self.client = _Recorder(self.manager._client)
        self.manager.register_state_dict_fn("minimind", load_fn, state_fn)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.participants: tuple[int, ...] = ()
        self.healed_from: int | None = None
        self.quorum_id = -1

    def _manager(self, Manager, cfg: FTConfig, rt: Runtime, timeout: timedelta, addr: str, port: int):
        """torchft's Manager for this process: its server on the group's rank 0, the heal transport read safely; each
        quorum is one try of at most ft.timeout_s (quorum() retries them up to ft.quorum_timeout_s)."""
        return Manager(
            pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_groups, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=min(cfg.timeout_s, cfg.quorum_timeout_s)), connect_timeout=timeout,
            rank=rt.rank, world_size=rt.world_size, store_addr=addr, store_port=port, lighthouse_addr=f"http://{cfg.lighthouse}",
            replica_id=f"group{cfg.group}", hostname=os.environ.get("MINIMIND_FT_HOST") or socket.gethostname(),
            checkpoint_transport=_safe_transport(timeout), init_sync=False, heartbeat_interval=timedelta(milliseconds=100))

    def quorum(self, step: int) -> tuple[int, ...]:
        """The groups taking part in step `step` (this one among them, healed first if it was behind).
        Retried while the Lighthouse does not answer, up to ft.quorum_timeout_s; then QuorumLost."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        t0, waited = time.monotonic(), False
        while True:
            try:
                self.manager.start_quorum()
                break
            except Exception as e:  # noqa: BLE001 - torchft raises what its RPCs raise
                if isinstance(e, BadInput) or isinstance(getattr(e, "__cause__", None), BadInput):
                    raise
                if time.monotonic() - t0 > self.cfg.quorum_timeout_s:
                    raise QuorumLost(f"ft: no quorum for {self.cfg.quorum_timeout_s:g} s (ft.quorum_timeout_s) from the Lighthouse at "
                                     f"{self.cfg.lighthouse} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                                     f"stopped at step {step}, resumable") from None
                self.manager._quorum_future = None  # torchft re-raises a failed quorum at the next start: this one is over
                if not waited:
                    log.warning("ft: group %d waits for a quorum at step %d (%s)", self.cfg.group, step, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                    waited = True
                time.sleep(0.5)
        if (failed := self.manager.errored()) is not None:  # a heal that failed (its sender gone or busy): the step is done again
            log.warning("ft: group %d: the heal at step %d failed (%s); this step is not committed, the quorum is asked again",
                        self.cfg.group, step, str(failed.original_exception).splitlines()[0][:200] if str(failed.original_exception) else
                        type(failed.original_exception).__name__)
        q = self.client.last
        before, self.participants = self.participants, tuple(sorted(group_of(r) for r in q.replica_ids))
        # A new quorum id for every member alike (the Lighthouse bumps it at any change of membership): what
        # the members do once per quorum (check_members' collective) they do together.
        self.changed, self.quorum_id = q.quorum_id != self.quorum_id, q.quorum_id
        self.replica_groups = [group_of(r) for r in q.replica_ids]  # the process group's ranks, in order
        if self.participants != before and self.rt.is_main:
            left, joined = sorted(set(before) - set(self.participants)), sorted(set(self.participants) - set(before))
            log.info("ft: step %d: groups %s%s%s%s", self.manager.current_step(), list(self.participants),
                     f" (left: {left})" if left and before else "", f" (joined: {joined})" if joined and before else "",
                     f" (healed from group {self.healed_from})" if self.healed_from is not None else "")
        if waited:
            log.info("ft: group %d has a quorum again after %.1f s", self.cfg.group, time.monotonic() - t0)
        self.healed_from = None
        return self.participants

    def gather(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Every participant's `rows` (the same shape everywhere), in participant order (this quorum's
        replica ranks, `replica_groups`); None when a peer failed (reported: the step is not committed)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        if self.manager.errored():
            return None
        n = len(self.replica_groups)
        out = torch.empty(n, *rows.shape, dtype=rows.dtype)
        try:
            self.pg.allgather([list(out.unbind(0))], [rows], AllgatherOptions()).wait()
        except Exception as e:  # noqa: BLE001 - a peer that died or hung: report it, the step is done again
            log.warning("ft: group %d: the gather of step %d failed (%s); the step is done again with the next quorum",
                        self.cfg.group, self.manager.current_step(), str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            self.manager.report_error(e)
            return None
        return out

    def exchange(self, blob: bytes) -> list[bytes] | None:
        """Every participant's `blob`, in `replica_groups` order (two gathers: the lengths, then the
        padded bytes); None when a peer failed (reported: the step is not committed)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        n, mine = len(self.replica_groups), torch.tensor([len(blob)], dtype=torch.int64)
        try:
            sizes = torch.empty(n, 1, dtype=torch.int64)
            self.pg.allgather([list(sizes.unbind(0))], [mine], AllgatherOptions()).wait()
            width = int(sizes.max())
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            out = torch.empty(n, width, dtype=torch.uint8)
            self.pg.allgather([list(out.unbind(0))], [padded], AllgatherOptions()).wait()
        except Exception as e:  # noqa: BLE001 - a peer that died: the step is not committed, done again
            self.manager.report_error(e)
            return None
        return [bytes(out[k, : int(sizes[k])].tolist()) for k in range(n)]

    def commit(self) -> bool:
        """Whether this group may step (every rank of it agrees; torchft's should_commit)."""
        return self.manager.should_commit()

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - closing after a failure: nothing left to save
            pass


class LiveReduce(CanonicalReduce):
    """dist.reduce=canonical across replica groups: this process computes its share of step s
    (`begin`), its rows are gathered within the group (torchrun's group) and then across the groups
    (the quorum's process group), and every process sums all M rows in micro-batch order i = 0..M-1
    and divides by M, whoever computed them. `reduce` returns None when the step is not committed."""

    def __init__(self, model: torch.nn.Module, rt: Runtime, micro_batches: int, membership: Membership, group: int) -> None:
        self.m, self.membership, self.group = micro_batches, membership, group
        super().__init__(model, rt, micro_batches)
        self.gathered = torch.zeros(0)
        self.mine: list[int] = []

    def begin(self, s: int, participants: tuple[int, ...]) -> list[int]:
        """This process's micro-batches of step s: its group's share, dealt over the group's ranks."""
        self.s, self.participants = s, participants
        self.share = shares(s, self.m, participants)
        self.mine = self.share[self.group][self.rt.rank :: self.rt.world_size]
        return self.mine

    def index(self, j: int) -> int:
        return self.mine[j]

    def reduce(self) -> torch.Tensor | None:
        w, width = self.rt.world_size, max(len(v) for v in self.share.values())
        per_rank = -(-width // w)
        rows = self.local[:per_rank]
        if self.rt.distributed and w > 1:  # the group's rows first: rank r holds share[r::w]
            part = torch.empty(w, per_rank, self.numel + 1)
            torch.distributed.all_gather(list(part.unbind(0)), rows.contiguous())
            own = part
        else:
            own = rows.reshape(1, per_rank, -1)
        got = self.membership.gather(own.contiguous())
        if got is None:
            self.membership.commit()
            return None
        by_group = dict(zip(self.membership.replica_groups, got.unbind(0)))
        total = None
        for i in range(self.m):  # micro-batch order, whoever computed it
            g = assign(self.s, i, self.participants)
            k = self.share[g].index(i)
            row = by_group[g][k % w][k // w]
            total = row.clone() if total is None else total.__iadd__(row)
        total /= self.m
        if not self.membership.commit():
            return None
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p)
            offset += n
        return total[self.numel].clone()
