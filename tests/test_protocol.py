"""The failure protocol and the one exit-code policy (docs/design.md I9, I16; docs/run_folder.md):
whichever rank fails, wherever, every rank ends with the same code and names the failing rank and
its error. The multi-process tests assert on a rank other than the failing one, so that none can
pass because torchrun killed the others; each launch is bounded well below dist.timeout_s, so a
rank left waiting in a collective fails the test."""
import json
import re
import subprocess

import pytest

import launch
from checkpoint import storage
from common.outcome import EXIT_CODES, BadInput, RankFailed, Stopped, exit_code, outcome_of
from run.protocol import Protocol
from runtime.board import Board

BOUND_S = 90  # far below dist.timeout_s (300 below): a rank that waited for it would fail the launch


class TwoRanks:
    """Rank 0 of a world of two whose other rank reports `theirs` (its error's outcome and message, or None)."""

    rank, world_size = 0, 2

    def __init__(self, theirs=None, their_stop=False):
        self.theirs, self.their_stop = theirs, their_stop
        self.board = Board(None, "test")

    def sum(self, values):
        return [values[0] + float(self.their_stop), values[1] + float(self.theirs is not None)]

    def all_gather(self, obj):
        return [obj, None if self.theirs is None else (*self.theirs, 1)]  # (outcome, message, the rank it was)


@pytest.mark.unit
def test_one_function_maps_every_ending_to_its_code():
    assert EXIT_CODES == {"finished": 0, "halted": 0, "stopped": 75, "bad_input": 2, "failed": 1, "peer_failed": 1}
    assert outcome_of(None) == "finished" and outcome_of(Stopped("SIGTERM")) == "stopped"
    assert outcome_of(BadInput("x")) == "bad_input" and outcome_of(OSError(28, "full")) == "failed"
    assert outcome_of(RuntimeError("a bug")) == "failed"
    # An agreed failure: bad input is bad input on every rank; any other failure is the failing rank's own, a peer's elsewhere.
    assert outcome_of(RankFailed(1, "bad_input", "x"), 0) == outcome_of(RankFailed(1, "bad_input", "x"), 1) == "bad_input"
    assert outcome_of(RankFailed(1, "failed", "x"), 1) == "failed" and outcome_of(RankFailed(1, "failed", "x"), 0) == "peer_failed"
    assert [exit_code(o) for o in ("finished", "stopped", "bad_input", "failed", "peer_failed", "unknown")] == [0, 75, 2, 1, 1, 1]


@pytest.mark.unit
def test_a_boundary_raises_the_other_ranks_failure_on_this_rank_and_a_stop_vote_stops_both():
    assert Protocol(TwoRanks()).boundary(stop=False, error=None) is False
    assert Protocol(TwoRanks(their_stop=True)).boundary(stop=False, error=None) is True  # the other rank's signal stops this one
    with pytest.raises(RankFailed) as e:
        Protocol(TwoRanks(("failed", "metrics.jsonl: No space left on device"))).boundary(stop=False, error=None)
    assert e.value.rank == 1 and e.value.describe(0) == "rank 1 failed during training: metrics.jsonl: No space left on device"
    with pytest.raises(RankFailed) as e:  # this rank's own failure, brought to the boundary, is raised here too
        Protocol(TwoRanks()).boundary(stop=False, error=OSError(28, "No space left on device", "metrics.jsonl"))
    assert e.value.rank == 0 and e.value.describe(0) == "metrics.jsonl: No space left on device"


@pytest.mark.unit
def test_a_stop_signal_after_the_outcome_is_settled_only_sets_the_flag_where_in_set_up_it_raises():
    """torchrun SIGTERMs the other ranks as soon as one exits (a refused relaunch: rank 0 exits 2
    first); a rank then writing its own status line must not raise StopDuringSetup there (a traceback
    under the one error line, CI run of 74e455f)."""
    import os
    import signal

    from run.stop import StopDuringSetup, StopFlag

    before = signal.getsignal(signal.SIGTERM)
    for settle in (False, True):
        stop = StopFlag()
        try:
            if settle:
                stop.settled()
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before kill returns
                assert stop.poll() and stop.signal == "SIGTERM"
            else:
                with pytest.raises(StopDuringSetup):
                    os.kill(os.getpid(), signal.SIGTERM)
        finally:
            stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.unit
def test_the_first_failure_posted_on_the_board_is_the_cause_the_others_read():
    comm = TwoRanks()
    ours, theirs = Protocol(comm), Protocol(comm)
    comm.rank = 1
    theirs.post("set-up", RuntimeError("the cause"))
    theirs.post("set-up", RuntimeError("an echo of it"))
    comm.rank = 0
    failure = ours.posted()
    assert failure.rank == 1 and failure.describe(0) == "rank 1 failed during set-up: RuntimeError: the cause"
    comm.rank = 1
    assert theirs.posted() is None  # a rank's own failure is not a peer's


@pytest.mark.unit
def test_generation_builds_no_autograd_graph_whatever_the_callers_mode():
    import torch

    from model import MiniMindLM, ModelConfig
    from model.generate import generate_ids

    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, vocab_size=64))
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return forward(*args, **kwargs)

    model.forward = spy
    assert torch.is_grad_enabled()
    generate_ids(model, [1, 2, 3], 5, temperature=0.0)
    assert seen and all(mode == (False, True) for mode in seen)


@pytest.mark.unit
def test_no_test_names_the_folder_this_repository_is_checked_out_in():
    """A test that asserts on this checkout's path (or its parent's) passes here and cannot fail on
    another machine: paths come from launch.ROOT and tmp_path."""
    literal = re.compile("[\"']({})[\"'/]".format("|".join(re.escape(str(p)) for p in (launch.ROOT, launch.ROOT.parent))))
    found = [f"{path.name}:{n}" for path in sorted((launch.ROOT / "tests").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, found


def two(*args, fault=None, fault_rank=0, timeout=BOUND_S, env=None):
    """A 2-process launch, bounded far below dist.timeout_s. torchrun's own exit code says only that a
    worker failed: each rank's outcome is in its last line ("...; exit N") and in status.json."""
    return launch.run(2, *args, "dist.timeout_s=300", expect=None, timeout=timeout,
                      script="tests/faults_train.py" if fault else "train.py",
                      env={**({"FAULT": fault, "FAULT_RANK": str(fault_rank)} if fault else {}), **(env or {})})


def last_line(stderr: str, rank: int) -> str:
    """The line a rank ends with (rank 0's lines carry no rank prefix)."""
    mine = [l for l in stderr.splitlines() if re.search(r"; exit \d+", l) and not l.startswith(("W1", "E1", "I1"))
            and (f"[rank {rank}]" in l if rank else "[rank " not in l)]
    assert mine, stderr[-3000:]
    return mine[-1]


@pytest.mark.e2e
def test_a_corpus_that_fails_to_tokenize_on_the_packer_ends_every_rank_with_2_naming_the_file_and_line(tmp_path, tiny):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine line"}\n{"text": "another"}\nnot json at all\n')
    proc = two(*tiny, f"data.path={bad}", f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}")
    line = last_line(proc.stderr, 1)
    assert f"rank 0 failed during packing: {bad}:3:" in line and line.endswith("exit 2"), line
    assert last_line(proc.stderr, 0).endswith("exit 2")
    assert not (tmp_path / "run").exists()  # refused before a step: the folder this launch made is taken back (run/folder.py finish)
    # No traceback through this repository's code (wherever it is checked out) before torchrun's own report.
    assert f'Traceback (most recent call last):\n  File "{launch.ROOT}' not in proc.stderr.split('Traceback (most recent call last):\n  File "<frozen runpy>')[0]
    assert not list((tmp_path / "cache").glob("bad-*.bin"))


@pytest.mark.e2e
def test_a_tokenizer_exception_of_its_own_type_while_packing_ends_every_rank_with_1_naming_it(tmp_path, tiny, corpus):
    proc = two(*tiny, f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}", fault="tokenizer")
    line = last_line(proc.stderr, 1)
    assert "rank 0 failed during packing: packing" in line and "RuntimeError: the tokenizer's own failure (injected)" in line, line
    assert line.endswith("exit 1") and last_line(proc.stderr, 0).endswith("exit 1")
    assert launch.lines(tmp_path / "run" / "metrics.jsonl") == 0


@pytest.mark.e2e
def test_a_full_disk_on_rank_0s_metrics_line_ends_every_rank_at_that_boundary_with_1(tmp_path, tiny):
    out = tmp_path / "run"
    proc = two(*tiny, "checkpoint.interval=2", f"out_dir={out}", fault="metrics")
    line = last_line(proc.stderr, 1)
    assert "rank 0 failed during training: metrics.jsonl: No space left on device; exit 1" in line, line
    assert launch.lines(out / "metrics.jsonl") == 2  # no rank trained past the step whose line failed
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1 and "No space left on device" in status["cause"]


@pytest.mark.e2e
def test_a_peer_failing_in_set_up_while_rank_0_packs_is_a_failure_not_a_stop_on_every_rank(tmp_path, tiny):
    out = tmp_path / "run"
    proc = two(*tiny, f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={out}", fault="setup", fault_rank=1)
    # Rank 0 was packing when torchrun stopped it for rank 1's failure: it names rank 1, and says 1, not 75.
    line = last_line(proc.stderr, 0)
    assert "rank 1 failed during set-up: RuntimeError: this rank's set-up failed (injected); exit 1" in line, line
    status = json.loads((out / "status.json").read_text())
    assert status["outcome"] == "peer_failed" and status["exit_code"] == 1
    code = subprocess.run([launch.PY, "-m", "checkpoint", "status", str(out), "--exit-code"], cwd=launch.ROOT, capture_output=True,
                          timeout=120).returncode
    assert code == 1


@pytest.mark.e2e
def test_a_cache_dir_under_a_regular_file_ends_the_launch_with_2_before_anything_starts(tmp_path, tiny):
    """Every rank refuses the config alike, before any of them talks to another (the first to leave
    is the one torchrun reports; it stops the others); scripts/train.sh refuses it before launching."""
    (tmp_path / "a-file").write_text("not a folder")
    args = [*tiny, f"data.cache_dir={tmp_path / 'a-file' / 'cache'}", f"out_dir={tmp_path / 'run'}"]
    proc = two(*args)
    assert "error: data.cache_dir: " in proc.stderr and "is a file" in proc.stderr and "exitcode  : 2" in proc.stderr
    assert not (tmp_path / "run").exists()
    script = subprocess.run(["bash", "scripts/train.sh", *args], cwd=launch.ROOT, capture_output=True, text=True, timeout=120)
    assert script.returncode == 2 and "data.cache_dir: " in script.stderr and "Traceback" not in script.stderr


@pytest.mark.e2e
def test_a_background_write_failing_on_rank_1_alone_stops_every_rank_at_the_next_boundary_naming_rank_1(tmp_path, tiny):
    out = tmp_path / "run"
    args = [*tiny, "dist.strategy=fsdp", "checkpoint.interval=2", "checkpoint.async=true", "train.steps=12", f"out_dir={out}"]
    proc = two(*args, fault="background", fault_rank=1)
    line = last_line(proc.stderr, 0)
    assert re.search(r"rank 1 failed during training: saving step 4: OSError: .*Input/output error \(injected\)", line), line
    assert [s for s, _ in storage.list_checkpoints(out / "checkpoints")] == [2] and not list((out / "checkpoints").glob(".tmp-*"))
    # Found at a boundary after the failed write (the one after step 4 or 5, or 6 on a loaded machine) or by
    # the save of step 6 that waits for it: never a later checkpoint, never a later step.
    assert 4 <= launch.lines(out / "metrics.jsonl") <= 6


@pytest.mark.unit
def test_a_rank_s_line_and_its_newline_go_out_in_one_write_so_two_ranks_lines_never_join(monkeypatch):
    """The ranks of a torchrun share its stderr, unbuffered on a pipe: a line written as its text and
    then its newline let another rank's line land between the two (a CI run: rank 1's last line and
    rank 0's joined, and rank 0's was no longer a line of its own)."""
    import logging
    import sys

    from runtime.logs import _TqdmAwareHandler, say

    writes = []

    class Stream:
        def write(self, s):
            writes.append(s)
            return len(s)

        def flush(self):
            pass

    handler = _TqdmAwareHandler(Stream())
    handler.setFormatter(logging.Formatter("[rank 1] %(message)s"))
    handler.emit(logging.LogRecord("x", logging.ERROR, __file__, 1, "rank 0 failed; exit %d", (1,), None))
    monkeypatch.setattr(sys, "stderr", Stream())
    say("reward did not return; exit 1")
    assert [w for w in writes if w] == ["[rank 1] rank 0 failed; exit 1\n", "reward did not return; exit 1\n"]


@pytest.mark.unit
def test_an_error_a_dataloader_worker_raised_is_said_in_its_own_one_line_not_the_workers_traceback():
    """torch raises a worker's error again in the trainer with the worker's traceback as its message (found by
    review: a store outage in a worker printed forty lines); the run says the error's own line."""
    from torch._utils import ExceptionWrapper

    from common.store import StoreError
    from run.protocol import describe

    said = "http://127.0.0.1:8333: GET s3://runs/c/cache/x.bin failed after 4 attempts (Could not connect to the endpoint URL)"
    try:
        raise StoreError(said)
    except StoreError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(StoreError) as e:
        wrapped.reraise()
    assert str(e.value).startswith("Caught StoreError in DataLoader worker process 0") and describe(e.value) == said
