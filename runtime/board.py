"""The launch's board: keys on the c10d store every rank already holds, for what ranks tell each other
outside collectives (a failure on the way out, a heartbeat and an outcome of long work), and the
waits that read it with a stall limit instead of a timeout (run/protocol.py uses it; so does the
packing hand-off, data/run.py)."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from common.outcome import Failed, RankFailed

log = logging.getLogger("minimind")


class Stalled(Failed):
    """A wait whose heartbeat stood still for its stall limit: a failure (exit 1), never bad input."""


class Board:
    """Keys of this launch on the c10d store (`store`; None for one process: a dict in memory),
    under a prefix rank 0 drew for the launch, so that what an earlier launch on the same store left
    is never read as this one's."""

    def __init__(self, store, prefix: str) -> None:
        self.store, self.prefix = store, prefix
        self.local: dict[str, str] = {}

    def set(self, key: str, value: Any) -> None:
        data = json.dumps(value)
        if self.store is None:
            self.local[key] = data
        else:
            self.store.set(f"{self.prefix}/{key}", data)

    def get(self, key: str) -> Any | None:
        """The value at `key`, or None when nothing is there yet (never waits)."""
        if self.store is None:
            data = self.local.get(key)
        else:
            full = f"{self.prefix}/{key}"
            data = self.store.get(full).decode() if self.store.check([full]) else None
        return None if data is None else json.loads(data)

    def delete(self, key: str) -> None:
        """Remove `key` once every rank has read it (a key written every step must not grow the store)."""
        if self.store is None:
            self.local.pop(key, None)
        else:
            self.store.delete_key(f"{self.prefix}/{key}")

    def first(self, key: str, value: Any) -> None:
        """Set `key` unless something is there already (the first failure is the cause; later ones are its echoes)."""
        data = json.dumps(value)
        if self.store is None:
            self.local.setdefault(key, data)
        else:
            self.store.compare_set(f"{self.prefix}/{key}", "", data)

    FAILURE = "failure"

    def post_failure(self, record: dict) -> None:
        """A rank's failure ({"rank", "outcome", "message", "phase", ...}), the first posted kept."""
        self.first(self.FAILURE, record)

    def failure_of_another(self, rank: int) -> RankFailed | None:
        """The failure another rank than `rank` posted, as the RankFailed every rank raises; None
        when there is none (or the store is gone: its host ended)."""
        try:
            record = self.get(self.FAILURE)
        except Exception:  # noqa: BLE001 - nothing to read from a store that is gone
            return None
        if not record or record.get("rank") == rank:
            return None
        kind = "bad_input" if record.get("outcome") == "bad_input" else "failed"
        return RankFailed(int(record["rank"]), kind, str(record.get("message")), str(record.get("phase") or ""))


class Heartbeat:
    """The long-running side of a wait on the board: `with Heartbeat(board, key) as hb: ... ;
    hb.finish(outcome)`. A thread bumps a counter every `every_s` seconds; `progress(done, total)`
    says how far it is."""

    def __init__(self, board: Board, key: str, every_s: float = 1.0) -> None:
        self.board, self.key, self.every_s = board, key, every_s
        self.record = {"state": "working", "beat": 0, "done": 0, "total": 0, "host": socket.gethostname(), "pid": os.getpid()}
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"heartbeat-{key}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._write()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()

    def _write(self) -> None:
        with self.lock:
            self.record["beat"] += 1
            record = dict(self.record)
        self.board.set(self.key, record)

    def _beat(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self._write()
            except Exception as e:  # noqa: BLE001 - the waiters see a counter that stands still
                log.warning("cannot write the heartbeat %s (%s)", self.key, e)

    def progress(self, done: int, total: int, unit: str = "MB") -> None:
        """How far the work is: `done` of `total` bytes (unit MB: said in MB), or of another unit (said as counted)."""
        with self.lock:
            self.record.update(done=done, total=total, unit=unit)

    def finish(self, outcome: dict) -> None:
        """Publish the outcome ({...} or {"error": ...}); the heartbeat stops."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        with self.lock:
            self.record.update(state="done", outcome=outcome)
        self._write()


def wait_for(board: Board, key: str, stall_s: float, what: str, me: int, talk: bool = False, poll_s: float = 0.2,
             say_every_s: float = 10.0) -> dict:
    """The outcome a Heartbeat at `key` finishes with, however long it takes, as long as its counter
    moves; Stalled when it stands still for `stall_s` seconds (or never starts in that time); the
    RankFailed of another rank than `me` as soon as one is on the board. With `talk`, a line every
    `say_every_s` seconds says how far the other side is."""
    last_beat, last_change, last_said = None, time.monotonic(), time.monotonic()
    while True:
        record = board.get(key)
        now = time.monotonic()
        if record is not None:
            if record.get("state") == "done":
                return record["outcome"]
            if record.get("beat") != last_beat:
                last_beat, last_change = record.get("beat"), now
            if talk and now - last_said >= say_every_s and record.get("total"):
                last_said = now
                scale = 1e6 if record.get("unit", "MB") == "MB" else 1
                log.warning("waiting for %s (%s, pid %s): %.0f of %.0f %s", what, record.get("host"), record.get("pid"),
                            record["done"] / scale, record["total"] / scale, record.get("unit", "MB"))
        if (failed := board.failure_of_another(me)) is not None:
            raise failed
        if now - last_change > stall_s:
            who = f"{record.get('host')} pid {record.get('pid')}" if record else "it never started"
            raise Stalled(f"{what} ({who}) made no progress for {stall_s:g} s (dist.timeout_s); if it is alive, its disk "
                          f"or its file system is stuck")
        time.sleep(poll_s)


def hand_off(rt, key: str, worker: int, work, stall_s: float, what: str) -> dict[int, dict]:
    """Long work done once per group of ranks and handed to the others on the board: rank `worker`
    (this rank's group's, e.g. its node's first) runs `work(progress)` -> an outcome dict under a
    Heartbeat; every rank then waits for every worker's outcome, however long it takes, as long as
    its heartbeat moves (`stall_s`: dist.timeout_s), its own group's first. A stop signal on a worker
    ends its waiters too. `rt`: the runtime (rank, world_size, all_gather, board). Returns
    {worker rank: outcome}; one process runs `work(None)`."""
    if rt.world_size == 1:
        return {0: work(None)}
    workers = sorted(set(rt.all_gather(worker)))  # before anyone works: a collective that waits for nobody
    if rt.rank == worker:
        with Heartbeat(rt.board, f"{key}/{worker}") as beat:
            try:
                outcome = work(beat.progress)
            except BaseException:
                beat.finish({"error": f"{what} (rank {rt.rank}) was stopped", "outcome": "failed"})
                raise
            beat.finish(outcome)
    return {r: wait_for(rt.board, f"{key}/{r}", stall_s, f"{what} (rank {r})", rt.rank, talk=rt.rank == worker + 1)
            for r in sorted(workers, key=lambda r: r != worker)}
