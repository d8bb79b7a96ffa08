"""The state files' byte layout (checkpoint/format.py, docs/design.md "One save path"): format 3
writes every tensor's bytes raw at the offset its metadata records and reads them straight into the
destination, hashing each byte once; a layout that is damaged or forged (a file truncated, an offset
past the end, two items overlapping, a chunk uncovered) is refused before anything is allocated; a
run written in format 2 (tests/fixtures/format2/) still loads and resumes to the uninterrupted run's bits."""
from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import launch
from checkpoint import format, storage

pytestmark = pytest.mark.unit

FORMAT2 = launch.ROOT / "tests" / "fixtures" / "format2" / "pretrain"
CORPUS = launch.ROOT / "tests" / "fixtures" / "prev_release" / "corpus.jsonl"


def overrides(out: Path, cache: Path) -> list[str]:
    """The fixture run's recorded config as command-line keys, on this test's folders, run to its end."""
    flat: dict = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(yaml.safe_load((FORMAT2 / "config.yaml").read_text()), "")
    flat.update({"out_dir": str(out), "data.cache_dir": str(cache), "data.path": str(CORPUS), "train.halt_at": 0})
    return [f"{k}={v}" for k, v in flat.items()]


def test_a_run_written_in_format_2_resumes_to_the_uninterrupted_runs_bits(tmp_path):
    run = tmp_path / "format2"
    shutil.copytree(FORMAT2, run)
    newest = run / storage.CHECKPOINTS / storage.step_dir_name(2)
    assert storage.verify(newest)["format"] == 2  # the fixture is what it says
    code, err = launch.in_process(*overrides(run, tmp_path / "cache"))
    assert code == 0, err
    assert [m["loss"] for m in launch.metrics(run)][:2] == [m["loss"] for m in launch.metrics(FORMAT2)]
    if launch.fixture_bits_here(FORMAT2, overrides(tmp_path / "x", tmp_path / "cache"), tmp_path / "two"):
        ref = tmp_path / "reference"
        code, err = launch.in_process(*overrides(ref, tmp_path / "cache"))
        assert code == 0, err
        launch.assert_identical(run, ref)  # every logged loss (steps 1-2 format 2's) and the final identity
        return
    # Another CPU's bits in the fixture: the same resume halted at step 3 (a format-3 checkpoint) and resumed ends alike.
    again = tmp_path / "again"
    shutil.copytree(FORMAT2, again)
    assert launch.in_process(*overrides(again, tmp_path / "cache"), "train.halt_at=3")[0] == 0
    assert launch.metrics(again)[-1]["step"] == 3  # halted there
    assert launch.in_process(*overrides(again, tmp_path / "cache"))[0] == 0
    launch.assert_identical(run, again)


def test_a_format_2_checkpoint_with_a_flipped_byte_falls_back_to_the_previous_one_and_the_run_still_ends_on_the_same_bits(tmp_path, caplog):
    run = tmp_path / "format2"
    shutil.copytree(FORMAT2, run)
    folder = run / storage.CHECKPOINTS / storage.step_dir_name(2)
    weights = storage.read_tensors(folder, storage.verify(folder))["tok_embeddings.weight"].numpy().tobytes()
    state = folder / "state" / "__0_0.distcp"
    data = bytearray(state.read_bytes())
    at = data.index(weights) + len(weights) // 2  # inside the tensor's values, not torch.save's framing
    data[at] ^= 0x01
    state.write_bytes(bytes(data))
    code, err = launch.in_process(*overrides(run, tmp_path / "cache"))
    assert code == 0, err
    [skipped] = [line for line in err.splitlines() if "skipping checkpoint" in line]
    assert "step_00000002" in skipped and "does not match the manifest" in skipped  # refused by its sha256, not loaded
    ref = tmp_path / "reference"
    if launch.fixture_bits_here(FORMAT2, overrides(tmp_path / "x", tmp_path / "cache"), tmp_path / "two", step=1):
        assert launch.in_process(*overrides(ref, tmp_path / "cache"))[0] == 0  # from scratch, uninterrupted
    else:  # another CPU's bits in the fixture: the run resumed from its step 1 directly
        shutil.copytree(FORMAT2, ref)
        shutil.rmtree(ref / storage.CHECKPOINTS / storage.step_dir_name(2))
        assert launch.in_process(*overrides(ref, tmp_path / "cache"))[0] == 0
    launch.assert_identical(run, ref)  # resumed from step 1 (format 2 too), retrained step 2, the same bits


# ------------------------------------------------------------------ format 3: raw tensor bytes
STATE_FILE = "state/__0_0.distcp"


def publish_step(root: Path, step: int, state: dict) -> Path:
    """A checkpoint as the manager writes one, on one process (the states only), published in DCP's finish."""
    tmp, out = root / f".tmp-step_{step:08d}-test", []

    def publish(entries, metadata):
        out.append(storage.publish(root, step, {}, {"world_size": 1}, tmp=tmp, written=entries))

    format.save(state, tmp, publish, no_dist=True)
    return out[0]


def reseal(folder: Path) -> None:
    """The manifest made to vouch for the files as they are now (what a forger does)."""
    manifest = json.loads((folder / storage.MANIFEST).read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / storage.MANIFEST).write_text(json.dumps(manifest))


def forge(folder: Path, change) -> None:
    """`change(metadata)` edits DCP's metadata; written back, the manifest resealed."""
    reseal(folder)
    metadata = storage.read_metadata(folder, storage.verify(folder))
    change(metadata)
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(folder)


def info_of(metadata, fqn: str):
    return next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)


def model() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {"big": torch.randn(3 << 18, generator=torch.Generator().manual_seed(0)),  # 3 MiB: hashed beside its write
            "half": torch.linspace(-2, 2, 7).to(torch.bfloat16), "ids": torch.arange(5, dtype=torch.int64) * 10**12,
            "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
            "view": base[:, 1:4], "row": base[2]}  # a strided view and a contiguous view of a larger storage


def test_every_tensor_is_written_raw_at_the_offset_its_metadata_records_and_reads_back_bit_for_bit(tmp_path):
    state = model()
    folder = publish_step(tmp_path, 1, {"model": state, "train": {"step": 1}})
    manifest = storage.verify(folder)  # the manifest's sha256 is the file's: the hash was over the bytes written
    assert manifest["format"] == storage.FORMAT == 3
    # The rank's items over format.PARTS files (written and read in parallel), the bytes items in the first.
    files = {name.removeprefix("state/"): (folder / name).read_bytes() for name in manifest["files"] if name.startswith("state/__")}
    assert sorted(files) == [f"__0_{k}.distcp" for k in range(format.PARTS)] and format.PARTS == 2
    for name, data in files.items():
        assert manifest["files"][f"state/{name}"]["sha256"] == hashlib.sha256(data).hexdigest()
    metadata = storage.read_metadata(folder, manifest)
    tensor_bytes = 0
    for name, t in state.items():
        info = info_of(metadata, f"model.{name}")
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert (info.dtype, info.shape, info.length) == (t.dtype, tuple(t.shape), len(raw))
        data = files[info.relative_path]
        assert data[info.offset: info.offset + info.length] == raw, name  # no framing: the bytes as they are in memory
        tensor_bytes += len(raw)
    step = info_of(metadata, "train.step")
    assert step.dtype is None and step.relative_path == "__0_0.distcp" and step.offset == 0
    assert sum(map(len, files.values())) == tensor_bytes + step.length  # the bytes items and the tensors, nothing else
    got = storage.read_tensors(folder, manifest)
    assert list(got) == list(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_a_load_reads_each_tensor_straight_into_the_destinations_memory(tmp_path):
    state = model()
    folder = publish_step(tmp_path, 1, {"model": state, "train": {"step": 1}})
    manifest = storage.verify(folder)
    metadata = storage.read_metadata(folder, manifest)
    dest = {k: torch.empty_like(v.contiguous()) for k, v in state.items()}
    where = {k: v.data_ptr() for k, v in dest.items()}
    loaded = format.load({"model": dest, "train": {"step": 0}}, folder, manifest["files"], metadata, no_dist=True)
    assert loaded["train"]["step"] == 1
    for name, t in state.items():
        assert dest[name].data_ptr() == where[name] and torch.equal(dest[name], t), name


@pytest.mark.parametrize("damage, expected", [
    ("truncated, the manifest resealed", r"model.\w+ lies at bytes \d+\+\d+ of state/__0_0.distcp, which holds \d+"),
    ("truncated", r"bytes, the manifest says"),
    ("an offset past the end", r"model.big lies at bytes \d+\+\d+ of state/__0_\d.distcp, which holds \d+"),
    ("two items overlapping", r"the bytes of model.\w+ and model.\w+ overlap in state/__0_\d.distcp"),
    ("a length short of the chunk's elements", r"model.ids: its chunk at \(0,\) has 5 elements of torch.int64, more than its 32 bytes hold"),
    ("another shape", r"model.ids: its chunk at \(0,\) is 5 elements of torch.int64 of shape \(5,\), its bytes 40 of torch.int64 of shape \(1, 5\)"),
    ("a length past the chunk's elements", r"model.\w+: its chunk at \(0,?\) is \d+ elements of torch.\w+ of shape \(\d*,?\), its bytes \d+"),
    ("another dtype", r"model.ids: its chunk at \(0,\) is 5 elements of torch.int64 of shape \(5,\), its bytes 40 of torch.float64"),
    ("a chunk uncovered", r"model.view: its chunks hold 6 elements, its size \(4, 3\) 12"),
    ("an item in format 2 among format 3's", r"model.ids is stored in format 2, the other items in the other format"),
])
def test_a_damaged_or_forged_layout_is_refused_before_anything_is_allocated(tmp_path, monkeypatch, damage, expected):
    folder = publish_step(tmp_path, 1, {"model": model(), "train": {"step": 1}})
    size = (folder / STATE_FILE).stat().st_size

    def change(md):
        info = info_of(md, "model.ids")
        if damage == "an offset past the end":
            big = info_of(md, "model.big")
            big.offset = (folder / "state" / big.relative_path).stat().st_size + 8
        elif damage == "two items overlapping":
            mask = info_of(md, "model.mask")
            info.relative_path, info.offset = mask.relative_path, mask.offset
        elif damage == "a length short of the chunk's elements":
            info.length -= 8
        elif damage == "another shape":
            info.shape = (1, 5)
        elif damage == "a length past the chunk's elements":  # the last item, over bytes appended to the file
            last = max((i for i in md.storage_data.values() if f"state/{i.relative_path}" == STATE_FILE), key=lambda i: i.offset)
            assert last.dtype is not None and last.shape is not None
            last.length += 8
        elif damage == "another dtype":
            info.dtype = torch.float64
        elif damage == "a chunk uncovered":
            md.state_dict_metadata["model.view"].chunks[0].sizes = torch.Size([2, 3])
        elif damage == "an item in format 2 among format 3's":
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            md.storage_data[next(k for k in md.storage_data if k.fqn == "model.ids")] = _StorageInfo(info.relative_path, info.offset,
                                                                                                     info.length)

    if damage.startswith("truncated"):
        with open(folder / STATE_FILE, "r+b") as f:
            f.truncate(size - 100)
        if damage.endswith("resealed"):
            reseal(folder)
    else:
        if damage == "a length past the chunk's elements":
            with open(folder / STATE_FILE, "ab") as f:
                f.write(bytes(8))
        forge(folder, change)
    allocated, real_empty = [], torch.empty

    def spy(*args, **kwargs):
        allocated.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    with pytest.raises(storage.CheckpointError, match=expected):
        storage.read_tensors(folder, storage.listed_files_present(folder))  # what a resume does: sizes, then the metadata
    assert allocated == []  # refused from the metadata and the sizes alone: nothing allocated, no tensor byte read


def test_a_newest_checkpoint_truncated_with_its_manifest_resealed_falls_back_to_the_previous_one_in_a_run(tmp_path, caplog):
    import test_checkpoint_manager as tm

    tm.run_steps(tm.manager(tmp_path, interval=1, keep=5), tm.states(), 3)
    folder = tmp_path / storage.CHECKPOINTS / storage.step_dir_name(3)
    with open(folder / STATE_FILE, "r+b") as f:
        f.truncate((folder / STATE_FILE).stat().st_size - 4)
    reseal(folder)
    st = tm.states()
    resumed = tm.manager(tmp_path).load(st)
    assert resumed.step == 2 and st["counter"].value == 20
    assert "step_00000003" in caplog.text and "which holds" in caplog.text


def test_a_format_3_checkpoint_of_one_file_a_rank_as_the_previous_release_wrote_loads_the_same_tensors(tmp_path, monkeypatch):
    """Before a rank's items were split over format.PARTS files each rank wrote one file; the
    metadata names every item's file, so the reader reads either layout (the manifest format stays 3)."""
    state = model()
    monkeypatch.setattr(format, "PARTS", 1)
    folder = publish_step(tmp_path, 1, {"model": state, "train": {"step": 1}})
    monkeypatch.undo()
    manifest = storage.verify(folder)
    assert [n for n in manifest["files"] if n.startswith("state/__")] == [STATE_FILE] and format.PARTS == 2
    got = storage.read_tensors(folder, manifest)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_the_raw_item_class_is_made_once_even_when_a_ranks_two_files_are_written_at_once(tmp_path, monkeypatch):
    """Made lazily, RawItem was once made by both writer threads of a first save: the metadata then
    held a second class of that name, which does not pickle as this module's (a CI run's failure)."""
    import time

    made, real = [], format._raw_item_class

    def slow():
        made.append(1)
        time.sleep(0.2)  # both threads inside at once, were they both to make it
        return real()

    monkeypatch.delitem(format.__dict__, "RawItem", raising=False)
    monkeypatch.setattr(format, "_raw_item_class", slow)
    folder = publish_step(tmp_path, 1, {"model": model(), "train": {"step": 1}})
    assert made == [1] and format.PARTS == 2
    assert torch.equal(storage.read_tensors(folder, storage.verify(folder))["big"], model()["big"])
