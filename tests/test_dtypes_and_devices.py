"""The CUDA path's pieces that run on a CPU (mixed precision, the GradScaler's state, map_location),
and the CUDA-only checks, which skip without a GPU (scripts/gpu_check.sh checks the same on one with its own launches)."""
import pytest
import torch
from torch import serialization

import launch
from checkpoint import storage
from configs import ConfigError, load_config

pytestmark = pytest.mark.e2e


def test_an_unknown_dtype_is_an_error_naming_the_choices():
    with pytest.raises(ConfigError, match="train.dtype: expected one of float32, bfloat16, float16, got 'float64'"):
        load_config(None, ["train.dtype=float64"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_resumes_bit_identically_with_the_scalers_state(tmp_path, tiny, dtype):
    args = [*tiny, "train.steps=8", f"train.dtype={dtype}"]
    assert launch.in_process(*args, f"out_dir={tmp_path / 'ref'}")[0] == 0
    assert launch.in_process(*args, "train.halt_at=3", f"out_dir={tmp_path / 'run'}")[0] == 0
    assert launch.in_process(*args, f"out_dir={tmp_path / 'run'}")[0] == 0
    assert launch.losses(tmp_path / "run") == launch.losses(tmp_path / "ref")
    assert launch.inspect(tmp_path / "run")["model_sha256"] == launch.inspect(tmp_path / "ref")["model_sha256"]
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    keys = {k for k in storage.read_metadata(folder, storage.verify(folder)).state_dict_metadata if k.startswith("scaler.")}
    if dtype == "float16":  # the scaler's state is in the checkpoint (the resume above is exact with it)
        assert {"scaler.scale", "scaler._growth_tracker"} <= keys
    else:
        assert not keys


def test_a_float32_checkpoint_continues_in_float16_with_a_fresh_scaler(tmp_path, tiny):
    assert launch.in_process(*tiny, "train.halt_at=3", f"out_dir={tmp_path}")[0] == 0
    code, err = launch.in_process(*tiny, "train.steps=5", "train.dtype=float16", f"out_dir={tmp_path}")
    assert code == 0 and "no 'scaler' state in the checkpoint; it starts fresh" in err


def test_a_checkpoint_written_on_cuda_loads_on_a_cpu_only_machine(tmp_path):
    def as_if_on_cuda(obj):
        return "cuda:0" if getattr(obj, "device", None) is not None and obj.device.type == "cpu" else None

    serialization.register_package(0, as_if_on_cuda, lambda obj, location: None)
    try:
        torch.save({"model": {"w": torch.arange(4.0)}}, tmp_path / storage.OLD_WEIGHTS_FILE)  # format 2's pickled fp16 file
    finally:
        serialization._package_registry[:] = [p for p in serialization._package_registry if p[1] is not as_if_on_cuda]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / storage.OLD_WEIGHTS_FILE, weights_only=True)  # what a load without map_location does
    loaded = storage.safe_load(tmp_path / storage.OLD_WEIGHTS_FILE)  # ours maps to the CPU first
    assert loaded["model"]["w"].device.type == "cpu" and torch.equal(loaded["model"]["w"], torch.arange(4.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_one_is_a_config_error_not_a_traceback(tmp_path, tiny):
    code, err = launch.in_process(*tiny, "runtime.device=cuda", f"out_dir={tmp_path}")
    assert code == 2 and "runtime.device=cuda but CUDA is not available" in err and "Traceback" not in err


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=(
    "needs CUDA; scripts/gpu_check.sh checks the same halt-and-resume exactness on a GPU with launches of its own "
    "(it does not run pytest): bash scripts/test.sh on a CUDA machine runs these"))


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_one_gpu_twelve_steps_equal_six_and_six_with_deterministic_kernels(tmp_path, tiny, dtype):
    args = [*tiny, "train.steps=12", f"train.dtype={dtype}", "runtime.deterministic=true", "runtime.device=cuda"]
    launch.run(1, *args, f"out_dir={tmp_path / 'ref'}")
    launch.run(1, *args, "train.halt_at=6", f"out_dir={tmp_path / 'run'}")
    launch.run(1, *args, f"out_dir={tmp_path / 'run'}")
    assert launch.inspect(tmp_path / "run")["model_sha256"] == launch.inspect(tmp_path / "ref")["model_sha256"]
    assert launch.losses(tmp_path / "run") == launch.losses(tmp_path / "ref")


@cuda
def test_two_processes_on_gpus_resume_bit_identically(tmp_path, tiny):
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"  # nccl refuses two ranks on one GPU
    args = [*tiny, "train.steps=12", "runtime.deterministic=true", "runtime.device=cuda", f"dist.backend={backend}"]
    launch.run(2, *args, f"out_dir={tmp_path / 'ref'}")
    launch.run(2, *args, "train.halt_at=6", f"out_dir={tmp_path / 'run'}")
    launch.run(2, *args, f"out_dir={tmp_path / 'run'}")
    assert launch.inspect(tmp_path / "run")["model_sha256"] == launch.inspect(tmp_path / "ref")["model_sha256"]
