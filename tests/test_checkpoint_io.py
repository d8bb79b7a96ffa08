import errno
import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint import format, states as rng, storage
from checkpoint.manager import half_weights
from common.seeds import derive_seed
from run.metrics import truncate

pytestmark = pytest.mark.unit


class Explodes:
    """Pickling this raises: an exception in the middle of a save."""

    def __reduce__(self):
        raise OSError("injected failure between two file writes")


STATE_FILE = "state/__0_0.distcp"


def publish_step(root, step, value=1.0, size=4):
    """A checkpoint as the manager writes one, on one process: the states through DCP (format.save),
    the fp16 weights beside them, published by storage.publish inside DCP's finish."""
    tmp, out = root / f".tmp-step_{step:08d}-test", []

    def publish(entries, metadata):
        out.append(storage.publish(root, step, {storage.WEIGHTS_FILE: {"w": torch.full((size,), value).half()}}, {"world_size": 1},
                                   tmp=tmp, written=entries))

    format.save({"model": {"w": torch.full((size,), value)}, "train": {"step": step}}, tmp, publish, no_dist=True)
    return out[0]


def read_w(folder):
    return storage.read_tensors(folder, storage.verify(folder))["w"]


def test_a_published_checkpoint_has_every_file_and_a_manifest_with_sizes_and_hashes(tmp_path):
    folder = publish_step(tmp_path, 10)
    assert folder.name == "step_00000010"
    manifest = storage.verify(folder)
    assert manifest["step"] == 10 and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == ["state/.metadata", STATE_FILE, storage.WEIGHTS_FILE]
    for name in manifest["files"]:
        assert manifest["files"][name]["bytes"] == (folder / name).stat().st_size
    assert torch.equal(read_w(folder), torch.ones(4))


def test_an_exception_between_two_file_writes_leaves_the_previous_checkpoint_and_nothing_new(tmp_path):
    publish_step(tmp_path, 10)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(storage.CheckpointError, match=r"saving step 20 to .*step_00000020 failed: .*injected failure"):
        storage.publish(tmp_path, 20, {storage.WEIGHTS_FILE: {"w": torch.zeros(4)}, "tokenizer.json": Explodes()}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no step_20, no temporary left
    assert [s for s, _ in storage.list_checkpoints(tmp_path)] == [10]
    storage.verify(tmp_path / "step_00000010")


def test_a_temporary_folder_left_by_a_killed_save_is_never_listed_and_is_cleared(tmp_path):
    publish_step(tmp_path, 10)
    killed = tmp_path / ".tmp-step_00000020-deadbeef"
    killed.mkdir()
    (killed / storage.WEIGHTS_FILE).write_bytes(b"half")
    assert [s for s, _ in storage.list_checkpoints(tmp_path)] == [10]
    assert storage.clear_temporaries(tmp_path) == [killed] and not killed.exists()


def test_keep_last_k_prunes_the_oldest_first_and_only_after_publishing(tmp_path):
    owned = {publish_step(tmp_path, step) for step in (10, 20, 30)}
    assert storage.prune(tmp_path, 3, owned) == []
    owned.add(publish_step(tmp_path, 40))
    assert [s for s, _ in storage.list_checkpoints(tmp_path)] == [40, 30, 20, 10]  # published before pruning
    removed = storage.prune(tmp_path, 2, owned)
    assert [p.name for p in removed] == ["step_00000010", "step_00000020"]
    assert [s for s, _ in storage.list_checkpoints(tmp_path)] == [40, 30]
    assert owned == {tmp_path / "step_00000040", tmp_path / "step_00000030"}


def test_a_pruned_checkpoint_leaves_its_name_at_once_and_a_deletion_cut_short_is_finished_at_the_next_start(tmp_path, monkeypatch, caplog):
    """The save does not wait for a pruned checkpoint's deletion (storage.retire_later): the folder
    is renamed out of discovery's sight, its files deleted by `later`. The manifest goes last, so a
    deletion cut short (here: the second unlink fails) is finished by clear_temporaries, nothing set aside."""
    owned = {publish_step(tmp_path, step) for step in (10, 20, 30)}
    jobs = []
    assert [p.name for p in storage.prune(tmp_path, 2, owned, later=jobs.append)] == ["step_00000010"]
    assert [s for s, _ in storage.list_checkpoints(tmp_path)] == [30, 20] and owned == {tmp_path / "step_00000030", tmp_path / "step_00000020"}
    [trash] = [p for p in tmp_path.iterdir() if p.name.startswith(".trash-step_00000010-")]
    assert (trash / STATE_FILE).exists() and (trash / storage.MANIFEST).exists()  # deleted later, not by the save
    unlink, calls = Path.unlink, []

    def second_fails(self, *a, **k):
        calls.append(self)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error (injected)", str(self))
        return unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", second_fails)
    jobs.pop()()  # logs, never raises
    monkeypatch.setattr(Path, "unlink", unlink)
    assert "is removed at the next start" in caplog.text and (trash / storage.MANIFEST).exists()
    assert storage.clear_temporaries(tmp_path) == [trash] and not trash.exists() and not (tmp_path / storage.MOVED_ASIDE).exists()
    owned.add(publish_step(tmp_path, 40))
    storage.prune(tmp_path, 2, owned, later=jobs.append)
    jobs.pop()()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000030", "step_00000040"]


def test_pruning_never_counts_or_deletes_a_checkpoint_that_does_not_verify_nor_follows_a_link(tmp_path):
    root, outside = tmp_path / "checkpoints", tmp_path / "outside"
    damaged = publish_step(root, 50)
    (damaged / STATE_FILE).write_bytes(b"damaged")
    publish_step(outside, 60)
    (root / "step_00000060").symlink_to(outside / "step_00000060", target_is_directory=True)
    owned = {publish_step(root, step) for step in (10, 20, 30)}
    removed = storage.prune(root, 2, owned)
    # step 50 is newest but does not verify: not one of the 2 kept, not deleted; the link is not a checkpoint
    assert [p.name for p in removed] == ["step_00000010"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000020", "step_00000030", "step_00000050", "step_00000060"]
    storage.verify(outside / "step_00000060")


def test_pruning_verifies_a_checkpoint_it_did_not_write_before_deleting_it(tmp_path):
    old = publish_step(tmp_path, 10)  # an earlier launch's: not in `owned` until it verifies
    owned = {publish_step(tmp_path, step) for step in (20, 30)}
    assert storage.prune(tmp_path, 2, owned) == [old]


@pytest.mark.parametrize("name", ["../../../../etc/hostname", "/etc/hostname", "state/../../notes.txt", "notes.txt", "resume.pth"])
def test_a_manifest_naming_anything_but_the_trainers_own_files_is_refused_before_any_file_is_opened(tmp_path, name):
    folder = publish_step(tmp_path, 10)
    canary = tmp_path / "canary"
    os.mkfifo(canary)  # opening a FIFO for reading blocks: a refused name must never be opened
    manifest = json.loads((folder / storage.MANIFEST).read_text())
    manifest["files"][name.replace("/etc/hostname", str(canary)) if name.startswith("/") else name] = {"bytes": 0, "sha256": "0" * 64}
    (folder / storage.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(storage.CheckpointError, match="which is not a file this trainer writes"):
        storage.verify(folder)


def test_a_step_folder_whose_name_differs_from_its_manifests_step_does_not_verify(tmp_path):
    publish_step(tmp_path, 10).rename(tmp_path / "step_00000099")
    with pytest.raises(storage.CheckpointError, match="says step 10, but the folder is step_00000099"):
        storage.verify(tmp_path / "step_00000099")


def test_a_full_disk_is_reported_as_such_with_the_path_even_through_torchs_zip_writer(tmp_path, monkeypatch):
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    from checkpoint import files

    monkeypatch.setattr(files, "open", lambda path, mode: FullDisk(real_open(path, mode)), raising=False)
    with pytest.raises(storage.CheckpointError, match=r"No space left on device: '.*weights_fp16\.\w+'") as e:
        storage.publish(tmp_path, 10, {storage.WEIGHTS_FILE: {"w": torch.zeros(100_000)}}, {})
    assert "unexpected pos" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_saving_a_step_that_exists_replaces_it_whole(tmp_path):
    publish_step(tmp_path, 10, value=1.0)
    publish_step(tmp_path, 10, value=2.0)
    assert torch.equal(read_w(tmp_path / "step_00000010"), torch.full((4,), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]


@pytest.mark.parametrize("damage, match", [
    ("truncate", "bytes, the manifest says"),
    ("flip", "does not match the manifest"),
    ("delete", "missing"),
    ("manifest", "does not parse"),
    ("foreign", r"holds state/__1_0.distcp, not in its manifest"),
])
def test_verify_names_the_file_and_what_failed(tmp_path, damage, match):
    folder = publish_step(tmp_path, 10)
    target = folder / STATE_FILE
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    elif damage == "foreign":  # DCP would read any file of state/: only the listed ones may be there
        (folder / "state" / "__1_0.distcp").write_bytes(target.read_bytes())
    else:
        (folder / storage.MANIFEST).write_text("{not json")
    with pytest.raises(storage.CheckpointError, match=match):
        storage.verify(folder)


def test_loading_never_runs_pickled_code(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pth"
    torch.save({"model": Payload()}, path)
    with pytest.raises(storage.CheckpointError, match="not a plain checkpoint"):
        storage.safe_load(path)
    assert not marker.exists()


def test_rng_state_round_trips_as_tensors_and_ints_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.normal(), torch.rand(1)
    state = rng.capture(torch.device("cpu"))
    torch.save(state, tmp_path / "rng.pth")
    expected = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    rng.restore(storage.safe_load(tmp_path / "rng.pth"), torch.device("cpu"))
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_derived_seeds_are_a_pure_function_of_their_parts():
    # The formula itself is pinned: a resume on another machine or release must draw the same seeds.
    digest = hashlib.sha256(b"1:0:5:2").digest()
    assert derive_seed(1, 0, 5, 2) == int.from_bytes(digest[:8], "little") & ((1 << 63) - 1) == 2557887009060650967
    assert len({derive_seed(1, 0, 5, i) for i in range(100)}) == 100
    assert 0 <= derive_seed(2**40, 3) < 2**63


def test_the_earlier_releases_hash_stays_readable_as_fp32_bytes_in_state_dict_order():
    # Manifests and pins without "identity" hold this hash: it is kept to check them (docs/design.md).
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([3.0])}
    b = {"y": torch.tensor([3.0]), "x": torch.tensor([1.0, 2.0])}
    expected = hashlib.sha256(np.array([1.0, 2.0, 3.0], dtype=np.float32).tobytes()).hexdigest()
    assert storage.legacy_model_sha256(a) == expected != storage.legacy_model_sha256(b)
    assert storage.identity_matches({"sha256": expected}, "sha256", a, {}) == (True, expected)
    assert not storage.identity_matches({"sha256": expected, "identity": storage.IDENTITY}, "sha256", a, {})[0]


def test_the_fp16_weights_keep_tied_tensors_as_one(tmp_path):
    w = torch.randn(5, 3)
    half = half_weights({"emb": w, "out": w, "norm": torch.ones(3)})
    assert half["emb"] is half["out"] and half["emb"].dtype == torch.float16


def test_metrics_past_the_resumed_step_and_half_written_lines_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo')
    assert truncate(path, 5) == 5
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_each_state_file_is_read_once_and_used_only_as_the_bytes_that_were_hashed(tmp_path, monkeypatch):
    """A file replaced after it was read is not read again: what is loaded is what was hashed, and
    the replaced file is refused by the next read."""
    from checkpoint import files

    folder = publish_step(tmp_path, 10, value=1.0)
    opened, real_open = [], open
    real_rest = files.HashingReader.rest

    def counting_open(path, mode="r", *args, **kwargs):
        opened.append((Path(path).name, mode))
        return real_open(path, mode, *args, **kwargs)

    def replaced_meanwhile(self):
        real_rest(self)
        if self.path.name == Path(STATE_FILE).name:  # another process rewrites the file after it was read and hashed
            data = self.path.read_bytes()
            self.path.write_bytes(data.replace(torch.ones(4).numpy().tobytes(), torch.full((4,), 9.0).numpy().tobytes()))

    monkeypatch.setattr(files, "open", counting_open, raising=False)  # every read of a file opens it there (files.open_read)
    monkeypatch.setattr(files.HashingReader, "rest", replaced_meanwhile)
    assert torch.equal(read_w(folder), torch.ones(4))  # what was hashed, not what is on disk now
    assert opened.count(("__0_0.distcp", "rb")) == 1  # read once: no second pass that could see other bytes
    monkeypatch.setattr(files.HashingReader, "rest", real_rest)
    with pytest.raises(storage.CheckpointError, match="does not match the manifest"):
        read_w(folder)  # the rewritten file is refused


def test_a_flipped_byte_inside_a_tensor_is_refused_by_the_verified_load(tmp_path):
    """The state file still deserializes after the flip (torch.load checks no checksum of its own):
    only the sha256 against the manifest tells."""
    folder = publish_step(tmp_path, 10, value=1.5, size=1000)
    path = folder / STATE_FILE
    data = bytearray(path.read_bytes())
    at = bytes(data).index(torch.full((4,), 1.5).numpy().tobytes()) + 8  # inside the tensor's bytes
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    manifest = json.loads((folder / storage.MANIFEST).read_text())
    manifest["files"][STATE_FILE]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    forged = {**manifest["files"]}  # with a manifest that vouches for the flipped bytes, they load: other numbers
    metadata = storage.read_metadata(folder, manifest)
    assert not torch.equal(format.read_tensors(folder, forged, metadata, "model.")["w"], torch.full((1000,), 1.5))
    with pytest.raises(storage.CheckpointError, match=r"__0_0.distcp: sha256 .* does not match the manifest"):
        read_w(folder)


def test_pruning_removes_only_the_files_a_manifest_lists_and_leaves_what_a_user_put_in_the_folder(tmp_path, caplog):
    owned = {publish_step(tmp_path, step) for step in (10, 20, 30)}
    export = tmp_path / "step_00000010" / "hf"
    export.mkdir()
    (export / "config.json").write_text("{}")
    removed = storage.prune(tmp_path, 2, owned)
    assert [p.name for p in removed] == ["step_00000010"]
    assert sorted(p.name for p in (tmp_path / "step_00000010").iterdir()) == ["hf"]  # the checkpoint's files went, the export stayed
    assert (export / "config.json").read_text() == "{}"
    assert "left it there with what the trainer did not write: hf" in caplog.text
    caplog.clear()
    storage.prune(tmp_path, 2, owned | {publish_step(tmp_path, 40)})  # the leftover is no checkpoint: skipped quietly
    assert (export / "config.json").exists() and "not pruning" not in caplog.text


def test_a_step_folder_that_does_not_verify_is_moved_aside_when_its_step_is_saved_again(tmp_path, caplog):
    damaged = publish_step(tmp_path, 10, value=1.0)
    (damaged / STATE_FILE).write_bytes(b"damaged")
    publish_step(tmp_path, 10, value=2.0)
    assert torch.equal(read_w(tmp_path / "step_00000010"), torch.full((4,), 2.0))
    [aside] = (tmp_path / storage.MOVED_ASIDE).iterdir()
    assert aside.name.startswith("step_00000010-") and (aside / STATE_FILE).read_bytes() == b"damaged"
    assert "did not verify" in caplog.text and str(aside) in caplog.text
    assert [s for s, _ in storage.list_checkpoints(tmp_path)] == [10]  # what was set aside is never listed


def test_a_valid_step_folder_replaced_by_a_rerun_keeps_the_files_a_user_put_there(tmp_path, caplog):
    old = publish_step(tmp_path, 10, value=1.0)
    (old / "notes.txt").write_text("mine")
    publish_step(tmp_path, 10, value=2.0)
    [aside] = (tmp_path / storage.MOVED_ASIDE).iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["notes.txt"] and "held files the trainer did not write (notes.txt)" in caplog.text


def test_a_replaced_checkpoint_caught_on_its_way_out_by_a_crash_keeps_a_users_files(tmp_path):
    """A crash between moving a replaced step folder aside (.trash-*) and retiring it: the next
    start removes only the checkpoint's own files and sets the rest aside."""
    folder = publish_step(tmp_path, 10)
    (folder / "notes.txt").write_text("mine")
    trash = tmp_path / ".trash-step_00000010-abcd1234"
    folder.rename(trash)
    assert storage.clear_temporaries(tmp_path) == [trash] and not trash.exists()
    [aside] = (tmp_path / storage.MOVED_ASIDE).iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["notes.txt"] and (aside / "notes.txt").read_text() == "mine"


def test_every_file_is_fsynced_before_the_manifest_that_vouches_for_it_is_written(tmp_path, monkeypatch):
    """The publish protocol's order (docs/design.md I8): each file's data fsynced, then the manifest
    written. An fsync made slow here must still come first."""
    import time

    from checkpoint import files

    events, real_fsync, real_write = [], os.fsync, files.write_file

    def slow_fsync(fd):
        time.sleep(0.2)
        real_fsync(fd)
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))

    def writes(path, obj, *rest):
        if Path(path).name == storage.MANIFEST:
            events.append(("manifest", storage.MANIFEST))
        return real_write(path, obj, *rest)

    monkeypatch.setattr(files.os, "fsync", slow_fsync)
    monkeypatch.setattr(storage, "write_file", writes)
    folder = publish_step(tmp_path, 10)
    manifest_at = events.index(("manifest", storage.MANIFEST))
    for name in storage.verify(folder)["files"]:
        assert ("fsync", Path(name).name) in events[:manifest_at], (name, events)


def _takes_o_direct(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / "probe")
    return True


@pytest.mark.parametrize("where", ["a disk that takes it", "refused at fcntl", "refused at the write"])
def test_a_stream_writer_hashes_every_byte_in_file_order_and_writes_whole_blocks_with_o_direct_where_the_filesystem_takes_it(
        tmp_path, monkeypatch, where):
    """Buffers of odd sizes across the staging blocks' edges: the file is their bytes in order, its
    entry their sha256 and size; every whole block is written at its offset with O_DIRECT where the
    filesystem takes it (the tail through the page cache), through the page cache alone where it
    refuses O_DIRECT, whether when it is set or at the first write."""
    import fcntl

    from checkpoint import files

    assert _takes_o_direct(tmp_path), "this machine's disk takes O_DIRECT"
    direct_here = where == "a disk that takes it"
    block = files.STAGE_BLOCK
    rng_ = np.random.default_rng(0)
    buffers = [rng_.bytes(n) for n in (3, block + block // 2 + 5, block, 7, 2 * block - 15)]
    writes, real, real_fcntl = [], files._pwrite, fcntl.fcntl

    def spy(fd, view, offset):
        flags = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        if where == "refused at the write" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        writes.append((offset, len(view), bool(flags & os.O_DIRECT)))
        return real(fd, view, offset)

    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(files, "_pwrite", spy)
    if where == "refused at fcntl":
        monkeypatch.setattr(files.fcntl, "fcntl", refusing)
    entry = files.write_stream(tmp_path / "f", [*buffers[:2], memoryview(buffers[2]), bytearray(buffers[3]), buffers[4]])
    data = (tmp_path / "f").read_bytes()
    whole = b"".join(buffers)
    assert data == whole and entry == {"bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}
    assert sorted(w[:2] for w in writes) == [(o, min(block, len(whole) - o)) for o in range(0, len(whole), block)]
    assert [d for o, n, d in sorted(writes)] == [n == block and direct_here for o, n, d in sorted(writes)]
