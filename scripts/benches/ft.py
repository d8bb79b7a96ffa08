"""Live recovery (docs/fault_tolerance.md) against the disk path: a group's death to the survivors' next
committed step against the same world's restart and resume, the steps computed twice, the quorum's
price per step, and a heal against a local checkpoint's load."""
from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import section
from .helpers import ROOT

AIMS = {
    "death to the next committed step / restart and resume": ("<=", 0.2),
    "steps per second, ft / without": (">=", 0.9),
}
SHAPE = ["--config", "configs/tiny.yaml", "train.global_batch=48", "dist.reduce=canonical", "runtime.threads=1", "log.progress=false", "log.every=1000"]
"""configs/tiny.yaml's model (about 1M parameters, 128 positions) on the built-in corpus, the CPU's size; a global batch of 48
(6 micro-batches of 8) that 2 and 3 processes divide."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def _last(out: Path) -> int:
    rows = _lines(out)
    return rows[-1]["step"] if rows else 0


def _wait(predicate, timeout: float = 600, every: float = 0.005) -> float:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("bench ft: timed out")
        time.sleep(every)
    return time.monotonic()


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _rate(out: Path, first: int, last: int) -> float:
    """Steps per second between two logged steps (elapsed_s: everything, the quorum included)."""
    rows = {r["step"]: r for r in _lines(out)}
    return (last - first) / (rows[last]["elapsed_s"] - rows[first]["elapsed_s"])


def ft_rows(work: Path, quick: bool) -> list[dict]:
    py, steps, cache = sys.executable, 60 if quick else 120, work / "cache"
    base = [*SHAPE, f"data.cache_dir={cache}", f"train.steps={steps}", "checkpoint.interval=20"]
    subprocess.run([py, "train.py", *base, "train.steps=1", f"out_dir={work / 'warm'}"], cwd=ROOT, check=True, capture_output=True)
    port = _port()
    house = _start([py, "-m", "runtime.lighthouse", "--port", str(port), "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "3000"],
                   work / "lighthouse.log")
    ft = [f"ft.lighthouse=127.0.0.1:{port}", "ft.timeout_s=10"]
    rows: list[dict] = []
    try:
        # the quorum's price: 2 groups of one process against torchrun's 2 processes, the same steps
        plain, live = work / "plain", work / "live"
        subprocess.run([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *base, f"out_dir={plain}"],
                       cwd=ROOT, check=True, capture_output=True)
        procs = [_start([py, "train.py", *base, *ft, "ft.groups=2", f"ft.group={g}", f"out_dir={live}"], work / f"live{g}.log")
                 for g in range(2)]
        for p in procs:
            p.wait(timeout=900)
        a, b = 10, steps
        without, with_ft = _rate(plain, a, b), _rate(live, a, b)
        rows.append({"row": "live recovery, no fault, 2 groups of 1 process", "what": "steps per second, ft / without",
                     "value": with_ft / without, "aim": "steps per second, ft / without",
                     "detail": f"{with_ft:.2f} vs {without:.2f} steps/s (torchrun, 2 processes), steps {a}..{b}"})

        # a group's death: 3 groups; group 2 SIGKILLed once the log is at step 30 + a few
        dead = work / "dead"
        procs = [_start([py, "train.py", *base, *ft, "ft.groups=3", f"ft.group={g}", f"out_dir={dead}"], work / f"dead{g}.log")
                 for g in range(3)]
        _wait(lambda: _last(dead) >= 33, every=0.01)
        at = _last(dead)
        t_kill = time.monotonic()
        procs[2].send_signal(signal.SIGKILL)
        t_next = _wait(lambda: _last(dead) > at)
        recovered = t_next - t_kill
        relaunch = _start([py, "train.py", *base, *ft, "ft.groups=3", "ft.group=2", f"out_dir={dead}"], work / "dead2b.log")
        for p in [*procs[:2], relaunch]:
            p.wait(timeout=900)
        left = re.search(r"ft: step (\d+): groups \[0, 1\] \(left: \[2\]\)", (work / "dead0.log").read_text())
        twice = max(0, at - int(left.group(1)))  # committed steps the survivors went back to ("ft: step N" asks for step N + 1)
        healed = re.search(r"healed from group \d+ at step \d+ in ([\d.]+)s", (work / "dead2b.log").read_text())
        loaded = re.search(r"loaded \S+: step \d+, ([\d.]+)s", (work / "dead2b.log").read_text())

        # the disk path: the same world (3 processes) stopped at the same step and started again from its checkpoint
        disk = work / "disk"
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "train.py", *base, f"out_dir={disk}"]
        subprocess.run([*torchrun, f"train.halt_at={at}"], cwd=ROOT, check=True, capture_output=True)
        ckpt = max(int(p.name.split("_")[1]) for p in (disk / "checkpoints").glob("step_*"))
        t0 = time.monotonic()
        proc = _start(torchrun, work / "disk.log")
        restart = _wait(lambda: _last(disk) > at, every=0.01) - t0
        proc.wait(timeout=900)
        rows.append({"row": "a group SIGKILLed (3 groups of 1 process)", "what": "death to the next committed step / restart and resume",
                     "value": recovered / restart, "aim": "death to the next committed step / restart and resume",
                     "detail": f"{recovered:.2f} s (the step under way done again without it; the Lighthouse's heartbeat timeout "
                               f"1 s) vs {restart:.2f} s for torchrun's 3 processes to start, resume from a checkpoint at step {ckpt} "
                               f"and step (the steps since the last periodic checkpoint not counted)"})
        rows.append({"row": "a group SIGKILLed: committed steps computed twice", "what": "steps computed again after the loss",
                     "value": float(twice), "aim": "",
                     "detail": f"live: {twice} (the survivors asked for step {int(left.group(1)) + 1} next; the step under way is done "
                               f"again, uncommitted); the disk path: {at - at // 20 * 20} at this kill (step {at}, the newest checkpoint "
                               f"of checkpoint.interval=20 at step {at // 20 * 20}), {20 / 2:g} on average"})
        if healed and loaded:
            rows.append({"row": "a relaunched group heals from a peer", "what": "seconds to heal / to load a local checkpoint",
                         "value": float(healed.group(1)) / float(loaded.group(1)), "aim": "",
                         "detail": f"{float(healed.group(1)):.3f} s (the state over HTTP, verified) vs {float(loaded.group(1)):.3f} s "
                                   f"(the same launch's load of the newest checkpoint before it, verified: a launch's first, DCP's "
                                   f"imports in it, as every restart's is)"})
    finally:
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    return rows


@section("ft", order=220, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    return ft_rows(work, a.quick)

