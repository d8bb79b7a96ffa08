"""A step folder that was damaged, forged, linked or half-written never loads as something it is
not: DCP's metadata is checked against the files it points into (every tensor covered exactly once,
every size bounded by the bytes on disk, no compressed record), every error a damaged folder raises
is one CheckpointError (a run falls back to the previous checkpoint), no symbolic link in a step
folder is followed, a full disk is named as such, and the coordinator publishes only files it can
verify (docs/run_folder.md, "A damaged checkpoint")."""
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import launch
from checkpoint import CheckpointConfig, CheckpointManager, RunMeta, files, format, storage

STATE_FILE = "state/__0_0.distcp"
METADATA = "state/.metadata"


def publish_step(root: Path, step: int, state: dict | None = None) -> Path:
    """A checkpoint as the manager writes one, on one process: the states through DCP, published
    by storage.publish inside DCP's finish."""
    tmp, out = root / f".tmp-step_{step:08d}-test", []
    state = state or {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.full((4,), 1.5)}, "train": {"step": step}}

    def publish(entries, metadata):
        out.append(storage.publish(root, step, {}, {"world_size": 1}, tmp=tmp, written=entries))

    format.save(state, tmp, publish, no_dist=True)
    return out[0]


def reseal(folder: Path) -> None:
    """Rewrite the manifest to vouch for the files as they are now: what a forger does."""
    manifest = json.loads((folder / storage.MANIFEST).read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / storage.MANIFEST).write_text(json.dumps(manifest))


def metadata_of(folder: Path):
    return storage.read_metadata(folder, storage.verify(folder))


def forge_metadata(folder: Path, change) -> None:
    """`change(metadata)` edits DCP's metadata in place; it is written back and the manifest resealed
    (also over any bytes the forger added to a state file first)."""
    reseal(folder)
    metadata = metadata_of(folder)
    change(metadata)
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    reseal(folder)


def tensors(folder: Path) -> dict:
    return storage.read_tensors(folder, storage.verify(folder), "model.")


def chunk_of(metadata, fqn: str):
    [chunk] = metadata.state_dict_metadata[fqn].chunks
    return chunk


def info_of(metadata, fqn: str):
    return next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)


# --------------------------------------------------------------------- (a) coverage and bounds
@pytest.mark.unit
def test_a_tensor_whose_chunks_leave_a_gap_is_refused_not_loaded_with_what_memory_held(tmp_path):
    folder = publish_step(tmp_path, 1)

    def short(metadata):  # the chunk claims half the rows: the other half would keep whatever the target held
        chunk_of(metadata, "model.w").sizes = torch.Size([1, 3])

    forge_metadata(folder, short)
    with pytest.raises(storage.CheckpointError, match=r"model.w: its chunks hold 3 elements, its size \(2, 3\) 6: the chunks do not "
                                                      r"cover it exactly once \(a damaged or forged checkpoint\)"):
        tensors(folder)


@pytest.mark.unit
def test_a_tensor_whose_chunks_overlap_is_refused_even_when_their_elements_add_up(tmp_path):
    folder = publish_step(tmp_path, 1)
    item = info_of(metadata_of(folder), "model.b")
    data = (folder / "state" / item.relative_path).read_bytes()
    with open(folder / "state" / item.relative_path, "ab") as f:  # bytes for a second chunk, after the others
        f.write(data[item.offset: item.offset + item.length])

    def overlapping(metadata):  # two chunks of 2 over 4 elements, the second at 1: element 3 uncovered, 1-2 twice
        md = metadata.state_dict_metadata["model.b"]
        first = md.chunks[0]
        first.sizes = torch.Size([2])
        md.chunks.append(type(first)(offsets=torch.Size([1]), sizes=torch.Size([2])))
        key = type(next(iter(metadata.storage_data)))("model.b", [1])
        metadata.storage_data[key] = type(item)(item.relative_path, len(data), item.length)

    forge_metadata(folder, overlapping)
    with pytest.raises(storage.CheckpointError, match=r"model.b: its chunks at \(0,\) and \(1,\) overlap"):
        tensors(folder)


@pytest.mark.unit
@pytest.mark.parametrize("forgery, expected", [
    ("a size of a trillion elements", r"model.w: its chunk at \(0, 0\) has 1000000000000 elements of torch.float32, more than its \d+ bytes hold"),
    ("an offset past the end of the file", r"model.b lies at bytes \d+\+\d+ of state/__0_\d.distcp, which holds \d+"),
    ("a length past the end of the file", r"model.b lies at bytes \d+\+\d+ of state/__0_\d.distcp, which holds \d+"),
    ("a file the manifest does not list", r"model.b lies in '__7_0.distcp', which the manifest does not list"),
    ("two items on the same bytes", r"the bytes of model.\w and model.\w overlap in state/__0_\d.distcp"),
])
def test_every_size_and_offset_in_the_metadata_is_bounded_by_the_bytes_on_disk_before_anything_is_allocated(tmp_path, forgery, expected):
    folder = publish_step(tmp_path, 1)

    def forge(metadata):
        info = info_of(metadata, "model.b")
        size = (folder / "state" / info.relative_path).stat().st_size
        if forgery == "a size of a trillion elements":  # what a forged size once asked of the allocator (274 GB)
            md = metadata.state_dict_metadata["model.w"]
            md.size = torch.Size([10**6, 10**6])
            md.chunks[0].sizes = torch.Size([10**6, 10**6])
        elif forgery == "an offset past the end of the file":
            info.offset = size + 10
        elif forgery == "a length past the end of the file":
            info.length = size + 1
        elif forgery == "a file the manifest does not list":
            info.relative_path = "__7_0.distcp"
        else:
            other = info_of(metadata, "model.w")
            info.relative_path, info.offset, info.length = other.relative_path, other.offset, other.length

    forge_metadata(folder, forge)
    with pytest.raises(storage.CheckpointError, match=expected):
        tensors(folder)


def _deflated(tensor: torch.Tensor) -> bytes:
    """torch.save's archive of `tensor` with every record deflated (what a zip bomb is made of)."""
    item, out = io.BytesIO(), io.BytesIO()
    torch.save(tensor, item)
    with zipfile.ZipFile(item) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for record in src.infolist():
            dst.writestr(record.filename, src.read(record))
        dst.comment = b"\0" * (tensor.numel() * tensor.element_size())  # as long as the elements: past the size bound
    return out.getvalue()


@pytest.mark.unit
def test_an_item_whose_zip_records_are_compressed_is_refused_before_it_inflates(tmp_path):
    folder = publish_step(tmp_path, 1, {"model": {"w": torch.zeros(4096)}, "train": {"step": 1}})
    metadata = metadata_of(folder)
    info = info_of(metadata, "model.w")
    data = (folder / STATE_FILE).read_bytes()
    bomb = _deflated(torch.zeros(4096))
    with zipfile.ZipFile(io.BytesIO(bomb)) as z:  # 16 KB of zeros in a few hundred bytes
        assert sum(r.compress_size for r in z.infolist()) < 4096 * 4 // 10
    with open(folder / STATE_FILE, "ab") as f:  # appended, and the item pointed at it
        f.write(bomb)

    def point(md):
        i = info_of(md, "model.w")
        i.offset, i.length = len(data), len(bomb)

    forge_metadata(folder, point)
    # Format 3: a tensor's bytes are raw, exactly its elements: pointed at anything else, refused before a read.
    with pytest.raises(storage.CheckpointError, match=r"model.w: its chunk at \(0,\) is 4096 elements of torch.float32 .* its bytes \d+"):
        tensors(folder)
    # The bytes items (torch.save records still) and every item of format 2: a compressed record is refused before it inflates.
    with pytest.raises(format.FormatError, match=r"model.w: its record .* is compressed \(8\)"):
        format._load_item(io.BytesIO(bomb), f"{folder}: model.w")


@pytest.mark.unit
def test_every_single_byte_flip_of_the_metadata_with_a_resealed_manifest_loads_the_same_tensors_or_is_a_checkpoint_error(tmp_path):
    """A forger's every one-byte edit of `.metadata` (the manifest made to vouch for it): either
    what loads is what was saved (a byte that names nothing, e.g. the save's id) or the one error
    class of an unusable checkpoint, never another exception and never other numbers."""
    folder = publish_step(tmp_path, 1)
    want = tensors(folder)
    good, outcomes = (folder / METADATA).read_bytes(), {"same": 0, "refused": 0}
    for at in range(len(good)):
        for bit in (0x01, 0x80):
            data = bytearray(good)
            data[at] ^= bit
            (folder / METADATA).write_bytes(bytes(data))
            reseal(folder)
            try:
                got = tensors(folder)
            except storage.CheckpointError:
                outcomes["refused"] += 1
                continue
            # Every tensor that loads is one that was saved (a flip in a name renames an item, which a
            # model's strict load then names as missing): never other numbers, never uninitialised memory.
            assert all(any(torch.equal(v, w) for w in want.values()) for v in got.values()), f"byte {at} ^ {bit:#x}"
            outcomes["same"] += 1
    print(f"{len(good)} bytes of metadata, 2 flips each: {outcomes}")
    assert outcomes["refused"] > outcomes["same"] > 0


@pytest.mark.unit
def test_every_single_byte_flip_of_a_state_file_with_a_resealed_manifest_is_a_checkpoint_error_or_loads_a_tensor_of_its_shape(tmp_path):
    """The bytes of the state file itself (zip headers, pickles, tensor bytes): a flip that passes
    (tensor bytes) gives tensors of the saved shapes and dtypes (the identity check catches their
    values); any other is the one error class, never another exception."""
    folder = publish_step(tmp_path, 1)
    want = tensors(folder)
    good, refused = (folder / STATE_FILE).read_bytes(), 0
    for at in range(0, len(good), 3):
        data = bytearray(good)
        data[at] ^= 0x20
        (folder / STATE_FILE).write_bytes(bytes(data))
        reseal(folder)
        try:
            got = tensors(folder)
        except storage.CheckpointError:
            refused += 1
            continue
        assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}, f"byte {at}"
    # Format 3: the model's bytes are raw (no header to damage), so every flip there loads tensors of their
    # shapes; only the bytes items (the step's torch.save record, not read here) have a structure.
    assert refused == 0


@pytest.mark.unit
def test_every_single_byte_flip_of_the_manifest_verifies_as_it_was_or_is_a_checkpoint_error(tmp_path):
    folder = publish_step(tmp_path, 1)
    good = (folder / storage.MANIFEST).read_bytes()
    for at in range(len(good)):
        data = bytearray(good)
        data[at] ^= 0x04
        (folder / storage.MANIFEST).write_bytes(bytes(data))
        try:
            body = storage.verify(folder)
        except storage.CheckpointError:
            continue
        assert body["files"] == json.loads(good)["files"] and body["step"] == 1, f"byte {at}"


# --------------------------------------------------------------------- (b) one error class, a run falls back
@pytest.fixture(scope="module")
def short(tiny):
    return [*tiny, "checkpoint.interval=4", "train.steps=8"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, short):
    """Eight steps in this process, checkpoints at 4 and 8: copied by each test, and its own reference."""
    out = tmp_path_factory.mktemp("hardening") / "run"
    code, err = launch.in_process(*short, f"out_dir={out}")
    assert code == 0, err
    return out


def _damage(folder: Path, how: str) -> None:
    if how == "metadata: a flipped byte":  # the size kept, the manifest not updated: was a traceback, exit 1
        data = bytearray((folder / METADATA).read_bytes())
        data[len(data) // 2] ^= 0x01
        (folder / METADATA).write_bytes(bytes(data))
    elif how == "metadata: an offset past the end, resealed":
        forge_metadata(folder, lambda md: setattr(info_of(md, "model.tok_embeddings.weight"), "offset", 1 << 40))
    elif how == "metadata: a chunk short of its tensor, resealed":  # was loaded: the rest kept its fresh-init values
        def short_chunk(md):
            chunk = chunk_of(md, "model.output.weight") if "model.output.weight" in md.state_dict_metadata else \
                chunk_of(md, "model.tok_embeddings.weight")
            chunk.sizes = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
        forge_metadata(folder, short_chunk)
    elif how == "manifest: a flipped sha256":
        manifest = json.loads((folder / storage.MANIFEST).read_text())
        sha = manifest["files"][STATE_FILE]["sha256"]
        manifest["files"][STATE_FILE]["sha256"] = ("1" if sha[0] != "1" else "2") + sha[1:]
        (folder / storage.MANIFEST).write_text(json.dumps(manifest))
    elif how == "manifest: not json":
        (folder / storage.MANIFEST).write_bytes((folder / storage.MANIFEST).read_bytes()[:-5])
    elif how == "shard: a flipped byte":
        data = bytearray((folder / STATE_FILE).read_bytes())
        data[len(data) // 3] ^= 0x10
        (folder / STATE_FILE).write_bytes(bytes(data))
    elif how == "shard: truncated, resealed":
        (folder / STATE_FILE).write_bytes((folder / STATE_FILE).read_bytes()[:-4096])
        reseal(folder)


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["metadata: a flipped byte", "metadata: an offset past the end, resealed",
                                 "metadata: a chunk short of its tensor, resealed", "manifest: a flipped sha256",
                                 "manifest: not json", "shard: a flipped byte", "shard: truncated, resealed"])
def test_a_run_over_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_whatever_byte_class_was_damaged(
        tmp_path, short, uninterrupted, how):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out, ignore=shutil.ignore_patterns("*.lock"))
    _damage(out / "checkpoints" / "step_00000008", how)
    code, err = launch.in_process(*short, f"out_dir={out}")
    assert code == 0, err
    assert "Traceback" not in err and "skipping checkpoint " in err and "step_00000008" in err, err
    assert "step 4 resumes at sample 32" in err
    launch.assert_identical(out, uninterrupted)


# --------------------------------------------------------------------- (c) symbolic links
def _link_state_to(folder: Path, target: Path) -> None:
    """`folder` becomes a copy of checkpoint `target` whose state/ is a link to target's state/."""
    folder.mkdir(parents=True)
    shutil.copy(target / storage.MANIFEST, folder / storage.MANIFEST)
    (folder / "state").symlink_to(target / "state", target_is_directory=True)


@pytest.mark.unit
def test_republishing_a_step_whose_state_folder_is_a_link_deletes_nothing_at_the_links_target(tmp_path, caplog):
    other = publish_step(tmp_path / "other", 10)  # another run's checkpoint
    root = tmp_path / "run"
    _link_state_to(root / "step_00000010", other)
    before = {p.name: p.read_bytes() for p in (other / "state").iterdir()}
    publish_step(root, 10)  # a rerun of step 10 after a resume from an older one
    assert {p.name: p.read_bytes() for p in (other / "state").iterdir()} == before
    storage.verify(other)
    [aside] = (root / storage.MOVED_ASIDE).iterdir()  # the linked folder moved whole, its link with it
    assert (aside / "state").is_symlink() and "a symbolic link" in caplog.text
    storage.verify(root / "step_00000010")


@pytest.mark.unit
@pytest.mark.parametrize("where", ["the step folder", "state/", "a state file", "the manifest"])
def test_a_link_anywhere_in_a_step_folder_is_refused_by_name_by_discovery_and_load(tmp_path, where):
    other = publish_step(tmp_path / "other", 10)
    root = tmp_path / "run"
    folder = root / "step_00000010"
    if where == "the step folder":
        root.mkdir()
        folder.symlink_to(other, target_is_directory=True)
        linked = folder
    elif where == "state/":
        _link_state_to(folder, other)
        linked = folder / "state"
    else:
        shutil.copytree(other, folder)
        linked = folder / (STATE_FILE if where == "a state file" else storage.MANIFEST)
        linked.unlink()
        linked.symlink_to(other / linked.relative_to(folder))
    with pytest.raises(storage.CheckpointError, match=f"{linked}: a symbolic link"):
        storage.verify(folder)
    newest, listing = storage.scan(root, verify_all=True)
    assert newest is None and all(p != folder or error for _, p, error in listing)
    with pytest.raises(storage.CheckpointError, match=f"{linked}: a symbolic link|no valid checkpoint"):
        storage.find_checkpoint(root)
    storage.verify(other)


@pytest.mark.unit
def test_pruning_a_checkpoint_whose_state_became_a_link_deletes_nothing_at_the_links_target(tmp_path, caplog):
    other = publish_step(tmp_path / "other", 10)
    root = tmp_path / "run"
    owned = {publish_step(root, step) for step in (10, 20, 30)}
    shutil.rmtree(root / "step_00000010")
    _link_state_to(root / "step_00000010", other)  # swapped after this run published it (it is still "owned")
    storage.prune(root, 2, owned)
    storage.verify(other)
    assert (root / "step_00000010" / "state").is_symlink() and "not pruning" in caplog.text


@pytest.mark.unit
def test_a_leftover_replaced_checkpoint_with_a_linked_state_is_moved_aside_not_emptied(tmp_path):
    other = publish_step(tmp_path / "other", 10)
    root = tmp_path / "run"
    _link_state_to(root / ".trash-step_00000010-deadbeef", other)
    storage.clear_temporaries(root)
    storage.verify(other)
    [aside] = (root / storage.MOVED_ASIDE).iterdir()
    assert (aside / "state").is_symlink()


# --------------------------------------------------------------------- (d) a full disk
FULL_AT = 100_000
"""Where the disk fills in a real run's state file: inside a tensor's bytes (torch's zip writer once
turned a full disk there into "unexpected pos"; measured on the code before that fix)."""


def full_disk_for_state_files(monkeypatch, room: int = 600, when=lambda path: True) -> None:
    """Every state file whose path `when` accepts takes its first `room` bytes, then its write
    raises ENOSPC, as a full disk does (a write across the limit writes what fits, as the kernel's
    does; the next one fails). Through files._pwrite, where every StreamWriter's bytes go."""
    real = files._pwrite

    def pwrite(fd, view, offset):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "/state/" in path and when(path) and offset + len(view) > room:
            if offset < room:
                return real(fd, view[:room - offset], offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, view, offset)

    monkeypatch.setattr(files, "_pwrite", pwrite)


@pytest.mark.unit
def test_a_full_disk_while_dcp_writes_the_states_names_the_file_and_no_space_left_on_device(tmp_path, monkeypatch):
    """Wherever in the state file the disk fills (inside torch's zip writer it becomes "unexpected
    pos" unless the writer keeps the real error)."""
    size = (publish_step(tmp_path, 10) / STATE_FILE).stat().st_size
    for room in range(0, size, 37):
        full_disk_for_state_files(monkeypatch, room)
        with pytest.raises(format.errors()) as e:
            publish_step(tmp_path, 20)
        text = str(e.value)
        assert "No space left on device" in text and ".tmp-step_00000020-test/state/__0_0.distcp" in text, (room, text)
        assert "unexpected pos" not in text
        assert [s for s, _ in storage.list_checkpoints(tmp_path)] == [10]
        shutil.rmtree(tmp_path / ".tmp-step_00000020-test")  # the manager's part (the e2e test below)
    storage.verify(tmp_path / "step_00000010")


@pytest.mark.e2e
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_run_whose_disk_fills_while_it_writes_the_states_exits_1_naming_the_path_and_keeps_the_previous_checkpoint(
        tmp_path, short, monkeypatch, async_save):
    full_disk_for_state_files(monkeypatch, room=FULL_AT, when=lambda path: "step_00000008" in path)
    code, err = launch.in_process(*short, f"checkpoint.async={async_save}", f"out_dir={tmp_path}")
    assert code == 1 and "Traceback" not in err, err
    assert "No space left on device" in err and "step_00000008" in err and "state/__0_0.distcp" in err, err
    assert "unexpected pos" not in err
    ckpts = tmp_path / "checkpoints"
    assert [s for s, _ in storage.list_checkpoints(ckpts)] == [4] and not any(ckpts.glob(".tmp-*"))
    storage.verify(ckpts / "step_00000004")


# --------------------------------------------------------------------- (e) publish verifies what other ranks listed
@pytest.mark.unit
@pytest.mark.parametrize("elsewhere", ["missing here", "other bytes here"])
def test_the_coordinator_publishes_only_when_every_file_another_rank_listed_is_here_and_verifies(tmp_path, monkeypatch, elsewhere):
    """FSDP on nodes that do not share the run folder: rank 1 wrote its shard on its own disk. The
    coordinator must not publish a checkpoint that can never verify."""
    published, real = [], format._Results
    remote = {"bytes": 64, "sha256": hashlib.sha256(b"r" * 64).hexdigest()}

    class WithARemoteRank(real):
        def __init__(self, results, files):
            if elsewhere == "other bytes here":
                (tmp_path / ".tmp-step_00000001-test" / "state" / "__1_0.distcp").write_bytes(b"x" * 64)
            super().__init__(results, {**files, "state/__1_0.distcp": remote})

    monkeypatch.setattr(format, "_Results", WithARemoteRank)
    monkeypatch.setattr(storage, "publish", lambda *a, **k: published.append(a))
    with pytest.raises(format.errors()) as e:
        publish_step(tmp_path, 1)
    text = str(e.value)
    assert "state/__1_0.distcp" in text and "not published" in text, text
    assert ("No such file or directory" in text) if elsewhere == "missing here" else ("another rank wrote 64 bytes" in text)
    assert published == [] and storage.list_checkpoints(tmp_path) == []


# --------------------------------------------------------------------- (f) structural errors name the key; (g) old layout
class OneProcess:
    rank, world_size, device, is_main = 0, 1, torch.device("cpu"), True

    def any(self, flag):
        return bool(flag)

    def broadcast(self, obj):
        return obj

    def gather(self, obj):
        return [obj]

    def all_gather(self, obj):
        return [obj]


class Buffer:
    """A stateful piece whose tensor's shape follows a setting (as a rollout buffer's follows micro_batch)."""

    def __init__(self, rows):
        self.rows = torch.zeros(rows, 3)

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        self.rows = state["rows"]


class Train:
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def _states(rows: int) -> dict:
    from checkpoint import ModelState

    torch.manual_seed(0)
    return {"model": ModelState(torch.nn.Linear(3, 2)), "buffer": Buffer(rows), "train": Train()}


def _manager(out: Path, micro_batch: int) -> CheckpointManager:
    meta = RunMeta(world_size=1, global_batch=8, micro_batch=micro_batch, accum=8 // micro_batch, threads=1, reduce="ddp",
                   config={"seed": 1, "train": {"micro_batch": micro_batch}},
                   may_change={"config.train.micro_batch": ("train.micro_batch", "the same samples, other micro-batches")})
    return CheckpointManager(CheckpointConfig(interval=1), out, OneProcess(), meta)


@pytest.mark.unit
def test_a_state_of_another_shape_after_a_may_change_key_is_refused_naming_the_tensor_and_the_key(tmp_path):
    _manager(tmp_path, 2).after_step(1, _states(2), "halted")
    with pytest.raises(storage.CheckpointMismatch, match=r"its states do not fit this run's: buffer.rows is \(2, 3\) in the checkpoint, "
                                                         r"\(4, 3\) in this run \(changed since the checkpoint: train.micro_batch 2 -> 4\)"):
        _manager(tmp_path, 4).load(_states(4))
    assert [s for s, _ in storage.list_checkpoints(tmp_path / "checkpoints")] == [1]  # nothing moved, nothing deleted


@pytest.mark.unit
def test_a_checkpoint_of_the_earlier_layout_is_bad_input_for_a_run(tmp_path):
    from common.outcome import BadInput, exit_code, outcome_of

    old = tmp_path / "checkpoints" / "step_00000005"
    old.mkdir(parents=True)
    (old / storage.MANIFEST).write_text(json.dumps({"format": 1, "step": 5, "files": {"resume.pth": {"bytes": 1, "sha256": "0" * 64}}}))
    with pytest.raises(storage.OldLayout, match=f"earlier layout.*{storage.CONVERT} {tmp_path}") as e:
        _manager(tmp_path, 2).load(_states(2))
    assert isinstance(e.value, BadInput) and exit_code(outcome_of(e.value)) == 2


@pytest.mark.e2e
def test_a_run_over_a_checkpoint_of_the_earlier_layout_exits_2_with_the_command_that_converts_it(tmp_path, short):
    old = tmp_path / "checkpoints" / "step_00000005"
    old.mkdir(parents=True)
    (old / storage.MANIFEST).write_text(json.dumps({"format": 1, "step": 5, "files": {"resume.pth": {"bytes": 1, "sha256": "0" * 64}}}))
    code, err = launch.in_process(*short, f"out_dir={tmp_path}")
    assert code == 2 and f"{storage.CONVERT} {tmp_path}" in err and "Traceback" not in err, err
    assert old.exists() and not (tmp_path / "metrics.jsonl").exists()
