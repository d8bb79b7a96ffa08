"""Corpora of any size (docs/data.md): many files read as one, packing outside every collective
timeout, packing ahead of time, launches that trust a file's identity instead of rereading it, and
an epoch order in constant memory."""
import contextlib
import gzip
import io
import json
import os
import random
import re
import threading
import time

import numpy as np
import pytest

import launch
from data import DataError, pack, sources
from runtime.board import Board, Heartbeat, Stalled, wait_for
from data import prepare
from data.sampler import BatchPlan, BijectiveOrder, BlockDistributedSampler, make_order

WORDS = "the a of river stone light under over quiet bright cold warm song road night".split()
GOLDEN_10 = [6, 9, 5, 1, 3, 8, 4, 0, 7, 2]  # BijectiveOrder(10, 1337), recorded when the order was written
GOLDEN_1000 = [623, 31, 901, 883, 540]  # BijectiveOrder(1000, 0).take(500, 5)
HOUR_AGO = time.time() - 3600  # a file this old is trusted by its identity (data/prepare.py RACY_NS)


def documents(n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    return [json.dumps({"text": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 40)))}) + "\n" for _ in range(n)]


@pytest.fixture()
def split(tmp_path):
    """The same 900 documents as one file and as three (one gzip-compressed) in a directory, named
    so that name order is not creation order."""
    lines = documents(900, 1)
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(lines))
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "c_last.jsonl").write_text("".join(lines[600:]))
    with gzip.open(folder / "b_middle.jsonl.gz", "wt") as f:
        f.write("".join(lines[300:600]))
    (folder / "a_first.jsonl").write_text("".join(lines[:300]))
    return whole, folder


@pytest.mark.e2e
def test_a_directory_and_a_glob_train_bit_identically_to_their_files_concatenated_in_name_order(split, tiny, tmp_path):
    whole, folder = split
    runs = {}
    for name, path in (("file", whole), ("dir", folder), ("glob", f"{folder}/*.jsonl*")):
        out = tmp_path / name
        code, err = launch.in_process(*tiny, f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4",
                                      f"out_dir={out}")
        assert code == 0, err
        runs[name] = ([m["loss"] for m in launch.metrics(out)], launch.sha_at(out, 4))
    assert runs["dir"] == runs["file"] and runs["glob"] == runs["file"]
    bins = sorted((tmp_path / "cache").glob("*.bin"))
    assert len(bins) == 3 and len({b.read_bytes() for b in bins}) == 1  # three caches, one packed stream


@pytest.mark.e2e
def test_each_file_of_a_corpus_is_in_the_fingerprint_and_a_resume_refuses_a_change_naming_the_file(split, tiny, tmp_path):
    _, folder = split
    run = [*tiny, f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}"]
    assert launch.in_process(*run, "train.steps=2")[0] == 0
    fingerprint = json.loads((tmp_path / "cache" / next((tmp_path / "cache").glob("*.json")).name).read_text())
    assert list(fingerprint["files"]) == ["a_first.jsonl", "b_middle.jsonl.gz", "c_last.jsonl"]
    (folder / "d_new.jsonl").write_text("".join(documents(10, 2)))
    code, err = launch.in_process(*run, "train.steps=3")
    assert code == 2 and "d_new.jsonl is new since the checkpoint" in err and "Traceback" not in err
    (folder / "d_new.jsonl").unlink()
    (folder / "a_first.jsonl").write_text("".join(documents(300, 3)))
    code, err = launch.in_process(*run, "train.steps=3")
    assert code == 2 and "a_first.jsonl changed since the checkpoint" in err


@pytest.mark.e2e
def test_a_second_launch_trusts_the_files_identity_and_verify_source_full_reads_them_again(tiny, tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(documents(700, 4)))
    os.utime(src, (HOUR_AGO, HOUR_AGO))
    common = [*tiny, f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2"]
    assert launch.in_process(*common, f"out_dir={tmp_path / 'a'}")[0] == 0
    # Other bytes under the same size, mtime and inode: only a reread can notice.
    inode = os.stat(src).st_ino
    with open(src, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(data.replace(b"river", b"ocean"))
    os.utime(src, (HOUR_AGO, HOUR_AGO))
    assert os.stat(src).st_ino == inode and os.stat(src).st_size == len(data)
    assert launch.in_process(*common, f"out_dir={tmp_path / 'b'}")[0] == 0
    assert [m["loss"] for m in launch.metrics(tmp_path / "b")] == [m["loss"] for m in launch.metrics(tmp_path / "a")]
    assert launch.sha_at(tmp_path / "b", 2) == launch.sha_at(tmp_path / "a", 2)  # the packed bytes of the first launch
    code, err = launch.in_process(*common, f"out_dir={tmp_path / 'a'}", "train.steps=3", "data.verify_source=full")
    assert code == 2 and "data source_sha256 is" in err and str(src) in err  # a resume on the changed bytes: refused
    assert launch.in_process(*common, f"out_dir={tmp_path / 'c'}", "data.verify_source=full")[0] == 0
    assert [m["loss"] for m in launch.metrics(tmp_path / "c")] != [m["loss"] for m in launch.metrics(tmp_path / "a")]


@pytest.mark.unit
def test_a_file_modified_just_before_it_was_hashed_is_hashed_again(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(documents(50, 5)))
    _, meta = pack(src, 16, tmp_path / "cache")
    with open(src, "r+b") as f:  # same size, same second: a coarse mtime may not move
        data = f.read()
        f.seek(0)
        f.write(data.replace(b"stone", b"slate"))
    st = meta["sources"][0]["identity"]
    os.utime(src, ns=(st["mtime_ns"], st["mtime_ns"]))
    _, again = pack(src, 16, tmp_path / "cache")
    assert again["source_sha256"] != meta["source_sha256"]


@pytest.mark.e2e
def test_pack_ahead_then_the_trainer_uses_that_cache(tiny, tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(documents(700, 6)))
    os.utime(src, (HOUR_AGO, HOUR_AGO))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert prepare.main([str(src), "--seq-len", "32", "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = out.getvalue()
    assert re.search(r"1 file\(s\), 700 documents, [\d,]+ tokens, [\d,]+ samples \(samples of 33 tokens\) .* MB/s\)", summary), summary
    [fingerprint] = (tmp_path / "cache").glob("*.json")
    stamp = fingerprint.stat().st_mtime_ns
    assert launch.in_process(*tiny, f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1",
                             f"out_dir={tmp_path / 'run'}")[0] == 0
    assert fingerprint.stat().st_mtime_ns == stamp and len(list((tmp_path / "cache").glob("*.bin"))) == 1


def bad_corpus(kind: str, d):
    """A corpus of the given kind of bad input under folder `d`: the `data.path` that names it."""
    if kind == "glob":
        return f"{d}/nothing-*.jsonl"
    folder = d / kind
    folder.mkdir()
    if kind == "mixed":
        (folder / "a.jsonl").write_text(documents(3, 0)[0])
        (folder / "notes.txt").write_text("x")
    elif kind == "unparsable":
        (folder / "a.jsonl").write_text("".join(documents(5, 0)))
        (folder / "b.jsonl").write_text(documents(1, 0)[0] + "{oops\n")
    elif kind == "truncated":
        (folder / "a.jsonl.gz").write_bytes(gzip.compress("".join(documents(200, 0)).encode())[:-40])
    return folder


@pytest.mark.unit
@pytest.mark.parametrize("kind, named", [
    ("empty", "is empty"), ("glob", "matches no file"), ("mixed", "notes.txt: not a .jsonl or .jsonl.gz file"),
    ("unparsable", "b.jsonl:2: line is not valid JSON"), ("truncated", "a.jsonl.gz: a truncated or damaged gzip file"),
])
def test_bad_corpora_exit_2_naming_the_file_with_nothing_in_the_cache(tiny, tmp_path, kind, named):
    path = bad_corpus(kind, tmp_path)
    code, err = launch.in_process(*tiny, f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}")
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not [p for p in (tmp_path / "cache").glob("*") if p.suffix in (".bin", ".json", ".npy")]


@pytest.mark.unit
def test_a_file_that_changes_while_it_is_packed_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(documents(100, 7)))
    real = sources.parse_line

    def appending(path, lineno, raw):  # another program appends while the packer reads
        if lineno == 50:
            with open(src, "a") as f:
                f.write(documents(1, 8)[0])
        return real(path, lineno, raw)

    monkeypatch.setattr(sources, "parse_line", appending)
    with pytest.raises(DataError, match="c.jsonl: the file changed while it was being packed"):
        pack(src, 16, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*"))


@pytest.mark.unit
def test_waiters_get_the_packers_outcome_and_fail_at_once_when_it_fails_or_stops_beating(tmp_path):
    board = Board(None, "test")  # one process: the board is a dict; on a launch it is the c10d store

    def packer(key, outcome, seconds):
        with Heartbeat(board, key, every_s=0.05) as beat:
            for i in range(10):
                beat.progress(i, 10)
                time.sleep(seconds / 10)
            beat.finish(outcome)

    for key, outcome in (("ok", {"bin": "x.bin", "meta": {}}), ("bad", {"error": "c.jsonl:3: line is not valid JSON", "outcome": "bad_input"})):
        t = threading.Thread(target=packer, args=(key, outcome, 1.0))
        t.start()
        # the packer takes 1 s, twice stall_s: the waiter gets its outcome because the heartbeat moves
        assert wait_for(board, key, 0.5, "the packer", me=1, poll_s=0.02) == outcome
        t.join()
    board.set("stuck", {"state": "working", "beat": 7, "host": "h", "pid": 1})
    with pytest.raises(Stalled, match="made no progress for 0.3 s"):
        wait_for(board, "stuck", 0.3, "the packer", me=1, poll_s=0.02)
    board.post_failure({"rank": 2, "outcome": "failed", "message": "rank 2's disk is gone", "phase": "set-up"})
    with pytest.raises(Exception, match="rank 2's disk is gone"):  # another rank's failure ends the wait at once
        wait_for(board, "stuck", 60, "the packer", me=1, poll_s=0.02)


@pytest.mark.e2e
def test_a_pack_longer_than_the_collective_timeout_succeeds_on_two_processes(tiny, tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(documents(700, 9)))
    # tests/slow_pack_train.py: train.py whose packer reads from a slow file system (4 s a batch, no CPU)
    proc = launch.run(2, *tiny, f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2", "dist.timeout_s=2",
                      "checkpoint.lock_timeout_s=1", f"out_dir={tmp_path / 'run'}", script="tests/slow_pack_train.py")
    seconds = float(re.search(r"packed .*, ([\d.]+) s\n", proc.stderr).group(1))
    assert seconds > 2, f"the pack took {seconds} s: not longer than dist.timeout_s, the test proves nothing"
    assert len(launch.metrics(tmp_path / "run")) == 2


@pytest.mark.unit
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 97, 127, 128, 129, 1000, 1024, 4099, 65_536, 100_003])
def test_the_bijective_order_is_a_permutation_for_any_n(n):
    for key in (0, 1337):
        order = BijectiveOrder(n, key)
        every = np.array(order.take(0, n))
        assert np.array_equal(np.sort(every), np.arange(n))
        assert order.take(n // 2, min(5, n - n // 2)) == every[n // 2: n // 2 + 5].tolist()  # any position at once
    if n >= 16:
        assert BijectiveOrder(n, 1).take(0, n) != BijectiveOrder(n, 2).take(0, n)  # keyed: each epoch its own


@pytest.mark.unit
def test_the_bijective_order_is_keyed_by_seed_plus_epoch_and_pinned_across_releases():
    # A resume after an upgrade must see the same order: these values are the formula's, not recomputed.
    assert BijectiveOrder(10, 1337).take(0, 10) == GOLDEN_10
    assert BijectiveOrder(1000, 0).take(500, 5) == GOLDEN_1000
    for epoch in (0, 1, 5):
        assert make_order("bijective", 1000, 1337 - epoch, epoch).take(0, 1000) == BijectiveOrder(1000, 1337).take(0, 1000)
    assert make_order("bijective", 1000, 1337, 0).take(0, 1000) != make_order("bijective", 1000, 1337, 1).take(0, 1000)


@pytest.mark.unit
def test_the_bijective_order_holds_no_per_sample_state_at_a_billion_samples():
    order = make_order("bijective", 10**9, 1337, 3)
    batch = order.take(900_000_000, 64)
    assert len(set(batch)) == 64 and all(0 <= i < 10**9 for i in batch)
    sampler = BlockDistributedSampler(10**9, BatchPlan(64, 8, 2), 1, 1337, "bijective")
    assert sampler.step_indices(3) == sampler.order().take(3 * 64, 64)


@pytest.mark.e2e
def test_bijective_halted_on_two_processes_and_resumed_on_one_equals_the_uninterrupted_run(tiny, tmp_path):
    bij = [*tiny, "data.order=bijective", "dist.reduce=canonical", "train.steps=8", "log.sample_ids=true"]
    assert launch.in_process(*bij, f"out_dir={tmp_path / 'ref'}")[0] == 0
    launch.run(2, *bij, "train.halt_at=3", f"out_dir={tmp_path / 'run'}")
    assert launch.in_process(*bij, f"out_dir={tmp_path / 'run'}")[0] == 0
    launch.assert_same_as_reference_at(tmp_path / "run", tmp_path / "ref", 8)
    code, err = launch.in_process(*bij, "data.order=randperm", "train.steps=9", f"out_dir={tmp_path / 'run'}")
    assert code == 2 and "data.order is bijective in the checkpoint, None in this run" in err  # fixed for a run
    randperm = launch.in_process(*tiny, "dist.reduce=canonical", "train.steps=8", "log.sample_ids=true", f"out_dir={tmp_path / 'rp'}")
    assert randperm[0] == 0
    assert [m["sample_ids"] for m in launch.metrics(tmp_path / "rp")] != [m["sample_ids"] for m in launch.metrics(tmp_path / "ref")]
