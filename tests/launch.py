"""Launching train.py the way users do (torchrun or plain python) and reading what a run left."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TIMEOUT = 300  # no launch may hang a test run
STEP_LIMIT: int | None = None  # set for unit tests (conftest): the most steps in_process may train
SLOW_SAVE = "scripts/slow_save_train.py"  # train.py on a slow disk (every checkpoint file takes SLOW_SAVE_S longer)


def command(nproc: int, *overrides: str, script: str = "train.py", launcher: str = "torch.distributed.run",
            python: str = PY) -> list[str]:
    """`python train.py` for nproc=0, else `torchrun --standalone --nproc_per_node=nproc train.py`
    (or through `runtime.launch`, the scripts' launcher, which prints the run's outcome last);
    `python`: another interpreter (tests/test_torch_range.py's oldest torch)."""
    if nproc == 0:
        return [python, script, *overrides]
    return [python, "-m", launcher, "--standalone", f"--nproc_per_node={nproc}", script, *overrides]


def run(nproc: int, *overrides: str, expect: int | None = 0, env: dict | None = None, timeout: int = TIMEOUT,
        script: str = "train.py", launcher: str = "torch.distributed.run", python: str = PY) -> subprocess.CompletedProcess:
    """Run train.py (or a test double of it) to completion; assert its exit code (None: don't)."""
    proc = subprocess.run(command(nproc, *overrides, script=script, launcher=launcher, python=python), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if expect is not None and proc.returncode != expect:
        raise AssertionError(f"exit {proc.returncode}, expected {expect}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    from run import folder

    return folder.read_metrics(Path(out))


def sha_at(out: Path, step: int) -> str:
    """model_sha256 of a run's checkpoint at `step`, from its verified manifest."""
    return storage_manifest(out, step)["model_sha256"]


def storage_manifest(out: Path, step: int) -> dict:
    """The verified manifest of a run's checkpoint at `step`."""
    from checkpoint import storage

    return storage.verify(Path(out) / storage.CHECKPOINTS / storage.step_dir_name(step))


def assert_same_as_reference_at(out: Path, ref: Path, step: int | None = None) -> None:
    """`out` equals the uninterrupted `ref` up to `step` (default: out's newest checkpoint): every
    logged loss (and sample ids, when logged) and the weights' sha256 at that step."""
    step = step or inspect(out)["step"]
    got, want = [m for m in metrics(out) if m["step"] <= step], [m for m in metrics(ref) if m["step"] <= step]
    assert [m["step"] for m in got] == list(range(1, step + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert [m.get("sample_ids") for m in got] == [m.get("sample_ids") for m in want]
    assert sha_at(out, step) == sha_at(ref, step)


def assert_identical(out: Path, ref: Path) -> None:
    """`out` is the uninterrupted `ref`: the same steps, every logged loss (and sample ids, where
    logged) equal, and the newest checkpoint's model_sha256 equal."""
    got, want = metrics(out), metrics(ref)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert [m.get("sample_ids") for m in got] == [m.get("sample_ids") for m in want]
    assert inspect(out)["model_sha256"] == inspect(ref)["model_sha256"]


def fixture_bits_here(fixture: Path, args: list[str], out: Path, step: int = 2) -> bool:
    """Whether this machine computes the bits of a committed fixture run (tests/fixtures/): its
    config (`args`, with its own out_dir) run here from scratch to `step`, the weights compared with
    the fixture's at that step. Where they differ, a resume from the fixture cannot end on the bits
    of a run made here from scratch, whatever the loader does: the fixture's first steps were
    computed by another CPU. The suite's PORTABLE_KERNELS (tests/conftest.py) make an AVX2 and an
    AVX-512 machine agree, but not every CPU: on a Sapphire Rapids VM (AVX-512 with AMX) the
    fixtures' step-2 weights differ from this code's by 6e-8 under every MKL_CBWR setting (measured,
    the fixtures' own commit run there too). The tests then prove the resume against itself."""
    import torch

    from checkpoint import storage

    code, err = in_process(*[a for a in args if not a.startswith(("train.steps=", "out_dir="))], f"train.steps={step}", f"out_dir={out}")
    assert code == 0, err
    folders = [run / storage.CHECKPOINTS / storage.step_dir_name(step) for run in (fixture, out)]
    theirs, ours = (storage.read_tensors(f, storage.verify(f)) for f in folders)
    return theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)


def assert_same_state(a, b, where: str = "", ignore: frozenset[str] = frozenset()) -> None:
    """Two loaded resume files (or any nesting of dicts, lists and tensors) are equal leaf for leaf:
    the same keys on both sides (an empty optimizer state on one side fails), tensors equal in
    dtype, shape and every bit. `ignore`: dotted paths that may differ (e.g. "run_id")."""
    import torch

    if where in ignore:
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}" if where else str(k), ignore)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]", ignore)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in metrics(out)]


def inspect(path: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from cli.inspect import inspect_path

    return inspect_path(Path(path))


STARTED: list[subprocess.Popen] = []  # what start() launched; conftest kills what a failed test left running


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a launch in a session of its own, output to `log`."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    STARTED.append(proc)
    return proc


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def cmdline(pid: int) -> str:
    """A process's command line, "" once it has gone (a child may exit between listing and reading)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    out = []
    for c in children(pid):
        out += [c, *descendants(c)]
    return out


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def workers(agent_pid: int) -> list[int]:
    """torchrun's worker processes (its python children), sorted by pid = by local rank."""
    return sorted(p for p in children(agent_pid) if "train.py" in cmdline(p))


def kill_tree(pid: int, sig: int) -> None:
    """Signal a launcher and every process under it at once, as a node going away would.
    (torchrun starts its workers in sessions of their own: a process-group kill misses them.)"""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def wait_for(predicate, timeout: float = 120, every: float = 0.02, proc: subprocess.Popen | None = None) -> None:
    import time

    end = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launch exited ({proc.returncode}) before the condition held")
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(every)


def lines(path: Path) -> int:
    try:
        return len(Path(path).read_text().splitlines())
    except FileNotFoundError:
        return 0


def in_process(*overrides: str) -> tuple[int, str]:
    """`train.main()` in this process (world size 1): the same code path, without the launch cost;
    returns its exit code and what it wrote to stderr. Needs no per-test fixture, so session- and
    module-scoped fixtures can use it. Every resume property also has real launches."""
    import contextlib
    import io
    import logging

    sys.path.insert(0, str(ROOT))
    import train

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train.main(["--config", str(ROOT / "configs" / "tiny.yaml"), *overrides])
    logging.basicConfig(handlers=[logging.StreamHandler()], level=logging.WARNING, force=True)  # off the StringIO
    if STEP_LIMIT is not None:  # a unit test: count the steps the run folder logged
        outs = [o.split("=", 1)[1] for o in overrides if o.startswith("out_dir=")]
        trained = lines(Path(outs[-1]) / "metrics.jsonl") if outs else 0
        assert trained <= STEP_LIMIT, f"a unit test trained {trained} steps in process (at most {STEP_LIMIT}): mark it e2e"
    return code, err.getvalue()


def once(root: Path, name: str, build) -> Path:
    """`root / name`, built by `build(path)` once for the whole test run: the pytest-xdist workers
    share it (the first to need it builds it under a file lock in the run's common temporary folder,
    the others wait for it and read it). Tests only read what it returns."""
    import fcntl
    import shutil

    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or its holder dies)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that died mid-build left it
            build(out)
            done.touch()
    return out


def shared_root(tmp_path_factory, worker_id: str) -> Path:
    """The temporary folder every pytest-xdist worker of this test run sees."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if worker_id != "master" else root
