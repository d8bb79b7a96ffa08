"""Sharded training and the one checkpoint format (docs/sharding.md): dist.strategy=fsdp (FSDP2),
every state through torch.distributed.checkpoint under the same rules as every checkpoint, a resume
that may change the strategy, and the same exactness on any world size."""
import contextlib
import io
import json
import os
import pickle
import signal

import pytest
import torch

import launch
from checkpoint import storage
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
def test_a_run_that_moves_from_ddp_to_fsdp_and_back_on_other_world_sizes_is_the_uninterrupted_run_bit_for_bit(fsdp, one, tmp_path):
    """Halted on 2 processes under ddp, resumed on 3 under fsdp, then on 1 under ddp, all canonical:
    every loss and the weights at every halt equal the run that never stopped (sharded, on one
    process), and the unsharded canonical run's at every step."""
    moved = tmp_path / "moved"
    launch.run(2, *fsdp, "dist.strategy=ddp", "train.halt_at=3", f"out_dir={moved}")  # steps 1-3, ddp on 2
    launch.assert_same_as_reference_at(moved, one, 3)
    proc = launch.run(3, *fsdp, "train.halt_at=5", f"out_dir={moved}")  # 4-5, fsdp on 3, from ddp's states
    assert "dist.strategy was ddp, now fsdp: the checkpoint's states are loaded exactly" in proc.stderr
    launch.assert_same_as_reference_at(moved, one, 5)
    assert launch.in_process(*fsdp, "dist.strategy=ddp", f"out_dir={moved}")[0] == 0  # 6-7, ddp on 1, from fsdp's shards
    launch.assert_same_as_reference_at(moved, one, 7)
    ddp = tmp_path / "ddp"  # the same arithmetic as the unsharded canonical reduction, at every step
    assert launch.in_process(*fsdp, "dist.strategy=ddp", "checkpoint.interval=1", f"out_dir={ddp}")[0] == 0
    assert shas(ddp, range(1, 8)) == shas(one, range(1, 8))


@pytest.mark.e2e
def test_fsdp_canonical_on_two_processes_is_the_one_process_run(fsdp, one, tmp_path):
    launch.run(2, *fsdp, "train.halt_at=3", f"out_dir={tmp_path}")
    launch.assert_same_as_reference_at(tmp_path, one, 3)


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
    # step 2 published from the background threads; step 4's states written by both ranks, rank 0
    # inside the (slowed) files of its publish, nothing of step 4 published yet
    launch.wait_for(lambda: (ckpts / "step_00000002").exists() and any(ckpts.glob(".tmp-step_00000004-*/state/.metadata")),
                    proc=proc)
    launch.kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert "writing in the background" in (tmp_path / "log").read_text()
    assert [s for s, _ in list_checkpoints(ckpts)] == [2]
    code, err = launch.in_process(*args)
    assert code == 0 and "left by an interrupted save" in err and "loaded" in err and "step_00000002" in err, err
    launch.assert_same_as_reference_at(out, one, 7)


@pytest.mark.unit
def test_two_async_fsdp_runs_in_one_process_each_save_in_the_background(fsdp, tmp_path):
    """The manager's process group and thread are its own, made at its first save and freed at the
    end: a second run in the same process saves in the background as the first did."""
    for run in ("a", "b"):
        code, err = launch.in_process(*fsdp, "train.steps=4", "checkpoint.interval=2", "checkpoint.async=true", f"out_dir={tmp_path / run}")
        assert code == 0 and "writing in the background" in err, err
        assert [s for s, _ in list_checkpoints(tmp_path / run / "checkpoints")] == [4, 2]


@pytest.mark.unit
def test_a_flipped_byte_in_one_shard_falls_back_to_the_previous_checkpoint(fsdp, tmp_path):
    out = tmp_path / "run"
    assert launch.in_process(*fsdp, "train.halt_at=4", "checkpoint.interval=2", f"out_dir={out}")[0] == 0
    shard = out / "checkpoints" / "step_00000004" / "state" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, err = launch.in_process(*fsdp, "train.halt_at=5", "checkpoint.interval=2", f"out_dir={out}")
    assert code == 0 and "skipping checkpoint" in err and "__0_0.distcp: sha256" in err, err
    assert "loaded" in err and "step_00000002" in err


@pytest.mark.unit
def test_inspect_and_export_of_a_sharded_checkpoint_give_the_weights_of_the_run(one, tmp_path):
    from checkpoint import half_weights
    from cli import main
    from model.formats import to_llama

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["inspect", str(one)]) == 0
    seen = json.loads(out.getvalue())
    assert seen["strategy"] == "fsdp" and seen["model_sha256"] == launch.sha_at(one, 7) and seen["manifest_model_sha256_matches"]
    assert any(name.startswith("state/") for name in seen["files"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["export", str(one), "--format", "minimind", "--out", str(tmp_path / "w.pth")]) == 0
    exported = torch.load(tmp_path / "w.pth", weights_only=True)
    folder = one / "checkpoints" / "step_00000007"
    manifest = storage.verify(folder)
    full = storage.read_tensors(folder, manifest)
    assert storage.model_sha256(full, manifest["architecture"]) == launch.sha_at(one, 7)
    expected = to_llama(half_weights(full), lm_head=True)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _connection(fd: int) -> bytes:
    """A pickle that builds multiprocessing's Connection over `fd`, looked up where DCP re-exports it
    (its destructor closes the descriptor): what an allow-list by module prefix would admit."""
    return (b"ctorch.distributed.checkpoint._experimental.checkpoint_process\nConnection\n"
            + b"K" + bytes([fd]) + b"\x85R.")


@pytest.mark.unit
def test_the_states_metadata_is_unpickled_by_an_explicit_allow_list_and_nothing_else_is_built(fsdp, tmp_path):
    from cli import main

    out = tmp_path / "run"
    assert launch.in_process(*fsdp, "train.steps=2", "checkpoint.interval=1", f"out_dir={out}")[0] == 0
    folder = out / "checkpoints" / "step_00000002"
    manifest = storage.verify(folder)
    assert storage.model_sha256(storage.read_tensors(folder, manifest), manifest["architecture"]) == launch.sha_at(out, 2)
    read, write = os.pipe()
    try:
        for payload, named in ((pickle.dumps(_Boom()), "posix.system"),
                               (_connection(read), "torch.distributed.checkpoint._experimental.checkpoint_process.Connection")):
            (folder / "state" / ".metadata").write_bytes(payload)
            manifest = json.loads((folder / storage.MANIFEST).read_text())
            import hashlib
            manifest["files"]["state/.metadata"] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
            (folder / storage.MANIFEST).write_text(json.dumps(manifest))
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                assert main(["inspect", str(folder)]) == 1  # a tool: a damaged checkpoint, named
            assert f"{named} is not one of DCP's metadata classes: refused, nothing of it was built" in err.getvalue()
            os.fstat(read)  # the descriptor is still open: no Connection was built (and destroyed) around it
        code, err = launch.in_process(*fsdp, "train.steps=3", f"out_dir={out}")  # a run: falls back to step 1
        assert code == 0 and "skipping checkpoint" in err and "Connection is not one of DCP's metadata classes" in err, err
        assert "loaded" in err and "step_00000001" in err
    finally:
        os.close(read)
        os.close(write)
    assert not (tmp_path / "PWNED").exists() and not (launch.ROOT / "PWNED").exists()


@pytest.mark.unit
def test_the_private_torch_names_this_repository_leans_on_are_still_there():
    """Kept to checkpoint/format.py, checkpoint/manager.py, runtime/setup.py and runtime/sharding.py
    with torch pinned; when an upgrade moves one of these, this fails first, naming it
    (docs/sharding.md, "Private APIs")."""
    from torch.distributed import distributed_c10d
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.fsdp import FSDPModule

    assert callable(set_element) and callable(_copy_state_dict) and callable(_create_cpu_state_dict)
    assert callable(distributed_c10d._get_default_store) and issubclass(CheckpointException, BaseException)
    assert [f.name for f in __import__("dataclasses").fields(_StorageInfo)][:3] == ["relative_path", "offset", "length"]
    assert torch.serialization._get_layout("torch.strided") is torch.strided
    assert torch._foreach_norm([torch.ones(4)], 2.0)[0].item() == 2.0
    for hook in ("set_custom_reduce_scatter", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms",
                 "set_requires_gradient_sync"):
        assert hasattr(FSDPModule, hook), hook


@pytest.mark.unit
def test_load_full_hands_the_tensors_over_in_the_models_order_whatever_the_dicts_order(monkeypatch):
    """FSDP's full-state load scatters one collective per key in the given dict's order: two ranks
    whose dicts list the keys otherwise (read from a file, built through a set: string hashing differs
    per process) would pair different tensors and abort. load_full hands them over in the model's order."""
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    from runtime import sharding

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    seen = []
    monkeypatch.setattr(dcp_state_dict, "set_model_state_dict", lambda m, state, options: seen.append(list(state)))
    given = dict(reversed(list(model.state_dict().items())))
    sharding.load_full(model, given, strict=False)
    assert seen == [list(model.state_dict())]
