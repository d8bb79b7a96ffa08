"""One model identity (docs/design.md "One model identity"): the same weights from any source give
one identity, another name, shape, byte or head layout another; every pin uses it, so a run whose
base or reference is a Hugging Face folder resumes and exports; loading a pinned model leaves the
run's generators alone."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import launch
from checkpoint import storage
from model import MiniMindLM, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(dim=32, n_layers=2, n_kv_heads=2, seq_len=32)


@pytest.mark.unit
def test_the_identity_is_one_in_any_dict_order_and_another_for_a_name_a_shape_or_a_byte():
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.tensor([3.0])}
    arch = ModelConfig(**SMALL).architecture()
    same = storage.model_sha256(a, arch)
    assert storage.model_sha256({"y": a["y"], "x": a["x"]}, arch) == same  # the order a source was read in
    assert storage.model_sha256({"x": a["x"].double(), "y": a["y"].half()}, arch) == same  # fp32 bytes, as the weights are
    assert storage.model_sha256({"z": a["x"], "y": a["y"]}, arch) != same  # another name
    assert storage.model_sha256({"x": a["x"].reshape(3, 2), "y": a["y"]}, arch) != same  # the same bytes, another shape
    assert storage.model_sha256({"x": a["x"] + torch.tensor(2.0**-20), "y": a["y"]}, arch) != same
    assert storage.model_sha256({"y": a["y"], "x": a["x"]}, {}) != same  # the architecture is part of it


@pytest.mark.unit
def test_two_seeded_inits_with_4_and_8_heads_share_their_bytes_but_not_their_identity():
    four, eight = ModelConfig(**SMALL, n_heads=4), ModelConfig(**{**SMALL, "n_kv_heads": 4}, n_heads=8)
    models = []
    for cfg in (four, eight):
        torch.manual_seed(0)
        models.append(MiniMindLM(cfg).eval())
    sa, sb = (m.state_dict() for m in models)
    assert [(k, v.shape) for k, v in sa.items()] == [(k, v.shape) for k, v in sb.items()]
    assert storage.legacy_model_sha256(sa) == storage.legacy_model_sha256(sb)  # the earlier hash could not tell them apart
    x = torch.randint(0, four.vocab_size, (1, 16))
    with torch.no_grad():
        assert not torch.equal(models[0](x)[0], models[1](x)[0])  # two functions
    assert storage.model_sha256(sa, four.architecture()) != storage.model_sha256(sb, eight.architecture())
    # How a width is given does not matter, what it is does.
    assert ModelConfig(**SMALL, n_heads=4).architecture() == ModelConfig(**SMALL, n_heads=4, head_dim=8).architecture()


@pytest.mark.unit
def test_reading_a_seeded_init_as_a_base_or_reference_leaves_pythons_numpys_and_torchs_generators_alone():
    from weights import base_weights

    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    state, record = base_weights(ModelConfig(**SMALL, n_heads=4), 1337, "")
    assert record is None and state
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny):
    """A base run, its Hugging Face export, and the same fp32 weights as a MiniMind .pth and a safetensors file."""
    from safetensors.torch import save_file

    from model.formats import to_llama
    from weights import checkpoint_weights

    root = tmp_path_factory.mktemp("identity")
    code, err = launch.in_process(*tiny, "model.seq_len=96", "train.steps=4", f"out_dir={root / 'base'}")
    assert code == 0, err
    proc = subprocess.run([sys.executable, "-m", "checkpoint", "export", str(root / "base"), "--format", "hf", "--out", str(root / "hf")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _, _, _, state = checkpoint_weights(root / "base")
    torch.save(to_llama({k: v.clone() for k, v in state.items()}), root / "minimind.pth")
    save_file({k: v.contiguous() for k, v in reversed(list(state.items()))}, str(root / "ours.safetensors"))
    return root


IDENTITY_OF = """
import json, sys
sys.path.insert(0, sys.argv[1])
from checkpoint import storage
from weights import base_weights, identity, model_config
manifest = storage.find_checkpoint(sys.argv[2])[1]
cfg = model_config(sys.argv[2], manifest)
print(json.dumps({"manifest": manifest["model_sha256"], **{s: identity(base_weights(cfg, 0, s)[0], cfg) for s in sys.argv[3:]}}))
"""


@pytest.mark.e2e
def test_the_same_weights_from_a_run_folder_an_hf_folder_a_minimind_pth_and_safetensors_have_one_identity_in_every_process(base_run):
    sources = [str(base_run / "base"), str(base_run / "hf"), str(base_run / "minimind.pth"), str(base_run / "ours.safetensors")]
    seen = []
    for hash_seed in ("1", "2"):  # the order a dict or a set is read in changes from process to process
        proc = subprocess.run([sys.executable, "-c", IDENTITY_OF, str(ROOT), str(base_run / "base"), *sources], cwd=ROOT, text=True,
                              capture_output=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert proc.returncode == 0, proc.stderr
        seen.append(json.loads(proc.stdout))
    assert seen[0] == seen[1]
    assert len(set(seen[0].values())) == 1, seen[0]


def check_halted_and_resumed_equals_uninterrupted(args: list[str], root: Path) -> None:
    launch.run(0, *args, f"out_dir={root / 'one'}")
    launch.run(0, *args, "train.halt_at=2", f"out_dir={root / 'two'}")
    resumed = launch.run(0, *args, f"out_dir={root / 'two'}")
    assert "verified" in resumed.stderr, resumed.stderr[-3000:]
    launch.assert_identical(root / "two", root / "one")
    for fmt in ("hf", "minimind"):
        proc = subprocess.run([sys.executable, "-m", "checkpoint", "export", str(root / "two"), "--format", fmt, "--out",
                               str(root / f"out-{fmt}")], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.e2e
def test_a_lora_run_over_an_hf_folder_halted_and_resumed_in_new_processes_is_the_uninterrupted_run_and_exports(base_run, tiny, tmp_path):
    lora = ["train.lora.rank=4", "train.lora.targets=q_proj,v_proj", "train.steps=4", f"model.init_from={base_run / 'hf'}"]
    check_halted_and_resumed_equals_uninterrupted([*tiny, *lora], tmp_path)


@pytest.mark.e2e
def test_a_dpo_run_whose_reference_is_an_hf_folder_halted_and_resumed_in_new_processes_is_the_uninterrupted_run(base_run, tmp_path):
    from test_dpo import base, pairs, write

    prefs = write(tmp_path / "dpo.jsonl", pairs(24))
    args = [*base(prefs, tmp_path / "cache"), "train.steps=4", f"model.init_from={base_run / 'hf'}"]
    check_halted_and_resumed_equals_uninterrupted(args, tmp_path)


@pytest.mark.unit
def test_a_step_folder_whose_metadata_swaps_two_tensors_and_whose_manifest_was_updated_falls_back_to_the_previous_one(tmp_path, caplog):
    import hashlib
    import logging
    import pickle

    from checkpoint import CheckpointConfig, CheckpointManager, ModelState
    from checkpoint.format import METADATA, read_metadata
    from test_checkpoint_manager import OneProcess, Train, meta, run_steps

    def states():
        torch.manual_seed(0)
        return {"model": ModelState(torch.nn.Linear(3, 3, bias=False).requires_grad_(False)), "train": Train()}

    mgr = CheckpointManager(CheckpointConfig(interval=1, keep=5), tmp_path, OneProcess(), meta())
    st = states()
    st["extra"] = ModelState(torch.nn.Linear(3, 3, bias=False))  # a second tensor of the same shape and dtype
    st["model"].model.weight.add_(1.0)
    for step in (1, 2):
        st["train"].step = step
        mgr.save(step, st, background=False)
    folder = tmp_path / "checkpoints" / "step_00000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    name = f"state/{METADATA}"
    md = read_metadata((folder / name).read_bytes(), folder / name)
    keys = {k.fqn: k for k in md.storage_data}
    a, b = keys["model.weight"], keys["extra.weight"]
    md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]  # each name reads the other's bytes
    data = pickle.dumps(md)
    (folder / name).write_bytes(data)
    manifest["files"][name] = {**manifest["files"][name], "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    fresh = states()
    fresh["extra"] = ModelState(torch.nn.Linear(3, 3, bias=False))
    with caplog.at_level(logging.WARNING, logger="minimind"):
        resumed = CheckpointManager(CheckpointConfig(), tmp_path, OneProcess(), meta()).load(fresh)
    assert resumed.step == 1, "the swapped tensors were loaded"
    assert "the loaded model's identity" in caplog.text and "step_00000002" in caplog.text
    assert torch.equal(fresh["model"].model.weight, st["model"].model.weight)
