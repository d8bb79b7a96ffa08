"""The run folder: its layout, the lock that makes it one run's, and the status a scheduler reads.

    OUT/.lock            held (an OS lock) by global rank 0 for the run's life; says who holds it
    OUT/status.json      the run's state, replaced atomically: running, stopped, finished, halted, failed
    OUT/config.yaml      the resolved config
    OUT/metrics.jsonl    one line per optimizer step
    OUT/checkpoints/     step_XXXXXXXX/ folders (see storage.py)

The lock is `fcntl.lockf` (a POSIX record lock): the kernel drops it when the holder dies, however
it dies, so a SIGKILLed run never leaves a stale lock, and forked children (DataLoader workers) do
not inherit it. docs/run_folder.md says what holds on NFS and Lustre.

A run folder in object storage (`out_dir=s3://BUCKET/PREFIX`, docs/object_storage.md) has the same
names as objects; its lock is a lease object (common/store.py: Lease), and this process writes
status.json, config.yaml and metrics.jsonl in a local staging copy (`local_dir`) that is filled
from the store when the lease is taken: status.json goes back at every write, metrics.jsonl and
config.yaml with every checkpoint (checkpoint/remote.py), so a fresh node needs nothing local.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from checkpoint.storage import CHECKPOINTS
from common.files import atomic_write
from common.outcome import BadInput, Failed, describe_os_error, exit_code, outcome_of
from common.store import Lease, RemotePath, StoreError, StoreRefused, is_url, parse, staging_root

log = logging.getLogger("minimind")

LOCK = ".lock"
STATUS = "status.json"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
STAGING_ENV = "MINIMIND_STAGING_DIR"
"""Where a run folder in the store has its local staging copy (default ~/.cache/minimind/staging)."""
LAUNCH_ENV = "MINIMIND_LAUNCH_ID"
"""Set by the launch scripts: the status records it, so a script knows the status is its launch's."""



class RunFolderError(BadInput, RuntimeError):
    """The run folder cannot be used (held by another run, not a folder); the message says why."""


def describe_holder(info: dict) -> str:
    if not info:
        return "another process (it has not written its name yet)"
    since = time.strftime("%H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')} since {since}"


def read_holder(out_dir: Path, name: str = LOCK) -> dict:
    """What the lock file (`name`) says about its holder ({} when empty or unreadable)."""
    if (run := _fetched.get(Path(out_dir))) is not None:
        return Lease(run.store, (run / LOCK).key).holder()[0]
    try:
        info = json.loads((Path(out_dir) / name).read_text() or "{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def local_dir(out_dir) -> Path:
    """The folder this process writes the run's own files in: `out_dir` itself, or for a run folder
    in the store (s3://BUCKET/PREFIX) its staging copy STAGING/BUCKET/PREFIX: a bounded cache that a
    fresh node does not need (take() fills it from the store)."""
    if not is_url(out_dir):
        return Path(out_dir)
    bucket, prefix = parse(str(out_dir))
    root = staging_root()
    return root / bucket / prefix


def fetched_dir(url) -> Path:
    """Where the commands (inspect, status, ...) keep their verified copy of a run folder in the store:
    STAGING/.fetched/BUCKET/PREFIX, apart from a training's staging copy."""
    bucket, prefix = parse(str(url))
    root = staging_root()
    _fetched[root / ".fetched" / bucket / prefix] = RemotePath(url)
    return root / ".fetched" / bucket / prefix


_fetched: dict[Path, RemotePath] = {}
"""The commands' copies of run folders in the store -> the run folder (its lease says who holds it)."""
_remote: dict[Path, RemotePath] = {}
"""Staging copies of run folders in the store whose lease this process holds -> the run folder."""


@dataclass
class RunLock:
    """An exclusive lock on a run folder, held until `release()` or the process's death."""

    out_dir: Path
    fd: int
    created: tuple[Path, ...] = ()
    """The folders this launch made to hold the run (out_dir and the parents it lacked), innermost first."""
    lease: Lease | None = None
    """A run folder in the store: the lease held instead of an OS lock (out_dir is then the staging copy)."""

    def release(self) -> None:
        if self.lease is not None:
            _remote.pop(self.out_dir, None)
            self.lease.release()
            self.lease = None
        if self.fd >= 0:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = -1


def _missing(out_dir: Path) -> tuple[Path, ...]:
    """out_dir and its parents that do not exist yet, innermost first."""
    missing = []
    for p in (out_dir, *out_dir.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return tuple(missing)


def group_lock(group: int | None) -> str:
    """The lock file a launch holds: `.lock`, or live recovery's group N's `.lock.groupN` (the groups of
    one run share the folder, each holding its own; docs/fault_tolerance.md)."""
    return LOCK if group is None else f"{LOCK}.group{group}"


def _held(path: Path) -> bool:
    """Whether another process holds the lock on `path` now (taken and released at once when free)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    except OSError as e:
        return e.errno in (errno.EACCES, errno.EAGAIN)
    finally:
        os.close(fd)


def _other_kind(out_dir: Path, name: str) -> str | None:
    """A run of the other kind in the folder: live recovery's groups beside a plain run's `.lock`, or the other way."""
    if name == LOCK:
        held = sorted(p.name for p in out_dir.glob(f"{LOCK}.group*") if _held(p))
        return f"the live-recovery groups holding {', '.join(held)}" if held else None
    return "a run without ft.lighthouse" if _held(out_dir / LOCK) else None


def _open_lock_file(out_dir: Path, name: str = LOCK) -> int:
    if out_dir.exists() and not out_dir.is_dir():
        raise RunFolderError(f"out_dir={out_dir} is a regular file, not a folder (expected a run folder or a new path)")
    above = next((p for p in out_dir.parents if p.exists() or p.is_symlink()), None)
    if above is not None and not above.is_dir():  # the path itself is wrong (bad input); anything else that fails below is I/O
        raise RunFolderError(f"out_dir={out_dir} cannot be a folder: {above} is a file (expected a run folder or a new path)")
    if (out_dir / CHECKPOINTS).is_symlink():
        # Listing, pruning and publishing never follow links (docs/design.md I13): through a link this
        # run would see no checkpoint, start fresh and write over the ones at the other end.
        raise RunFolderError(
            f"{out_dir / CHECKPOINTS} is a symbolic link (to {os.readlink(out_dir / CHECKPOINTS)}); checkpoints are never "
            f"followed through links. Put the whole run folder on the other disk instead (out_dir=<a folder there>); "
            f"nothing was written")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    if path.is_symlink():
        raise RunFolderError(f"{path} is a symbolic link; refusing to follow it")
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


RUN_NAMES = (LOCK, STATUS, CONFIG, METRICS, CHECKPOINTS)
"""The names a run folder in the store holds (anything else there: not a run folder, refused)."""


def _acquire_remote(url: str, timeout_s: float) -> RunLock:
    """A run folder in the store: the bucket and credentials checked, the prefix holding nothing but a
    run folder's names, the store's conditional writes probed, then the lease; the staging copy filled."""
    run = RemotePath(url)
    store = run.store
    store.check()
    if run.key and store.head(run.key) is not None:
        raise RunFolderError(f"out_dir={url} is an object, not a run folder (expected a prefix that holds a run folder, or a new one)")
    base = f"{run.key}/" if run.key else ""
    others = sorted({k[len(base):].split("/")[0] for k in store.list(base)} - set(RUN_NAMES))
    others = [k for k in others if not k.startswith(".probe-")]
    if others:
        raise RunFolderError(f"out_dir={url} holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, which no run folder "
                             f"holds (a run folder has {', '.join(RUN_NAMES)}): another kind of data; use another prefix")
    store.probe_conditional_writes(run.key)
    lease = Lease(store, (run / LOCK).key).acquire(timeout_s)
    try:
        local = local_dir(url)
        local.mkdir(parents=True, exist_ok=True)
        for name in (STATUS, CONFIG, METRICS):  # the store's copy is the run's; a local one from another launch is stale
            got = store.get((run / name).key)
            if got is not None:
                atomic_write(local / name, got[0])
            else:
                (local / name).unlink(missing_ok=True)
    except BaseException:
        lease.release()
        raise
    _remote[local] = run
    return RunLock(local, -1, (), lease)


def acquire(out_dir: Path, timeout_s: float, poll_s: float = 0.2, name: str = LOCK) -> RunLock:
    """Take the run folder's lock (`name`: group_lock's), waiting up to `timeout_s` for its holder to leave.

    Raises RunFolderError naming the holder when it is still held after the wait, or when a run of
    the other kind (live recovery's groups, a plain run) holds the folder."""
    if is_url(out_dir):
        return _acquire_remote(str(out_dir), timeout_s)
    out_dir = Path(out_dir)
    created = _missing(out_dir)
    fd = _open_lock_file(out_dir, name)
    end, announced = time.monotonic() + timeout_s, None
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks: an I/O failure (exit 1)
                os.close(fd)
                raise Failed(f"{out_dir / LOCK}: cannot be locked ({e.strerror}); see docs/run_folder.md") from None
        holder = describe_holder(read_holder(out_dir, name))
        if time.monotonic() >= end:
            os.close(fd)
            raise RunFolderError(
                f"out_dir={out_dir} is held by {holder}: another run is using this folder "
                f"(waited {timeout_s:g} s, checkpoint.lock_timeout_s); stop it or use another out_dir")
        if holder != announced:
            log.warning("out_dir %s is held by %s; waiting up to %g s for it to finish", out_dir, holder, timeout_s)
            announced = holder
        time.sleep(poll_s)
    if (other := _other_kind(out_dir, name)) is not None:
        os.close(fd)
        raise RunFolderError(f"out_dir={out_dir} is used by {other}: one run per folder; stop it or use another out_dir")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "launch_id": os.environ.get(LAUNCH_ENV)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(out_dir, fd, created)


def read_metrics(out_dir: Path) -> list[dict]:
    """Every line of OUT/metrics.jsonl, parsed; RunFolderError naming the file and line when one is not JSON."""
    path, rows = Path(out_dir) / METRICS, []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RunFolderError(f"{path}: cannot be read ({e})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise RunFolderError(f"{path}:{lineno}: not a metrics line ({e})") from None
    return rows


def write_status(out_dir: Path, outcome: str, step: int | None = None, cause: str | None = None) -> dict:
    """Replace OUT/status.json atomically (the lock holder only). `outcome` is "running" or one of
    common.outcome's; the state a person reads is the outcome, with bad input and a peer's failure
    shown as "failed" (the outcome and its exit code say which)."""
    state = "failed" if outcome in ("bad_input", "peer_failed") else outcome
    code = None if outcome == "running" else exit_code(outcome)
    record = {"state": state, "outcome": outcome, "step": step, "exit_code": code, "cause": cause,
              "launch_id": os.environ.get(LAUNCH_ENV), "pid": os.getpid(), "host": socket.gethostname(),
              "updated_unix": round(time.time(), 3)}
    atomic_write(Path(out_dir) / STATUS, json.dumps(record, indent=1) + "\n")
    if (run := _remote.get(Path(out_dir))) is not None:  # a run folder in the store: the status goes there at once
        try:
            run.store.put((run / STATUS).key, (json.dumps(record, indent=1) + "\n").encode())
        except (StoreError, StoreRefused) as e:  # the run's own outcome stands; its record in the store is stale
            log.warning("%s: the status could not be written to the store (%s); the local copy %s has it", run, e, out_dir)
    return record


UNTRAINED = {LOCK, STATUS, CONFIG, METRICS, CHECKPOINTS}
"""What a launch that never trained a step can have left in a folder it created (empty files and folders)."""


def _not_untrained(out: Path) -> list[str]:
    """What in a run folder a launch that never trained cannot have left: any other name, a metrics
    line, anything under checkpoints/."""
    found = []
    for p in out.iterdir():
        if p.name not in UNTRAINED or p.is_symlink():
            found.append(p.name)
        elif p.name == METRICS and (not p.is_file() or p.stat().st_size):
            found.append(p.name)
        elif p.name == CHECKPOINTS and (not p.is_dir() or any(p.iterdir())):
            found.append(p.name)
    return sorted(found)


def finish(lock: RunLock, outcome: str, step: int | None = None, cause: str | None = None) -> None:
    """How the run ended, in OUT/status.json (the lock holder, before it releases the lock). A launch
    refused for bad input before it trained a step, in a folder it created itself, takes back what it
    made instead (the lock, the status, the empty folders): the corrected command starts afresh, and
    `ls runs/` shows no run that never was. A folder that existed before, or holds anything a
    trained step writes (a checkpoint, a metrics line) or anything else, is never removed; one this
    launch made but must keep is said."""
    out = lock.out_dir
    if outcome == "bad_input" and lock.created:
        others = _not_untrained(out)
        if not others:
            for name in (LOCK, STATUS, CONFIG, METRICS):
                (out / name).unlink(missing_ok=True)
            for folder in (out / CHECKPOINTS, *lock.created):
                try:
                    folder.rmdir()
                except OSError:  # not there, or not empty (another launch's run beside it in a parent): kept
                    pass
            return
        log.warning("kept %s although this launch made it and was refused: it holds %s", out, ", ".join(others))
    write_status(out, outcome, step, cause)


def read_status(out_dir: Path) -> dict | None:
    try:
        record = json.loads((Path(out_dir) / STATUS).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RunFolderError(f"{Path(out_dir) / STATUS}: cannot be read ({e})") from None
    if not isinstance(record, dict) or "state" not in record:
        raise RunFolderError(f"{Path(out_dir) / STATUS}: not a status record")
    return record


def wait_until_free(out_dir: Path, timeout_s: float) -> bool:
    """True once nobody holds the run folder's lock (taken and released at once); False on timeout.
    A launcher uses it so that workers that outlived their torchrun finish their save first. A run
    folder in the store (a command's copy of it) is free once its lease is gone or expired."""
    if (run := _fetched.get(Path(out_dir))) is not None:
        end = time.monotonic() + timeout_s
        while True:
            head = run.store.head((run / LOCK).key)
            if head is None or head.age_s > max(Lease(run.store, "").ttl_s, 1) + 1:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.5)
    path = Path(out_dir) / LOCK
    if not path.is_file():
        return True
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    end = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.lockf(fd, fcntl.LOCK_UN)
                return True
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() >= end:
                    return False
                time.sleep(0.1)
    finally:
        os.close(fd)


def take(out_dir: Path, timeout_s: float, comm, name: str = LOCK) -> RunLock | None:
    """Global rank 0 locks `out_dir` before anything touches it (docs/design.md I12) and records the
    run as running; every rank learns the outcome (`comm`: the run's runtime), so all of them refuse
    together when another run holds the folder. Returns rank 0's lock (None elsewhere)."""
    lock, outcome = None, None
    if comm.is_main:
        try:
            lock = acquire(out_dir, timeout_s, name=name)
            write_status(lock.out_dir, "running")
        except (BadInput, Failed, OSError) as e:  # a held folder or a bad path: 2; I/O (read-only, permission, EIO): 1
            outcome = (describe_os_error(e) if isinstance(e, OSError) else str(e), outcome_of(e) == "bad_input")
    outcome = comm.broadcast(outcome)
    if outcome:
        if lock is not None:
            lock.release()
        raise RunFolderError(outcome[0]) if outcome[1] else Failed(outcome[0])
    return lock
