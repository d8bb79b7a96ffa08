"""Precomputed tables (objectives/tables.py; docs/dpo.md, "The table"): built in chunks each
published atomically, so that a stop keeps what was computed and the table's bits do not depend on
how many stops it took; hashed in a manifest of their own and verified on every read, a damaged
chunk logged and computed again."""
from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import numpy as np
import pytest

import launch
from objectives import tables
from test_dpo import base, pairs, write

SLOW = "tests/slow_table_train.py"


def table_of(cache: Path) -> Path:
    (folder,) = (p for p in cache.rglob("*.ref-*") if p.is_dir())
    return folder


def files_of(folder: Path) -> dict[str, str]:
    """Every file of a table folder, by name, with its sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def listed(cache: Path) -> int:
    """How many chunks the table's manifest lists (0 before it exists)."""
    import json

    try:
        return len(json.loads((table_of(cache) / tables.MANIFEST).read_text())["chunks"])
    except (ValueError, OSError):
        return 0


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("tables") / "dpo.jsonl", pairs())


@pytest.mark.e2e
def test_a_precompute_stopped_twice_by_sigterm_continues_from_its_chunks_to_the_uninterrupted_runs_table_and_bits(prefs, tmp_path):
    args = ["--config", "configs/tiny.yaml", *base(prefs, tmp_path / "cache")]
    launch.run(0, *["--config", "configs/tiny.yaml", *base(prefs, tmp_path / "ref-cache")], f"out_dir={tmp_path / 'ref'}")
    want = files_of(table_of(tmp_path / "ref-cache"))
    assert len(want) == 1 + 4  # the manifest and 4 chunks (31 rows, 8 a chunk): the stops below fall between two
    for stop, at in enumerate((1, 3)):
        log = tmp_path / f"stop{stop}.log"
        proc = launch.start(launch.command(0, *args, f"out_dir={tmp_path / 'run'}", script=SLOW), log, env={"SLOW_TABLE_S": "0.25"})
        launch.wait_for(lambda: listed(tmp_path / "cache") >= at, proc=proc)  # noqa: B023
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75, log.read_text()[-3000:]
        assert 0 < listed(tmp_path / "cache") < 4, log.read_text()[-3000:]  # stopped inside the precompute
        text = log.read_text()
        assert "Traceback" not in text and "exit 75" in text, text[-3000:]
        assert f"keeps the {listed(tmp_path / 'cache')} chunk(s) published, the next launch continues from them" in text, text[-3000:]
    kept = listed(tmp_path / "cache")
    proc = launch.run(0, *args, f"out_dir={tmp_path / 'run'}", script=SLOW, env={"SLOW_TABLE_S": "0.25"})
    assert f"train.dpo.precompute: {8 * kept} of the 31 rows the run reads verified" in proc.stderr, proc.stderr[-3000:]
    assert f"train.dpo.precompute: {31 - 8 * kept} of {31 - 8 * kept} rows computed" in proc.stderr, proc.stderr[-3000:]
    assert files_of(table_of(tmp_path / "cache")) == want  # the same bytes, chunk by chunk, manifest included
    launch.assert_identical(tmp_path / "run", tmp_path / "ref")


@pytest.mark.e2e
def test_a_damaged_chunk_or_manifest_of_the_dpo_table_is_named_computed_again_and_the_run_is_the_undamaged_ones(prefs, tmp_path):
    args = [*base(prefs, tmp_path / "cache"), "train.steps=2"]
    assert launch.in_process(*args, f"out_dir={tmp_path / 'a'}")[0] == 0
    folder = table_of(tmp_path / "cache")
    want = files_of(folder)
    chunk = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors")[1]
    data = bytearray(chunk.read_bytes())
    data[-3] ^= 0x10  # one bit of a logged figure: the file still parses
    chunk.write_bytes(bytes(data))
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'b'}")
    assert code == 0, err[-3000:]
    assert f"{chunk.name} is damaged (its sha256" in err and "its rows are computed again" in err, err[-3000:]
    assert files_of(folder) == want
    launch.assert_identical(tmp_path / "b", tmp_path / "a")
    (folder / tables.MANIFEST).write_text("{not json")
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'c'}")
    assert code == 0 and f"{tables.MANIFEST} is damaged" in err and "the whole table is computed again" in err, err[-3000:]
    assert files_of(folder) == want
    launch.assert_identical(tmp_path / "c", tmp_path / "a")


class OneRank:
    """The collectives of one process (tables.precompute's `rt`)."""

    rank, world_size, is_main = 0, 1, True

    def all_gather(self, obj):
        return [obj]


def agree(phase, error):
    if error is not None:
        raise error


class Stop(BaseException):
    """A stand-in for StopDuringSetup (a BaseException, raised where the process is)."""


@pytest.mark.unit
def test_the_helper_keeps_published_chunks_across_a_stop_computes_only_the_rest_and_writes_the_same_bytes(tmp_path):
    empty = {"v": np.zeros((0, 3), np.float32), "i": np.zeros((0, 3), np.uint16)}
    needed = np.arange(5, 5 + 40, dtype=np.int64)
    calls: list[int] = []

    def compute(r: int, stop_at: int | None = None) -> dict:
        if stop_at is not None and len(calls) == stop_at:
            raise Stop()
        calls.append(r)
        n = 1 + r % 3  # a row's items: 1 to 3
        return {"v": np.full((n, 3), r / 7, np.float32), "i": np.full((n, 3), r, np.uint16)}

    whole = tables.precompute(tables.TableFiles(tmp_path / "whole.ref-x"), needed, compute, empty, OneRank(), True, agree, "t", ".ref-")
    assert sorted(calls) == needed.tolist()
    files = tables.TableFiles(tmp_path / "stopped.ref-x")
    for stop_at in (11, 13):  # 8 rows a chunk: the first stop keeps 1 chunk, the second 1 more
        calls.clear()
        with pytest.raises(Stop):
            tables.precompute(files, needed, lambda r: compute(r, stop_at), empty, OneRank(), True, agree, "t", ".ref-")  # noqa: B023
    calls.clear()
    got = tables.precompute(files, needed, compute, empty, OneRank(), True, agree, "t", ".ref-")
    assert calls == needed[16:].tolist()  # the two published chunks' rows were not computed again
    assert files_of(files.folder) == files_of(tmp_path / "whole.ref-x")
    assert got.rows.tolist() == whole.rows.tolist() and got.offsets.tolist() == whole.offsets.tolist()
    assert all(np.array_equal(got.fields[k], whole.fields[k]) for k in empty)
    # A flipped bit in a chunk: that chunk's rows, and only them, computed again; the same bytes after.
    chunk = sorted(files.folder.glob("*.safetensors"))[2]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 1
    chunk.write_bytes(bytes(data))
    calls.clear()
    tables.precompute(files, needed, compute, empty, OneRank(), True, agree, "t", ".ref-")
    assert calls == needed[16:24].tolist()
    assert files_of(files.folder) == files_of(tmp_path / "whole.ref-x")


@pytest.mark.e2e
def test_a_precompute_stopped_on_two_processes_continues_on_one_to_the_one_process_runs_table_and_bits(prefs, tmp_path):
    """The chunks are a function of the rows the run reads, not of the world size: a round of two
    chunks published by two ranks is the one process's first two chunks."""
    args = ["--config", "configs/tiny.yaml", *base(prefs, tmp_path / "cache")]
    launch.run(0, *["--config", "configs/tiny.yaml", *base(prefs, tmp_path / "ref-cache")], f"out_dir={tmp_path / 'ref'}")
    log = tmp_path / "two.log"
    proc = launch.start(launch.command(2, *args, f"out_dir={tmp_path / 'run'}", script=SLOW, launcher="runtime.launch"), log,
                        env={"SLOW_TABLE_S": "0.25"})
    launch.wait_for(lambda: listed(tmp_path / "cache") >= 1, proc=proc, timeout=200)
    launch.kill_tree(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]  # the launcher's code for a stop
    text = log.read_text()
    assert text.count("exit 75 (resume me)") == 2 and "Traceback" not in text, text[-3000:]
    kept = listed(tmp_path / "cache")
    assert 0 < kept < 4
    proc = launch.run(0, *args, f"out_dir={tmp_path / 'run'}")
    assert f"{8 * kept} of the 31 rows the run reads verified" in proc.stderr, proc.stderr[-3000:]
    assert files_of(table_of(tmp_path / "cache")) == files_of(table_of(tmp_path / "ref-cache"))
    launch.assert_identical(tmp_path / "run", tmp_path / "ref")
