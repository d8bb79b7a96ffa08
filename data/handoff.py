"""Waiting for a node's packer outside every collective timeout (docs/data.md, "Packing and waiting").

One rank packs (the node's first, or rank 0 for a shared cache) while the others wait. They do not
wait inside a collective, whose timeout (`dist.timeout_s`) would kill a run whose corpus takes
longer to pack: the packer keeps a small JSON file in the cache folder up to date - a heartbeat
counter bumped every second by a thread, the bytes packed, and finally its outcome - and the others
read it a few times a second. They wait as long as the counter moves, however long packing takes,
fail as soon as the outcome is a failure, and give up only when the counter stands still for
`stall_s` (a packer that hangs). The file's name carries a token rank 0 draws for the launch, so a
file an earlier launch left is never taken for this one's.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from checkpoint.files import atomic_write

from .sources import DataError

log = logging.getLogger("minimind")
PREFIX = ".handoff-"


def handoff_path(cache_dir: Path, token: str, packer_rank: int) -> Path:
    return Path(cache_dir) / f"{PREFIX}{token}-r{packer_rank}.json"


class Heartbeat:
    """The packer's side: `with Heartbeat(path) as hb: pack(..., watch=hb.watch); hb.finish(outcome)`."""

    def __init__(self, path: Path, every_s: float = 1.0) -> None:
        self.path, self.every_s = path, every_s
        self.record = {"state": "packing", "beat": 0, "done": 0, "total": 0, "host": socket.gethostname(), "pid": os.getpid()}
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, name="pack-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()

    def _write(self) -> None:
        with self.lock:
            self.record["beat"] += 1
            data = json.dumps(self.record)
        atomic_write(self.path, data)

    def _beat(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self._write()
            except OSError as e:  # the waiters time out on a counter that stands still
                log.warning("%s: cannot write the packing heartbeat (%s)", self.path, e.strerror)

    def watch(self, done: int, total: int) -> None:
        with self.lock:
            self.record.update(done=done, total=total)

    def finish(self, outcome: dict) -> None:
        """Publish the outcome ({"bin", "meta", ...} or {"error", ...}); the heartbeat stops."""
        self.stopped.set()
        self.thread.join()
        with self.lock:
            self.record.update(state="error" if "error" in outcome else "done", outcome=outcome)
        self._write()


def wait(path: Path, stall_s: float, talk: bool = False, poll_s: float = 0.2, say_every_s: float = 10.0) -> dict:
    """The packer's outcome, read from `path` once it is there; DataError when the packer's heartbeat
    stands still for `stall_s` seconds (or its file does not appear in that time). With `talk`, a
    line every `say_every_s` seconds says how far the packer is."""
    last_beat, last_change, last_said = None, time.monotonic(), time.monotonic()
    while True:
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            record = None
        except (json.JSONDecodeError, OSError):  # replaced atomically, so only a broken file system gets here
            record = None
        now = time.monotonic()
        if record is not None:
            if record.get("state") in ("done", "error"):
                return record["outcome"]
            if record.get("beat") != last_beat:
                last_beat, last_change = record.get("beat"), now
            if talk and now - last_said >= say_every_s and record.get("total"):
                last_said = now
                log.warning("waiting for the packer (%s, pid %s): %.0f of %.0f MB", record.get("host"), record.get("pid"),
                            record["done"] / 1e6, record["total"] / 1e6)
        if now - last_change > stall_s:
            who = f"{record.get('host')} pid {record.get('pid')}" if record else "no packer started"
            raise DataError(f"{path}: the packer ({who}) made no progress for {stall_s:g} s (dist.timeout_s); "
                            f"if it is alive, its disk or its file system is stuck")
        time.sleep(poll_s)


def clear_stale(cache_dir: Path, keep: Path) -> None:
    """Remove hand-off files that packers of this host left when they were killed (their pid is gone)."""
    for p in Path(cache_dir).glob(f"{PREFIX}*.json"):
        if p == keep:
            continue
        try:
            record = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
            try:
                os.kill(record["pid"], 0)
            except ProcessLookupError:
                p.unlink(missing_ok=True)
            except PermissionError:
                pass
