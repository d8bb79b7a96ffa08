"""train.lora (model/lora.py, weights/adapters.py, docs/lora.md): adapters over a frozen base
pinned by its hash; PEFT reads our adapters and gives our logits; MiniMind's LoRA .pth comes in
with MiniMind's own logits; exact on any world size; bad input named."""
from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

import launch
from test_models import UPSTREAM, minimind_config, needs_upstream, upstream

ROOT = Path(__file__).resolve().parents[1]
EXACT = ["dist.reduce=canonical", "train.global_batch=12", "train.steps=6", "checkpoint.keep=10"]
# alpha != rank (scale 2), attention and feed-forward targets, adapter dropout: every part of the update
LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=q_proj,v_proj,o_proj,gate_proj,down_proj",
        "train.lora.dropout=0.1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny):
    """A base run (the whole model trains), then a LoRA run over it, uninterrupted, in this process."""
    root = tmp_path_factory.mktemp("lora")
    for name, extra in (("base", []), ("lora", [*LORA, f"model.init_from={root / 'base'}"])):
        code, err = launch.in_process(*tiny, *EXACT, *extra, f"out_dir={root / name}")
        assert code == 0, err
    return root


def peft_model(hf: Path, adapter: Path):
    """transformers' model of `hf` with PEFT's adapter from `adapter`; PEFT's warnings are errors (a
    key it does not find only warns, and the adapter would silently do nothing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.filterwarnings("error", module=r"peft(\..*)?$")
        model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
        return PeftModel.from_pretrained(model, str(adapter)).eval()


@pytest.mark.e2e
def test_peft_reads_our_adapter_over_our_hf_export_of_the_base_and_gives_our_logits(runs, tmp_path):
    import weights

    weights.export(runs / "base", "hf", tmp_path / "hf")
    weights.export(runs / "lora", "peft", tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == ("LORA", 4, 8.0, "CAUSAL_LM")
    ours = weights.load_model(runs / "lora", fp32=True)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, ours.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)[0]
        got = peft_model(tmp_path / "hf", tmp_path / "peft")(ids).logits
    assert torch.equal(want, got), (want - got).abs().max().item()  # PEFT's order of operations: measured 0.0
    # The merged export (W + scale * B @ A) is the adapter applied, up to fp32 rounding of the fold:
    # measured 2.4e-07 here; 10x that allowed.
    weights.export(runs / "lora", "hf", tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        gap = (merged(ids).logits - want).abs().max().item()
    assert 0 < gap <= 2.4e-6, gap
    # A key PEFT does not find is an error here, not a silently idle adapter
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "qproj"): v for k, v in tensors.items()}, str(tmp_path / "peft" / "adapter_model.safetensors"))
    with pytest.raises(Exception, match="missing adapter keys|unexpected|qproj"):
        peft_model(tmp_path / "hf", tmp_path / "peft")


@pytest.mark.e2e
def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_and_pins_the_base_by_its_hash(runs):
    from checkpoint import format, storage

    manifest = launch.storage_manifest(runs / "lora", 6)
    folder = runs / "lora" / "checkpoints" / "step_00000006"
    metadata = storage.read_metadata(folder, manifest)
    model_keys = {k for k in format.keys(metadata) if k.startswith("model.")}
    optimizer_keys = {k for k in format.keys(metadata) if k.startswith("optimizer.state.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), sorted(model_keys)[:4]
    assert optimizer_keys and all(".lora_A." in k or ".lora_B." in k for k in optimizer_keys), sorted(optimizer_keys)[:4]
    assert len(model_keys) == 2 * 5 * 2  # A and B on 5 targets in 2 blocks
    base = launch.storage_manifest(runs / "base", 6)
    assert manifest["base"]["sha256"] == base["model_sha256"]  # the weights it was trained over, by their hash
    assert manifest["base"]["init_from"]["path"].endswith("step_00000006")
    # the adapters' bytes, not the base's (scripts/bench.py measures the folders of the 26M shape)
    base_folder = runs / "base" / "checkpoints" / "step_00000006"
    full = format.tensor_bytes(storage.read_metadata(base_folder, launch.storage_manifest(runs / "base", 6)), "model.")
    assert format.tensor_bytes(metadata, "model.") == 4 * 2 * (4 * (32 + 32) + 4 * (32 + 16) + 4 * (32 + 32) + 4 * (32 + 128)
                                                               + 4 * (128 + 32)) < full / 10


@pytest.mark.unit
def test_fresh_adapters_leave_the_base_model_as_it_was_and_train_alone(tiny):
    """B = 0: the adapted model computes the base model's logits, bit for bit; only the adapters
    require a gradient, and the optimizer holds them alone."""
    from model import MiniMindLM, ModelConfig
    from model.lora import LoRAConfig, attach
    from objectives import make_optimizer
    from configs import load_config

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    base = MiniMindLM(cfg).eval()
    adapted = MiniMindLM(cfg)
    adapted.load_state_dict(base.state_dict())
    before = torch.get_rng_state()
    attach(adapted, LoRAConfig(rank=4, alpha=8, targets="q_proj,o_proj,up_proj"), seed=1337)
    assert torch.equal(torch.get_rng_state(), before)  # the adapters' init draws from a generator of its own
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(adapted.eval()(ids)[0], base(ids)[0])
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.{m}.lora_{x}.weight" for i in range(2) for m in ("attention.wq", "attention.wo", "feed_forward.w3")
                         for x in "AB"}
    opt = make_optimizer(adapted, load_config(None).train)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in adapted.named_parameters() if p.requires_grad}
    # the same seed draws the same adapters; another seed others
    again = MiniMindLM(cfg)
    attach(again, LoRAConfig(rank=4, alpha=8, targets="q_proj,o_proj,up_proj"), seed=1337)
    assert torch.equal(again.layers[1].attention.wo.lora_A.weight, adapted.layers[1].attention.wo.lora_A.weight)


@pytest.mark.e2e
def test_lora_halted_on_2_processes_and_resumed_on_3_under_fsdp_equals_the_one_process_run(runs, tiny, tmp_path):
    args = [*tiny, *EXACT, *LORA, f"model.init_from={runs / 'base'}", f"out_dir={tmp_path / 'moved'}"]
    launch.run(2, *args, "train.halt_at=3")
    resumed = launch.run(3, *args, "dist.strategy=fsdp")
    assert "verified" in resumed.stderr
    launch.assert_identical(tmp_path / "moved", runs / "lora")


@pytest.mark.e2e
def test_a_resume_over_another_base_is_refused_naming_both_hashes_with_nothing_lost(runs, tiny, tmp_path):
    import shutil

    out = tmp_path / "run"
    args = [*tiny, *EXACT, *LORA, f"out_dir={out}"]
    assert launch.in_process(*args, f"model.init_from={runs / 'base'}", "train.halt_at=2")[0] == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    other = tmp_path / "other"
    shutil.copytree(runs / "lora", other)  # another model: the LoRA run's merged weights
    code, err = launch.in_process(*args, f"model.init_from={other}")
    base = launch.storage_manifest(runs / "base", 6)["model_sha256"]
    assert code == 2 and "Traceback" not in err, err
    assert f"but the adapters of {out / 'checkpoints' / 'step_00000002'} were trained over identity {base}" in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    # the base moved: model.init_from names it again, and the resume goes on
    moved = tmp_path / "moved-base"
    shutil.copytree(runs / "base", moved)
    assert launch.in_process(*args, f"model.init_from={moved}")[0] == 0
    launch.assert_identical(out, runs / "lora")


@pytest.mark.e2e
def test_a_peft_folder_continues_through_train_lora_init_from_and_chat_uses_the_adapter(runs, tiny, tmp_path):
    import weights

    weights.export(runs / "lora", "peft", tmp_path / "peft")
    out = tmp_path / "again"
    code, err = launch.in_process(*tiny, *EXACT, *LORA, "train.steps=1", "train.lr=0", f"model.init_from={runs / 'base'}",
                                  f"train.lora.init_from={tmp_path / 'peft'}", f"out_dir={out}")
    assert code == 0 and "adapters from" in err, err
    # lr 0: the adapters are the source's, and the model the LoRA run's
    a, b = weights.load_model(out, fp32=True), weights.load_model(runs / "lora", fp32=True)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # the inference path (chat, generate): the base with the fp16 adapters on it
    from cli.generate import generate_text

    fp16 = weights.load_model(runs / "lora")
    assert type(fp16.layers[0].attention.wq).__name__ == "LoRALinear"
    ids = torch.randint(0, a.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (fp16(ids)[0] - b(ids)[0]).abs().max().item() < 1e-2
    assert generate_text(fp16, "The", 8, 0.0, 0, weights.load_tokenizer(runs / "lora"))


@pytest.mark.e2e
@needs_upstream
def test_minimind_s_own_lora_pth_comes_in_through_train_lora_init_from_with_minimind_s_logits(tmp_path):
    """MiniMind's model with MiniMind's apply_lora (its square linears) and its save_lora (fp16), B
    drawn non-zero: our model over the same base with that .pth gives MiniMind's logits."""
    import weights
    from configs import load_config
    from model import MiniMindLM
    from model.lora import attach

    up = upstream()
    spec = importlib.util.spec_from_file_location("minimind_upstream_lora", UPSTREAM.parent / "model_lora.py")
    lora_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lora_mod)
    cfg = load_config(None, ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.qk_norm=true",
                             "model.hidden_dim=256", "model.norm_eps=1e-6", "model.seq_len=32", "train.lora.rank=4"])
    cfg.model.vocab_size = 300
    torch.manual_seed(0)
    theirs = up.MiniMindForCausalLM(minimind_config(up, cfg.model)).eval()
    torch.save({k: v.half() for k, v in theirs.state_dict().items()}, tmp_path / "full_sft_64.pth")
    lora_mod.apply_lora(theirs, rank=4)
    for m in theirs.modules():
        if hasattr(m, "lora"):
            torch.nn.init.normal_(m.lora.B.weight, std=0.02)
    lora_mod.save_lora(theirs, tmp_path / "lora_64.pth")
    theirs.load_state_dict({k: v.half().float() for k, v in theirs.state_dict().items()})  # the fp16 values both read
    ours = MiniMindLM(cfg.model)
    attach(ours, cfg.train.lora, cfg.seed)
    cfg.train.lora.init_from = str(tmp_path / "lora_64.pth")
    state, record, source, _ = weights.lora_start(cfg.model, cfg.seed, cfg.train.lora, str(tmp_path / "full_sft_64.pth"), None,
                                                  None, ours.state_dict())
    assert source["format"] == "minimind" and record["format"] == "minimind"
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(ids).logits, ours.eval()(ids)[0]
    assert torch.equal(want, got), (want - got).abs().max().item()  # measured 0.0
    # a MiniMind .pth with a key missing is refused, naming it
    pth = torch.load(tmp_path / "lora_64.pth")
    pth.pop("model.layers.1.self_attn.o_proj.lora.B.weight")
    torch.save(pth, tmp_path / "short.pth")
    from model.formats import WeightsError

    with pytest.raises(WeightsError, match=r"missing keys: model\.layers\.1\.self_attn\.o_proj\.lora\.B\.weight"):
        weights.read_adapters(tmp_path / "short.pth", ours.state_dict(), cfg.train.lora, cfg.model)


@pytest.mark.e2e
@pytest.mark.parametrize("bad, expected", [
    (["train.lora.rank=4", "train.lora.targets=q_proj,qkv"], "train.lora.targets: 'qkv' matches no linear (known: q_proj"),
    (["train.lora.rank=-1"], "train.lora.rank must be >= 0"),
    (["train.lora.rank=20", "train.lora.targets=q_proj,k_proj"], "train.lora.rank=20 is larger than k_proj (32 -> 16) allows (at most 16)"),
    (["train.lora.rank=4", "model.dim=48", "model.head_dim=8"], "train.lora.targets=minimind: this model has no square linear"),
])
def test_bad_lora_keys_exit_2_naming_the_key(tmp_path, tiny, bad, expected):
    code, err = launch.in_process(*tiny, *bad, f"out_dir={tmp_path / 'r'}")
    assert code == 2 and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.e2e
def test_a_peft_folder_for_other_targets_rank_or_shape_is_refused_naming_each_difference(runs, tiny, tmp_path):
    import weights

    weights.export(runs / "lora", "peft", tmp_path / "peft")
    base = [*tiny, *EXACT, *LORA, f"model.init_from={runs / 'base'}", f"train.lora.init_from={tmp_path / 'peft'}"]
    code, err = launch.in_process(*base, "train.lora.targets=q_proj,v_proj", "train.lora.rank=2", f"out_dir={tmp_path / 'a'}")
    assert code == 2 and "r 4 there, train.lora.rank=2 here" in err and \
        "target_modules ['down_proj', 'gate_proj', 'o_proj', 'q_proj', 'v_proj'] there, train.lora.targets=q_proj,v_proj" in err, err
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    code, err = launch.in_process(*base, f"out_dir={tmp_path / 'b'}")
    assert code == 2 and "lora_alpha 16 there, train.lora.alpha=8 here" in err, err
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    # another base shape: the same targets and rank over a wider model
    code, err = launch.in_process(*base, "model.hidden_dim=96", "model.init_from=", f"out_dir={tmp_path / 'c'}")
    assert code == 2 and "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight is (128, 4), the model's is (96, 4)" in err, err
    for name in "abc":
        assert not (tmp_path / name / "checkpoints").exists()
