import json
import os
import random

import numpy as np
import pytest
import torch

from checkpoint import io, rng
from checkpoint.manager import half_weights, truncate_metrics


class Explodes:
    """Pickling this raises: an exception in the middle of a save."""

    def __reduce__(self):
        raise OSError("injected failure between two file writes")


def publish_step(root, step, value=1.0):
    files = {io.RESUME_FILE: {"w": torch.full((4,), value)}, io.WEIGHTS_FILE: {"w": torch.full((4,), value).half()}}
    return io.publish(root, step, files, {"world_size": 1})


def test_a_published_checkpoint_has_every_file_and_a_manifest_with_sizes_and_hashes(tmp_path):
    folder = publish_step(tmp_path, 10)
    assert folder.name == "step_00000010"
    manifest = io.verify(folder)
    assert manifest["step"] == 10 and manifest["world_size"] == 1
    for name in (io.RESUME_FILE, io.WEIGHTS_FILE):
        assert manifest["files"][name]["bytes"] == (folder / name).stat().st_size
    assert torch.equal(io.safe_load(folder / io.RESUME_FILE)["w"], torch.ones(4))


def test_an_exception_between_two_file_writes_leaves_the_previous_checkpoint_and_nothing_new(tmp_path):
    publish_step(tmp_path, 10)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(io.CheckpointError, match=r"saving step 20 to .*step_00000020 failed: .*injected failure"):
        io.publish(tmp_path, 20, {io.RESUME_FILE: {"w": torch.zeros(4)}, io.WEIGHTS_FILE: Explodes()}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no step_20, no temporary left
    assert [s for s, _ in io.list_checkpoints(tmp_path)] == [10]
    io.verify(tmp_path / "step_00000010")


def test_a_temporary_folder_left_by_a_killed_save_is_never_listed_and_is_cleared(tmp_path):
    publish_step(tmp_path, 10)
    killed = tmp_path / ".tmp-step_00000020-deadbeef"
    killed.mkdir()
    (killed / io.RESUME_FILE).write_bytes(b"half")
    assert [s for s, _ in io.list_checkpoints(tmp_path)] == [10]
    assert io.clear_temporaries(tmp_path) == [killed] and not killed.exists()


def test_keep_last_k_prunes_the_oldest_first_and_only_after_publishing(tmp_path):
    for step in (10, 20, 30):
        publish_step(tmp_path, step)
    assert io.prune(tmp_path, 3) == []
    publish_step(tmp_path, 40)
    assert [s for s, _ in io.list_checkpoints(tmp_path)] == [40, 30, 20, 10]  # published before pruning
    removed = io.prune(tmp_path, 2)
    assert [p.name for p in removed] == ["step_00000010", "step_00000020"]
    assert [s for s, _ in io.list_checkpoints(tmp_path)] == [40, 30]


def test_saving_a_step_that_exists_replaces_it_whole(tmp_path):
    publish_step(tmp_path, 10, value=1.0)
    publish_step(tmp_path, 10, value=2.0)
    assert torch.equal(io.safe_load(tmp_path / "step_00000010" / io.RESUME_FILE)["w"], torch.full((4,), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]


@pytest.mark.parametrize("damage, match", [
    ("truncate", "bytes, the manifest says"),
    ("flip", "does not match the manifest"),
    ("delete", "missing"),
    ("manifest", "does not parse"),
])
def test_verify_names_the_file_and_what_failed(tmp_path, damage, match):
    folder = publish_step(tmp_path, 10)
    target = folder / io.RESUME_FILE
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        (folder / io.MANIFEST).write_text("{not json")
    with pytest.raises(io.CheckpointError, match=match):
        io.verify(folder)


def test_loading_never_runs_pickled_code(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pth"
    torch.save({"model": Payload()}, path)
    with pytest.raises(io.CheckpointError, match="not a plain checkpoint"):
        io.safe_load(path)
    assert not marker.exists()


def test_rng_state_round_trips_as_tensors_and_ints_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.normal(), torch.rand(1)
    state = rng.capture(torch.device("cpu"))
    torch.save(state, tmp_path / "rng.pth")
    expected = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    rng.restore(io.safe_load(tmp_path / "rng.pth"), torch.device("cpu"))
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_derived_seeds_are_a_pure_function_of_their_parts():
    assert rng.derive_seed(1, 0, 5, 2) == rng.derive_seed(1, 0, 5, 2)
    assert len({rng.derive_seed(1, 0, 5, i) for i in range(100)}) == 100
    assert 0 <= rng.derive_seed(2**40, 3) < 2**63


def test_model_sha256_is_over_fp32_bytes_in_state_dict_order():
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([3.0])}
    b = {"y": torch.tensor([3.0]), "x": torch.tensor([1.0, 2.0])}
    assert io.model_sha256(a) == io.model_sha256(dict(a)) != io.model_sha256(b)
    c = {"x": torch.tensor([1.0, 2.0 + 2**-20]), "y": torch.tensor([3.0])}
    assert io.model_sha256(a) != io.model_sha256(c)


def test_the_fp16_weights_keep_tied_tensors_as_one(tmp_path):
    w = torch.randn(5, 3)
    half = half_weights({"emb": w, "out": w, "norm": torch.ones(3)})
    assert half["emb"] is half["out"] and half["emb"].dtype == torch.float16


def test_metrics_past_the_resumed_step_and_half_written_lines_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo')
    assert truncate_metrics(path, 5) == 5
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
