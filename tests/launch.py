"""Launching train.py the way users do (torchrun or plain python) and reading what a run left."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TIMEOUT = 300  # no launch may hang a test run


def command(nproc: int, *overrides: str, script: str = "train.py") -> list[str]:
    """`python train.py` for nproc=0, else `torchrun --standalone --nproc_per_node=nproc train.py`."""
    if nproc == 0:
        return [PY, script, *overrides]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *overrides]


def run(nproc: int, *overrides: str, expect: int | None = 0, env: dict | None = None, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """Run train.py to completion; assert its exit code (None: don't)."""
    proc = subprocess.run(command(nproc, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if expect is not None and proc.returncode != expect:
        raise AssertionError(f"exit {proc.returncode}, expected {expect}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in metrics(out)]


def inspect(path: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from checkpoint.__main__ import inspect_path

    return inspect_path(Path(path))
