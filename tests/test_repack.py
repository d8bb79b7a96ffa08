"""data.resume_seq_len=repack: a resume at another model.seq_len reads the epoch's unread tokens, each
once, repacked at the new length; the phase is carried by every later checkpoint, so the run is the
same on any world size (docs/data.md "Another seq_len on a resume")."""
import shutil

import numpy as np
import pytest

import launch
from data.repack import Repacked, remaining_spans
from data.sampler import make_order


@pytest.mark.unit
@pytest.mark.parametrize("order", ["randperm", "bijective"])
def test_the_remainder_is_every_unread_token_of_the_epoch_once_in_stream_order_cut_at_the_new_length(tmp_path, order):
    # A packed file whose token at stream position t is t: a row's tokens say where it was read from.
    tokens = 50 * 8 + 5
    path = tmp_path / "stream.bin"
    np.arange(tokens, dtype=np.uint32).tofile(path)
    old_len, new_len, rows, consumed_n = 7, 12, 50, 16  # rows of 8 at the old length, of 13 at the new
    consumed = make_order(order, rows, seed=3, epoch=1).take(0, consumed_n)
    end = tokens // (new_len + 1) * (new_len + 1)  # the training rows at the new length end here
    rem = Repacked(path, new_len, remaining_spans(rows, old_len, consumed, end), np.uint32)
    read = np.concatenate([rem.tokens(i) for i in range(len(rem))]) if len(rem) else np.zeros(0, np.uint32)
    unread = np.array([t for r in range(rows) if r not in set(consumed) for t in range(r * 8, r * 8 + 8) if t < end])
    # The remainder's rows laid end to end are the unread tokens in stream order, but the last partial row.
    assert len(rem) == len(unread) // (new_len + 1) and read.tolist() == unread[:len(read)].tolist()
    assert len(np.unique(read)) == len(read) and not set(read.tolist()) & {t for r in consumed for t in range(r * 8, r * 8 + 8)}
    x, y = rem[len(rem) - 1]
    assert x.tolist() == read[-13:-1].tolist() and y.tolist() == read[-12:].tolist()


@pytest.fixture(scope="module")
def args(epochs):
    return [*epochs, "dist.reduce=canonical"]  # the sum every world size computes alike


@pytest.fixture(scope="module")
def halted(tmp_path_factory, args):
    """The tiny run (70 samples of 32 tokens, 8 steps an epoch) halted at step 3: 40 samples of epoch 0
    left to read (its 6-sample tail fills no batch), which repack into 20 of 64 tokens (2 steps of 8)."""
    out = tmp_path_factory.mktemp("repack") / "halted"
    assert launch.in_process(*args, "checkpoint.interval=1", "train.halt_at=3", f"out_dir={out}")[0] == 0
    return out


LONG = ("model.seq_len=64", "data.resume_seq_len=repack")


def test_a_resume_at_a_longer_seq_len_is_a_new_phase_carried_to_a_resume_on_two_processes(tmp_path, args, halted):
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(halted, one)
    shutil.copytree(halted, two)
    code, err = launch.in_process(*args, *LONG, f"out_dir={one}")
    assert code == 0 and "a new phase from step 3: seq_len 32 -> 64; epoch 0's 40 unread samples of 33 tokens repacked into 20 of 65" in err
    log = launch.metrics(one)
    assert [r["epoch"] for r in log[3:6]] == [0, 0, 1]  # the remainder's 2 steps, then the corpus at 64 tokens
    remainder = [i for r in log[3:5] for i in r["sample_ids"]]
    assert len(set(remainder)) == 16 and max(remainder) < 20
    assert launch.storage_manifest(one, 20)["data_fingerprint"]["repacked"]["samples"] == 20  # carried to the last checkpoint
    # Halted inside the remainder, resumed on 2 processes without the key (the checkpoint carries the phase): the same run.
    assert launch.in_process(*args, *LONG, "train.halt_at=4", f"out_dir={two}")[0] == 0
    launch.run(2, *args, "model.seq_len=64", f"out_dir={two}")
    launch.assert_identical(two, one)


def test_a_repack_at_the_epochs_end_is_an_empty_phase_and_the_next_epoch_reads_the_corpus_at_the_new_length(tmp_path, args):
    out = tmp_path / "run"
    assert launch.in_process(*args, "checkpoint.interval=4", "train.halt_at=8", f"out_dir={out}")[0] == 0  # epoch 0 read
    code, err = launch.in_process(*args, *LONG, "train.steps=10", f"out_dir={out}")
    assert code == 0 and "epoch 0's 0 unread samples of 33 tokens repacked into 0 of 65" in err, err[-2000:]
    log = launch.metrics(out)
    assert [r["epoch"] for r in log[8:10]] == [1, 1] and len(log) == 10


def test_another_seq_len_is_refused_without_repack_and_inside_a_repacked_epoch(tmp_path, args, halted):
    out = tmp_path / "run"
    shutil.copytree(halted, out)
    code, err = launch.in_process(*args, "model.seq_len=64", f"out_dir={out}")
    assert code == 2 and "model.seq_len (data.resume_seq_len=repack continues at another" in err and "is 32 in the checkpoint, 64" in err
    code, err = launch.in_process(*args, "data.resume_seq_len=repack", "data.num_samples=60", f"out_dir={out}")
    assert code == 2 and "data.num_samples (data.resume_seq_len=repack changes the packing's length, not its count) is 70 in" in err
    code, err = launch.in_process(*args, *LONG, "data.val_samples=4", f"out_dir={out}")
    assert code == 2 and "data.val_samples (data.resume_seq_len=repack changes the packing's length, not its count)" in err, err[-1500:]
    assert launch.in_process(*args, *LONG, "train.halt_at=4", f"out_dir={out}")[0] == 0
    code, err = launch.in_process(*args, "model.seq_len=48", "data.resume_seq_len=repack", f"out_dir={out}")
    assert code == 2 and "epoch 0 already reads a remainder repacked from seq_len 32 at step 3" in err and "until the epoch ends (step 5)" in err
    code, err = launch.in_process(*args, *LONG, "data.format=chat", f"out_dir={tmp_path / 'chat'}")
    assert code == 2 and "data.resume_seq_len=repack with data.format=chat: not supported" in err
