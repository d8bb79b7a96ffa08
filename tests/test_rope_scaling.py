"""model.rope_scaling: YaRN as MiniMind-3 computes it (inference_rope_scaling) and as transformers'
Qwen3 reads it, in and out of Hugging Face folders and MiniMind .pth files (docs/models.md)."""
from __future__ import annotations

import json

import pytest
import torch

import launch
from model import MiniMindLM
from test_models import QWEN, config, minimind_config, needs_upstream, upstream


def yarn(scaling: dict) -> str:
    return "model.rope_scaling={" + ", ".join(f"{k}: {v}" for k, v in scaling.items()) + "}"


@pytest.mark.unit
@pytest.mark.parametrize("bad, expected", [
    ("model.rope_scaling={type: linear, factor: 2}", "model.rope_scaling.type: expected none or yarn"),
    ("model.rope_scaling={type: yarn, factor: 0.5}", "model.rope_scaling.factor: expected a number >= 1"),
    ("model.rope_scaling={type: yarn, factor: 2, size: 3}", "unknown key 'model.rope_scaling.size'"),
    ("model.rope_scaling={type: yarn}", "model.rope_scaling.factor: type yarn needs a factor > 1"),
])
def test_a_rope_scaling_we_do_not_implement_or_a_factor_below_one_exits_2_naming_the_key(tmp_path, bad, expected):
    code, err = launch.in_process(bad, f"out_dir={tmp_path}")
    assert code == 2 and expected in err and "Traceback" not in err, err


@pytest.mark.e2e
def test_a_resume_under_another_yarn_factor_is_refused_naming_both_values(tmp_path):
    run = ["train.steps=1", "checkpoint.interval=1", "model.dim=32", "model.n_layers=1", f"out_dir={tmp_path}"]
    assert launch.in_process(*run, yarn({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}))[0] == 0
    code, err = launch.in_process(*run, "train.steps=2", yarn({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    assert code == 2 and "model.rope_scaling: factor changed (2.0 in the checkpoint, 4.0 in this run)" in err, err


@pytest.mark.unit
def test_plain_rope_keeps_the_identity_it_had_and_yarn_changes_it():
    plain = config(QWEN)
    assert "rope_scaling" not in plain.architecture()  # every model identity recorded before the key stays what it was
    scaled = config([*QWEN, "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 16}"])
    assert scaled.architecture()["rope_scaling"]["factor"] == 4.0


@pytest.mark.e2e
@needs_upstream
def test_minimind_s_own_model_with_inference_rope_scaling_gives_our_logits_from_its_pth(tmp_path):
    """MiniMind-3's model built with inference_rope_scaling=True (its YaRN dict: factor 16 over 2048
    positions, betas 32 and 1, attention factor 1, at its 32768 positions), saved as its .pth, read by
    model.init_from into our model with the same model.rope_scaling: the same logits."""
    import weights

    up = upstream()
    theirs_scaling = dict(up.MiniMindConfig(inference_rope_scaling=True).rope_scaling)
    keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor")  # transformers adds rope_type
    cfg = config([*QWEN, yarn({"type": "yarn", **{k: theirs_scaling[k] for k in keys}})], vocab=300)
    mc = minimind_config(up, cfg)
    mc.rope_scaling, mc.max_position_embeddings = theirs_scaling, 32768
    torch.manual_seed(0)
    theirs = up.MiniMindForCausalLM(mc).eval()
    torch.save(theirs.state_dict(), tmp_path / "full_sft_64.pth")
    ours = MiniMindLM(cfg)
    weights.init_from(ours, tmp_path / "full_sft_64.pth")
    plain = MiniMindLM(config(QWEN, vocab=300))
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got, unscaled = theirs(ids).logits, ours.eval()(ids)[0], plain.eval()(ids)[0]
    gap = (want - got).abs().max().item()
    print(f"YaRN against MiniMind's model: max |logit difference| {gap:.3e}; unscaled RoPE {(want - unscaled).abs().max().item():.3e}")
    assert torch.equal(want, got), gap  # MiniMind's formulas in its order: measured 0.0
    assert not torch.allclose(want, unscaled, atol=1e-4)  # the scaling acts at these positions


@pytest.mark.e2e
def test_a_yarn_run_exported_to_hugging_face_gives_transformers_qwen3_logits_and_reads_back(tmp_path, tiny):
    """A Qwen3-shaped run with YaRN (factor 4 over 256 positions: a ramp over 4 of 12 frequencies; the YaRN paper's attention factor),
    exported as a Hugging Face folder: transformers' Qwen3ForCausalLM with its rope_scaling gives our
    logits; model.init_from reads the folder back with the same model.rope_scaling, and refuses it,
    naming the rope scaling, without it."""
    from transformers import AutoModelForCausalLM

    from weights import checkpoint_weights, export

    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0,
               "attention_factor": 1.1386294361119891}
    args = [o for o in tiny if not o.startswith("model.")]
    code, err = launch.in_process(*args, *QWEN, yarn(scaling), "train.steps=2", f"out_dir={tmp_path / 'run'}")
    assert code == 0, err
    export(tmp_path / "run", "hf", tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "yarn" and written["rope_scaling"]["factor"] == 4.0
    _, _, cfg, state = checkpoint_weights(tmp_path / "run")
    ours = MiniMindLM(cfg)
    ours.load_state_dict(state)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = theirs(ids).logits, ours.eval()(ids)[0]
    gap = (want - got).abs().max().item()
    print(f"YaRN against transformers' Qwen3: max |logit difference| {gap:.3e}")
    assert torch.equal(want, got), gap  # transformers blends 1 / (factor * base^x) otherwise, yet measured 0.0 on 5.24
    code, err = launch.in_process(*args, *QWEN, yarn(scaling), "train.steps=1", f"model.init_from={tmp_path / 'hf'}",
                                  f"out_dir={tmp_path / 'again'}")
    assert code == 0, err
    code, err = launch.in_process(*args, *QWEN, "train.steps=1", f"model.init_from={tmp_path / 'hf'}", f"out_dir={tmp_path / 'plain'}")
    assert code == 2 and "rope scaling" in err and "model.rope_scaling=none" in err, err


@pytest.mark.e2e
def test_the_long_context_recipe_continues_a_shorter_run_at_twice_its_length_with_yarn(tmp_path, tiny, cache_dir):
    """configs/long_tiny.yaml at the test's size: a run at 32 tokens, then the recipe at 64 with
    model.init_from naming it and YaRN over the original 32 positions. The corpus is packed again at
    the new length (a second packed file beside the first), the weights are the first run's (its
    first loss is below that of the same stage from the seeded init)."""
    short = tmp_path / "short"
    code, err = launch.in_process(*tiny, "train.steps=4", f"out_dir={short}")
    assert code == 0, err
    model = [o for o in tiny if o.startswith("model.") and not o.startswith("model.seq_len")]
    rest = [o for o in tiny if not o.startswith("model.")]
    stage = ["--config", "configs/long_tiny.yaml", *rest, *model, "model.seq_len=64", "model.rope_scaling.original_max_position_embeddings=32",
             "train.global_batch=8", "train.micro_batch=4", "train.steps=2"]
    launch.run(0, *stage, f"model.init_from={short}", f"out_dir={tmp_path / 'long'}")
    launch.run(0, *stage, "model.init_from=", f"out_dir={tmp_path / 'fresh'}")
    config = (tmp_path / "long" / "config.yaml").read_text()
    assert config.startswith(f"# model.init_from: {short}") and "type: yarn" in config and "seq_len: 64" in config
    assert launch.losses(tmp_path / "long")[0] < launch.losses(tmp_path / "fresh")[0]
    packed = {json.loads(p.read_text())["seq_len"] for p in cache_dir.glob("*.json") if "seq_len" in json.loads(p.read_text())}
    assert {32, 64} <= packed
