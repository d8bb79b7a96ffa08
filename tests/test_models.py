"""MiniMind's current models (docs/models.md): the Qwen3-shaped dense model (q/k norms, its own
head_dim) and its MoE, compared with MiniMind's own code (../shared/minimind/upstream) and with
transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM on our export; weights in from MiniMind's
.pth and from Hugging Face folders of both expert layouts; the MoE exact on any world size."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch
from conftest import MINIMIND_SHARED, needs_referee
from model import MiniMindLM, ModelConfig
from model.config import MoEConfig

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = MINIMIND_SHARED / "upstream" / "model" / "model_minimind.py"
TRANSFORMERS_4 = ROOT / ".venv" / "transformers-4.57"
CI = os.environ.get("CI") == "true"
needs_upstream = needs_referee(UPSTREAM, "MiniMind's model code")

# MiniMind-3's shape, small: q/k norms, head_dim 16 != dim / heads, 4 KV heads, eps 1e-6, FFN ceil(dim * pi / 64) * 64
QWEN = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=24", "model.qk_norm=true",
        "model.hidden_dim=256", "model.norm_eps=1e-6", "model.seq_len=32"]
MOE = [*QWEN, "model.moe.experts=4", "model.moe.top_k=2", "model.moe.hidden_dim=96"]


def config(overrides: list[str], vocab: int = 259) -> ModelConfig:
    from configs import load_config

    cfg = load_config(None, overrides).model
    cfg.vocab_size = vocab
    return cfg


def upstream():
    """MiniMind's model module, imported from the shared copy (never copied into this repository)."""
    spec = importlib.util.spec_from_file_location("minimind_upstream_model", UPSTREAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def minimind_config(up, cfg: ModelConfig):
    moe = cfg.moe.experts > 0
    return up.MiniMindConfig(hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, use_moe=moe, vocab_size=cfg.vocab_size,
                             num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_size,
                             intermediate_size=cfg.ffn_dim, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                             max_position_embeddings=cfg.seq_len, num_experts=max(cfg.moe.experts, 1),
                             num_experts_per_tok=cfg.moe.top_k, moe_intermediate_size=cfg.expert_dim,
                             norm_topk_prob=cfg.moe.norm_topk_prob, router_aux_loss_coef=cfg.moe.aux_loss_coef, flash_attn=True)


@pytest.mark.e2e
@needs_upstream
@pytest.mark.parametrize("shape", ["dense", "moe top-1", "moe top-2"])
def test_a_minimind_3_pth_loads_through_init_from_and_gives_minimind_s_own_logits(tmp_path, shape):
    """MiniMind's own MiniMindForCausalLM (random init, its seed), saved as MiniMind saves
    (`torch.save(model.state_dict())`), read by model.init_from: the same logits on the same ids, and
    in training the same MoE output and load-balancing loss."""
    import weights

    up = upstream()
    overrides = QWEN if shape == "dense" else [*MOE, f"model.moe.top_k={1 if 'top-1' in shape else 2}"]
    cfg = config(overrides, vocab=300)
    torch.manual_seed(0)
    theirs = up.MiniMindForCausalLM(minimind_config(up, cfg)).eval()
    # MiniMind's released files are fp16 state dicts (full_sft_768.pth): both models read the same values
    half = {k: v.half() for k, v in theirs.state_dict().items()}
    torch.save(half, tmp_path / "full_sft_64.pth")
    theirs.load_state_dict({k: v.float() for k, v in half.items()})
    ours = MiniMindLM(cfg)
    record = weights.init_from(ours, tmp_path / "full_sft_64.pth")
    assert record["format"] == "minimind" and record["keys"] == "llama"
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(ids).logits, ours.eval()(ids)[0]
    gap = (want - got).abs().max().item()
    print(f"{shape}: max |logit difference| against MiniMind's model {gap:.3e}")
    assert torch.equal(want, got), gap  # the same products in the same order: measured 0.0 for all three
    if shape != "dense":  # in training: the same MoE output and MiniMind's auxiliary loss, layer by layer
        x = torch.randn(2, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(2))
        theirs_moe, ours_moe = theirs.model.layers[0].mlp.train(), ours.layers[0].feed_forward.train()
        assert torch.equal(theirs_moe(x), ours_moe(x)) and torch.equal(theirs_moe.aux_loss, ours_moe.aux_loss)
        assert ours_moe.aux_loss.item() > 0


@pytest.mark.e2e
@needs_upstream
def test_the_objectives_loss_holds_the_load_balancing_loss_of_each_micro_batch():
    from objectives import NextToken

    cfg = config(MOE)
    torch.manual_seed(0)
    model = MiniMindLM(cfg).train()
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(3))
    objective = NextToken(None, 4, chat=False, model=model)
    objective.begin_step([])
    loss = objective.loss(model, (x[:, :-1], x[:, 1:]), torch.device("cpu"), i=0)
    ce = torch.nn.functional.cross_entropy(model(x[:, :-1])[0].flatten(0, 1), x[:, 1:].flatten())
    aux = sum(layer.feed_forward.aux_loss for layer in model.layers)
    assert aux.item() > 0 and torch.allclose(loss, ce + aux, rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def qwen_runs(tmp_path_factory, tiny):
    """A few steps of the Qwen3-shaped dense model and of its MoE, exported as Hugging Face folders."""
    from weights import export

    out = tmp_path_factory.mktemp("qwen")
    runs = {}
    for name, shape in (("dense", QWEN), ("moe", MOE)):
        args = [o for o in tiny if not o.startswith("model.")]
        code, err = launch.in_process(*args, *shape, "train.steps=3", f"out_dir={out / name}")
        assert code == 0, err
        export(out / name, "hf", out / f"{name}-hf")
        runs[name] = out / name
    return out, runs


HF_LOGITS = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM
kw = {"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.float32}
out = {"version": transformers.__version__}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
    with torch.no_grad():
        out[folder] = {"class": type(model).__name__, "logits": model(torch.tensor(json.loads(sys.argv[1]))).logits.tolist()}
print(json.dumps(out))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("line", ["5.x", "4.57"])
def test_qwen3_and_qwen3_moe_exports_read_by_transformers_give_our_fp32_logits(qwen_runs, line):
    from weights import checkpoint_weights

    env = dict(os.environ)
    if line == "4.57":
        if not TRANSFORMERS_4.is_dir():
            if CI:
                pytest.fail(f"transformers 4.57 is not installed at {TRANSFORMERS_4} (scripts/test.sh installs it)")
            pytest.skip(f"transformers 4.57 is not installed at {TRANSFORMERS_4}: run `bash scripts/test.sh` once")
        env["PYTHONPATH"] = str(TRANSFORMERS_4)
    out, runs = qwen_runs
    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    folders = [str(out / f"{name}-hf") for name in runs]
    proc = subprocess.run([sys.executable, "-c", HF_LOGITS, json.dumps(tokens.tolist()), *folders], capture_output=True, text=True,
                          timeout=300, env=env, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = json.loads(proc.stdout.strip().splitlines()[-1])
    assert hf["version"].startswith("5." if line == "5.x" else "4.57")
    for name, folder in zip(runs, folders):
        _, _, cfg, state = checkpoint_weights(runs[name])
        model = MiniMindLM(cfg)
        model.load_state_dict(state)
        with torch.no_grad():
            ours = model.eval()(tokens)[0]
        theirs = torch.tensor(hf[folder]["logits"])
        gap = (theirs - ours).abs().max().item()
        print(f"transformers {hf['version']} {hf[folder]['class']}: max |logit difference| {gap:.3e}")
        assert hf[folder]["class"] == ("Qwen3MoeForCausalLM" if name == "moe" else "Qwen3ForCausalLM")
        # The same products in the same order, 5.x's fused gate and up included: measured 0.0 on 5.24 and 4.57.
        assert torch.equal(theirs, ours), (name, gap)


@pytest.mark.e2e
def test_init_from_a_minimind_3_moe_pth_then_export_gives_back_the_same_tensors(tmp_path, qwen_runs, tiny):
    """MiniMind-3's .pth in (its key names, fp16 as MiniMind's releases are), a run from it that
    changes nothing (LR 0), and --format minimind out: the same tensors under the same names."""
    import weights
    from checkpoint import half_weights
    from model.formats import to_llama

    _, runs = qwen_runs
    _, _, cfg, state = weights.checkpoint_weights(runs["moe"])
    minimind = to_llama(half_weights(state), lm_head=True)
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in minimind and "model.layers.0.self_attn.q_norm.weight" in minimind
    torch.save(minimind, tmp_path / "moe_64.pth")
    args = [o for o in tiny if not o.startswith("model.")]
    code, err = launch.in_process(*args, *MOE, "train.steps=1", "train.lr=0", "train.weight_decay=0",
                                  f"model.init_from={tmp_path / 'moe_64.pth'}", f"out_dir={tmp_path / 'run'}")
    assert code == 0, err
    again = torch.load(weights.export(tmp_path / "run", "minimind", tmp_path / "back.pth"), weights_only=True)
    assert again.keys() == minimind.keys() and all(torch.equal(again[k], minimind[k]) for k in minimind)


@pytest.mark.e2e
def test_an_moe_halted_on_two_processes_under_ddp_resumed_on_three_under_fsdp_is_the_one_process_run(tmp_path, tiny):
    """Canonical: the routing, the load-balancing loss of each micro-batch and every expert's
    gradient (a zero one for an expert no token chose) bit-identical on 1, 2 and 3 processes, across
    a resume that changes the world size and the strategy; every loss, aux loss and load logged equal."""
    args = [*(o for o in tiny if not o.startswith(("model.", "train.global_batch", "train.micro_batch"))), *MOE,
            "dist.reduce=canonical", "train.global_batch=12", "train.micro_batch=2", "train.steps=6", "checkpoint.keep=100"]
    one = tmp_path / "one"
    assert launch.in_process(*args, "checkpoint.interval=1", f"out_dir={one}")[0] == 0
    moved = tmp_path / "moved"
    launch.run(2, *args, "train.halt_at=3", f"out_dir={moved}")
    launch.run(3, *args, "dist.strategy=fsdp", f"out_dir={moved}")
    launch.assert_same_as_reference_at(moved, one, 6)
    assert launch.sha_at(moved, 3) == launch.sha_at(one, 3)
    got, want = launch.metrics(moved), launch.metrics(one)
    for key in ("moe/aux_loss", "moe/load"):
        assert [m[key] for m in got] == [m[key] for m in want], key
    assert all(m["moe/aux_loss"] > 0 and abs(sum(m["moe/load"]) - 1) < 1e-6 for m in got)


@pytest.mark.unit
@pytest.mark.parametrize("bad, expected", [
    (["model.moe.experts=2", "model.moe.top_k=3"], "model.moe.top_k must be between 1 and model.moe.experts=2, got 3"),
    (["model.moe.top_k=2"], "model.moe.top_k=2 needs model.moe.experts > 0"),  # a dense model: nothing to route to
    (["model.moe.hidden_dim=96", "model.moe.experts=0"], "model.moe.hidden_dim=96 needs model.moe.experts > 0"),
    (["model.head_dim=7"], "model.head_dim (7) must be even"),
    (["model.dim=30", "model.n_heads=4"], "model.dim (30) must be divisible by model.n_heads (4), or give model.head_dim"),
])
def test_a_model_config_that_cannot_be_built_names_the_key_and_both_values(bad, expected):
    from configs import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, bad)
    assert expected in str(e.value)


@pytest.mark.unit
def test_weights_of_the_other_family_are_refused_naming_the_keys(tmp_path):
    import weights
    from model.formats import WeightsError, to_llama

    torch.manual_seed(0)
    qwen, llama, moe = (MiniMindLM(config(QWEN)), MiniMindLM(config([o for o in QWEN if "qk_norm" not in o])), MiniMindLM(config(MOE)))
    for source, target, named, hint in ((qwen, llama, "model.layers.0.self_attn.q_norm.weight", "model.qk_norm"),
                                        (llama, qwen, "model.layers.0.self_attn.q_norm.weight", "model.qk_norm"),
                                        (moe, qwen, "model.layers.0.mlp.experts.0.gate_proj.weight", "model.moe.experts")):
        torch.save(to_llama(source.state_dict()), tmp_path / "w.pth")
        with pytest.raises(WeightsError) as e:
            weights.init_from(target, tmp_path / "w.pth")
        assert named in str(e.value) and hint in str(e.value), str(e.value)


@pytest.mark.unit
def test_a_hugging_face_moe_folder_in_either_expert_layout_is_read_and_another_count_is_refused(tmp_path):
    """transformers 4.x's per-expert tensors and 5.x's fused ones give the same model; a config.json
    with another expert count, or fused tensors that do not split as configured, are refused by name."""
    from safetensors.torch import save_file

    import weights
    from model.formats import WeightsError, hf_config, to_llama

    torch.manual_seed(0)
    cfg = config(MOE)
    source = MiniMindLM(cfg)
    per_expert = {k: v.contiguous() for k, v in to_llama(source.state_dict(), lm_head=False).items()}
    fused = {k: v for k, v in per_expert.items() if ".experts." not in k}
    for layer in range(cfg.n_layers):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([per_expert[f"{p}.{e}.gate_proj.weight"], per_expert[f"{p}.{e}.up_proj.weight"]])
                                                  for e in range(4)])
        fused[f"{p}.down_proj"] = torch.stack([per_expert[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    for name, tensors in (("per_expert", per_expert), ("fused", fused)):
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(hf_config(cfg, 256, 257, 258)))
        target = MiniMindLM(cfg)
        weights.init_from(target, folder)
        assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), source.state_dict().values())), name
    (tmp_path / "fused" / "config.json").write_text(json.dumps({**hf_config(cfg, 256, 257, 258), "num_experts": 8}))
    with pytest.raises(WeightsError, match=r"num_experts 8 there, model.moe.experts=4 here"):
        weights.init_from(MiniMindLM(cfg), tmp_path / "fused")
    odd = {**fused, "model.layers.0.mlp.experts.gate_up_proj": fused["model.layers.0.mlp.experts.gate_up_proj"][:, :-1].contiguous()}
    save_file(odd, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text(json.dumps(hf_config(cfg, 256, 257, 258)))
    with pytest.raises(WeightsError, match=r"model.layers.0.mlp.experts.gate_up_proj"):
        weights.init_from(MiniMindLM(cfg), tmp_path / "fused")


@pytest.mark.unit
def test_minimind2_configs_keep_their_numbers_and_generation_works_for_both_shapes():
    """The default (MiniMind2) model is built as before the new keys existed: the same init, the
    same state dict; and a KV-cached generation equals a recomputed one for the dense and the MoE."""
    from model.generate import generate_ids

    torch.manual_seed(0)
    plain = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32))
    assert not any("norm.weight" in k and "attention." in k for k in plain.state_dict())
    assert ModelConfig().moe == MoEConfig() and ModelConfig().head_size == 32
    for shape in (QWEN, MOE):
        model = MiniMindLM(config(shape)).eval()
        cached = generate_ids(model, [1, 2, 3], 10, temperature=0.0, use_cache=True)
        assert cached == generate_ids(model, [1, 2, 3], 10, temperature=0.0, use_cache=False)
