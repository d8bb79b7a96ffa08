"""Sharded training (docs/sharding.md): dist.strategy=fsdp (FSDP2) with torch.distributed.checkpoint
shards published under the same rules as every checkpoint, and the same exactness on any world size."""
import contextlib
import io
import json
import os
import pickle
import signal

import pytest
import torch

import launch
from checkpoint import sharded, storage
from checkpoint.storage import list_checkpoints


@pytest.fixture(scope="module")
def fsdp(tiny) -> list[str]:
    """The tiny run, sharded, with the canonical reduction: 12 samples a step in 6 micro-batches of
    2 (1, 2, 3 and 6 processes divide it), gradient clipping on; checkpoints at halts and at the end."""
    return [*tiny, "dist.strategy=fsdp", "dist.reduce=canonical", "train.global_batch=12", "train.micro_batch=2",
            "train.steps=7", "train.grad_clip=0.5", "checkpoint.keep=100"]


@pytest.fixture(scope="module")
def one(fsdp, tmp_path_factory):
    """The uninterrupted sharded run on one process (in this process), a checkpoint every step."""
    out = tmp_path_factory.mktemp("fsdp") / "one"
    code, err = launch.in_process(*fsdp, "checkpoint.interval=1", f"out_dir={out}")
    assert code == 0, err
    return out


def shas(out, steps) -> list[str]:
    return [launch.sha_at(out, s) for s in steps]


@pytest.mark.e2e
def test_fsdp_canonical_is_bit_identical_on_1_2_and_3_processes_across_resumes_and_equal_to_ddp_canonical(fsdp, one, tmp_path):
    moved = tmp_path / "moved"
    launch.run(2, *fsdp, "train.halt_at=3", f"out_dir={moved}")  # steps 1-3 on 2 processes
    launch.assert_same_as_reference_at(moved, one, 3)
    launch.run(3, *fsdp, "train.halt_at=5", f"out_dir={moved}")  # 4-5 on 3, from 2's shards
    launch.assert_same_as_reference_at(moved, one, 5)
    assert launch.in_process(*fsdp, f"out_dir={moved}")[0] == 0  # 6-7 on 1, from 3's shards
    launch.assert_same_as_reference_at(moved, one, 7)  # every loss, and the weights at 3, 5 and 7 above
    ddp = tmp_path / "ddp"  # the same arithmetic as the unsharded canonical reduction
    assert launch.in_process(*fsdp, "dist.strategy=ddp", "checkpoint.interval=1", f"out_dir={ddp}")[0] == 0
    assert shas(ddp, range(1, 8)) == shas(one, range(1, 8))


@pytest.mark.e2e
def test_fsdp_with_its_own_reduce_scatter_resumes_exactly_on_the_same_world_size(fsdp, tmp_path):
    own = [*fsdp, "dist.reduce=ddp", "train.steps=5", "checkpoint.interval=3"]
    launch.run(2, *own, f"out_dir={tmp_path / 'ref'}")
    step3 = tmp_path / "ref" / "checkpoints" / "step_00000003"
    launch.run(2, *own, f"checkpoint.resume={step3}", f"out_dir={tmp_path / 'resumed'}")
    assert launch.sha_at(tmp_path / "resumed", 5) == launch.sha_at(tmp_path / "ref", 5)
    ref = [m["loss"] for m in launch.metrics(tmp_path / "ref")][3:]
    assert [m["loss"] for m in launch.metrics(tmp_path / "resumed")] == ref


@pytest.mark.e2e
def test_a_sigkill_inside_an_async_sharded_save_resumes_exactly_from_one_written_in_the_background(fsdp, one, tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    args = [*fsdp, "checkpoint.interval=2", "checkpoint.async=true", f"out_dir={out}"]
    proc = launch.start(launch.command(2, *args, script=launch.SLOW_SAVE), tmp_path / "log", env={"SLOW_SAVE_S": "1"})
    # step 2 published from the background threads; step 4's shards written, rank 0 inside its own
    # (slowed) files, nothing of step 4 published yet
    launch.wait_for(lambda: (ckpts / "step_00000002").exists() and any(ckpts.glob(".tmp-step_00000004-*/shards/.metadata")),
                    proc=proc)
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert "writing in the background" in (tmp_path / "log").read_text()
    assert [s for s, _ in list_checkpoints(ckpts)] == [2]
    code, err = launch.in_process(*args)
    assert code == 0 and "left by an interrupted save" in err and "loaded" in err and "step_00000002" in err, err
    launch.assert_same_as_reference_at(out, one, 7)


@pytest.mark.unit
def test_a_flipped_byte_in_one_shard_falls_back_to_the_previous_checkpoint(fsdp, tmp_path):
    out = tmp_path / "run"
    assert launch.in_process(*fsdp, "train.halt_at=4", "checkpoint.interval=2", f"out_dir={out}")[0] == 0
    shard = out / "checkpoints" / "step_00000004" / "shards" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, err = launch.in_process(*fsdp, "train.halt_at=5", "checkpoint.interval=2", f"out_dir={out}")
    assert code == 0 and "skipping checkpoint step 4" in err and "__0_0.distcp: sha256" in err, err
    assert "loaded" in err and "step_00000002" in err


@pytest.mark.unit
def test_inspect_and_export_of_a_sharded_checkpoint_give_the_weights_of_the_run(fsdp, one, tmp_path):
    from checkpoint.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["inspect", str(one)]) == 0
    seen = json.loads(out.getvalue())
    assert seen["sharded"] and seen["model_sha256"] == launch.sha_at(one, 7) and seen["manifest_model_sha256_matches"]
    assert any(name.startswith("shards/") for name in seen["files"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["export", str(one), "--format", "minimind", "--out", str(tmp_path / "w.pth")]) == 0
    exported = torch.load(tmp_path / "w.pth", weights_only=True)
    full = sharded.full_model(one / "checkpoints" / "step_00000007")
    assert storage.model_sha256(full) == launch.sha_at(one, 7)
    from checkpoint.manager import half_weights
    from weights import to_llama

    expected = to_llama(half_weights(full), lm_head=True)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


@pytest.mark.unit
def test_a_resume_under_the_other_strategy_is_refused_naming_both(fsdp, one, tmp_path):
    code, err = launch.in_process(*fsdp, "dist.strategy=ddp", "train.steps=8", f"out_dir={one}")
    assert code == 2 and "written by a dist.strategy=fsdp (sharded) run; this run is dist.strategy=ddp" in err, err
    plain = tmp_path / "plain"
    assert launch.in_process(*fsdp, "dist.strategy=ddp", "train.steps=2", f"out_dir={plain}")[0] == 0
    code, err = launch.in_process(*fsdp, "train.steps=3", f"out_dir={plain}")
    assert code == 2 and "written by a dist.strategy=ddp (not sharded) run; this run is dist.strategy=fsdp" in err, err


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.unit
def test_the_shards_metadata_is_unpickled_by_an_allow_list_and_code_in_it_never_runs(fsdp, tmp_path):
    out = tmp_path / "run"
    assert launch.in_process(*fsdp, "train.steps=1", f"out_dir={out}")[0] == 0
    folder = out / "checkpoints" / "step_00000001"
    assert storage.model_sha256(sharded.full_model(folder)) == launch.sha_at(out, 1)  # DCP's own metadata loads
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(storage.CheckpointError, match="posix.system is not DCP metadata: refused"):
        sharded.full_model(folder)
    assert not (tmp_path / "PWNED").exists() and not (launch.ROOT / "PWNED").exists()


@pytest.mark.unit
def test_the_private_torch_names_this_repository_leans_on_are_still_there():
    """Kept to two modules (checkpoint/sharded.py, runtime/sharding.py) and torch pinned; when an
    upgrade moves one of these, this fails first, naming it (docs/sharding.md, "Private APIs")."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.fsdp import FSDPModule

    assert callable(set_element) and callable(FileSystemReader._get_metadata_path)
    assert torch.serialization._get_layout("torch.strided") is torch.strided
    assert torch._foreach_norm([torch.ones(4)], 2.0)[0].item() == 2.0
    for hook in ("set_custom_reduce_scatter", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms",
                 "set_requires_gradient_sync"):
        assert hasattr(FSDPModule, hook), hook
