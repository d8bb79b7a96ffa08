"""Weights in and out: export to Hugging Face (read by transformers 5.x and 4.57) and to MiniMind,
`model.init_from` from each, its errors, its resume; and generation with a KV cache."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch
from checkpoint import storage
from model import KVCache, MiniMindLM, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS_4 = ROOT / ".venv" / "transformers-4.57"  # scripts/test.sh installs transformers 4.57 here (--target)
CI = os.environ.get("CI") == "true"


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkpoint", "export", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny, trained) -> Path:
    """A few steps of the tiny model with a BPE tokenizer: the checkpoint every export starts from."""
    out = tmp_path_factory.mktemp("weights") / "run"
    code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", "train.steps=6", f"out_dir={out}")
    assert code == 0, err
    return out


def fp32_model(run: Path) -> MiniMindLM:
    from weights import checkpoint_weights

    _, _, cfg, state = checkpoint_weights(run)
    model = MiniMindLM(cfg)
    model.load_state_dict(state)
    return model.eval()


HF_LOGITS = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, tokens = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
kw = {"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.float32}
model = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
with torch.no_grad():
    logits = model(tokens).logits
ids = AutoTokenizer.from_pretrained(folder)("The model saves a checkpoint.", add_special_tokens=False)["input_ids"]
print(json.dumps({"version": transformers.__version__, "class": type(model).__name__, "logits": logits.tolist(), "ids": ids}))
"""


@contextlib.contextmanager
def unittest_argv(args: list[str]):
    """sys.argv as a child's would be, for a script run in this process."""
    saved = sys.argv
    sys.argv = ["-c", *args]
    try:
        yield
    finally:
        sys.argv = saved


@pytest.mark.e2e
@pytest.mark.parametrize("line", ["5.x", "4.57"])
def test_an_hf_export_read_by_transformers_gives_our_fp32_logits_bit_for_bit(tmp_path, run, trained, line):
    env = dict(os.environ)
    if line == "4.57":
        if not TRANSFORMERS_4.is_dir():
            if CI:
                pytest.fail(f"transformers 4.57 is not installed at {TRANSFORMERS_4} (scripts/test.sh installs it)")
            pytest.skip(f"transformers 4.57 is not installed at {TRANSFORMERS_4}: run `bash scripts/test.sh` once")
        env["PYTHONPATH"] = str(TRANSFORMERS_4)
    folder = tmp_path / "hf"
    if line == "4.57":  # the command users run (5.x: its code, in this process)
        proc = export(run, "--format", "hf", "--out", folder)
        assert proc.returncode == 0, proc.stderr
    else:
        import weights

        weights.export(run, "hf", folder)
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "generation_config.json",
                                                  "tokenizer.json", "tokenizer_config.json"}
    model = fp32_model(run)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    if line == "4.57":  # another transformers than this process's: in a child of its own
        got = subprocess.run([sys.executable, "-c", HF_LOGITS, str(folder), json.dumps(tokens.tolist())], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=env)
        assert got.returncode == 0, got.stderr[-3000:]
        hf = json.loads(got.stdout.strip().splitlines()[-1])
    else:
        import contextlib
        import io

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), unittest_argv([str(folder), json.dumps(tokens.tolist())]):
            exec(compile(HF_LOGITS, "HF_LOGITS", "exec"), {"__name__": "hf_logits"})
        hf = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert hf["version"].startswith("5." if line == "5.x" else "4.57") and hf["class"] == "LlamaForCausalLM"
    with torch.no_grad():
        ours = model(tokens)[0]
    diff = (torch.tensor(hf["logits"]) - ours).abs().max().item()
    print(f"transformers {hf['version']}: max |logit difference| {diff:.3e}")
    # Bit-identical (the same products in the same order): measured 0.0 with 5.24 and 4.57.
    assert torch.equal(torch.tensor(hf["logits"]), ours), f"transformers {hf['version']}: max |logit difference| {diff}"
    from data import tokenizer as tokenizers

    assert hf["ids"] == tokenizers.load(str(trained)).encode("The model saves a checkpoint.")
    if line == "4.57":  # a second export to the same place is refused, the first left as it was
        again = export(run, "--format", "hf", "--out", folder)
        assert again.returncode == 2 and "exists" in again.stderr


@pytest.mark.e2e
def test_a_minimind_export_has_minimind2s_keys_in_fp16_and_loads_back_through_init_from(tmp_path, run, tiny, trained):
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.formats import hf_config

    path = tmp_path / "minimind.pth"
    proc = export(run, "--format", "minimind", "--out", path)
    assert proc.returncode == 0, proc.stderr
    state = storage.safe_load(path)
    cfg = fp32_model(run).cfg
    # MiniMind2's MiniMindForCausalLM names its tensors as Llama does; a strict load into one checks every key and shape.
    llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf_config(cfg, 1, 2, 0).items() if k != "rope_parameters"}))
    assert set(state) == set(llama.state_dict()) and "lm_head.weight" in state and "model.layers.1.mlp.gate_proj.weight" in state
    assert all(t.dtype == torch.float16 for t in state.values())
    llama.load_state_dict(state, strict=True)
    out = tmp_path / "second"
    code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", f"model.init_from={path}", "train.steps=1",
                                  "train.lr=0", f"out_dir={out}")
    assert code == 0, err
    assert "model.init_from: minimind weights from" in err
    from weights import load_model

    first, second = load_model(run), fp32_model(out)  # lr 0: the second run's weights are the export's
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(first(tokens)[0], second(tokens)[0])
    record = launch.inspect(out)
    manifest = launch.storage_manifest(out, 1)
    assert manifest["init_from"]["path"] == str(path) and manifest["init_from"]["format"] == "minimind"
    assert (out / "config.yaml").read_text().startswith(f"# model.init_from: {path} (sha256 ")
    assert record["step"] == 1


@pytest.mark.e2e
def test_init_from_with_a_missing_an_extra_key_or_a_wrong_shape_is_an_error_naming_each(tmp_path, run, tiny, trained):
    proc = export(run, "--format", "minimind", "--out", tmp_path / "ok.pth")
    assert proc.returncode == 0, proc.stderr
    state = storage.safe_load(tmp_path / "ok.pth")
    bad = dict(state)
    del bad["model.layers.0.self_attn.k_proj.weight"]
    bad["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    bad["model.norm.weight"] = torch.ones(7)
    torch.save(bad, tmp_path / "bad.pth")
    out = tmp_path / "r"
    code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", f"model.init_from={tmp_path / 'bad.pth'}", f"out_dir={out}")
    assert code == 2
    assert "missing keys: model.layers.0.self_attn.k_proj.weight" in err
    assert "unexpected keys: model.layers.0.self_attn.q_norm.weight" in err
    assert "model.norm.weight is (7,), the model's is (32,)" in err
    assert "Traceback" not in err and not list(out.glob("checkpoints/step_*"))
    code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", f"model.init_from={tmp_path / 'nope.pth'}", f"out_dir={out}")
    assert code == 2 and "nope.pth does not exist" in err


@pytest.mark.e2e
def test_a_run_started_with_init_from_halted_and_resumed_ends_bit_identical_without_reading_the_source_again(tmp_path, run, epochs, trained):
    source = tmp_path / "source.pth"
    assert export(run, "--format", "minimind", "--out", source).returncode == 0
    common = [*epochs, f"data.tokenizer={trained}", f"model.init_from={source}", "checkpoint.interval=4"]
    twin = tmp_path / "twin"  # each run train.main() in this process: the property is the files, not the processes
    assert launch.in_process(*common, f"out_dir={twin}")[0] == 0
    out = tmp_path / "run"
    assert launch.in_process(*common, "train.halt_at=9", f"out_dir={out}")[0] == 0
    source.rename(tmp_path / "gone.pth")  # the resume must not need it
    code, err = launch.in_process(*common, f"out_dir={out}")
    assert code == 0 and "the source is not read again" in err
    launch.assert_same_as_reference_at(out, twin, 20)
    assert launch.storage_manifest(out, 20)["init_from"] == launch.storage_manifest(twin, 20)["init_from"]
    fresh = tmp_path / "fresh"  # and the source mattered: from the seeded init the first loss is another
    assert launch.in_process(*epochs, f"data.tokenizer={trained}", "train.steps=1", f"out_dir={fresh}")[0] == 0
    assert launch.losses(fresh)[0] != launch.losses(twin)[0]


@pytest.mark.unit
def test_cached_and_uncached_greedy_generation_give_the_same_tokens_and_positions_past_rope_are_an_error(run):
    from model.generate import generate_ids
    from weights import load_model

    model = load_model(run)
    prompt = [1, 40, 41, 42]
    cached = generate_ids(model, prompt, None, temperature=0.0, use_cache=True)
    uncached = generate_ids(model, prompt, None, temperature=0.0, use_cache=False)
    assert len(cached) == model.cfg.seq_len and cached == uncached  # eos=None: up to every position the tables cover
    sampled = []
    for global_seed, seed in ((1, 0), (2, 0), (1, 1)):  # the global generator moved between calls: it must not matter
        torch.manual_seed(global_seed)
        sampled.append(generate_ids(model, prompt, 20, 0.9, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=seed))
    assert sampled[0] == sampled[1] != sampled[2]
    with pytest.raises(ValueError, match=r"need 33 positions, but the rotary tables cover model.seq_len=32: ask for at most 28"):
        generate_ids(model, prompt, 29)


@pytest.mark.unit
def test_the_kv_cache_appending_several_positions_at_once_matches_the_full_forward():
    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)).eval()
    tokens = torch.randint(0, 259, (2, 16))
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache(model, batch=2)
        parts = [model(tokens[:, a:b], cache=cache)[0] for a, b in ((0, 5), (5, 6), (6, 13), (13, 16))]
    # Another summation order in attention (a cache of k positions, not the whole row): measured 1.2e-7 here.
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1.2e-6
    with pytest.raises(ValueError, match="past the 16 positions"):
        model(tokens[:, :1], cache=cache)


@pytest.mark.e2e
def test_init_from_reads_our_run_and_checkpoint_folders_fp16_files_and_hf_folders(tmp_path, run):
    import weights
    from weights import load_model

    assert export(run, "--format", "hf", "--out", tmp_path / "hf").returncode == 0
    fp32, fp16 = fp32_model(run), load_model(run)
    ckpt = storage.find_checkpoint(run)[0]
    cases = [(run, fp32, "checkpoint"), (ckpt, fp32, "checkpoint"), (ckpt / storage.WEIGHTS_FILE, fp16, "weights"),
             (tmp_path / "hf", fp32, "hf")]
    for source, expected, fmt in cases:
        model = MiniMindLM(fp32.cfg)
        record = weights.init_from(model, source)
        assert record["format"] == fmt and len(record["sha256"]) == 64
        arch = fp32.cfg.architecture()
        assert storage.model_sha256(model.state_dict(), arch) == storage.model_sha256(expected.state_dict(), arch), source
    other = MiniMindLM(ModelConfig(**{**fp32.cfg.__dict__, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="rope_theta 1000000.0 there, model.rope_theta=10000.0 here"):
        weights.init_from(other, tmp_path / "hf")


@pytest.mark.e2e
def test_an_hf_folder_of_another_architecture_is_refused_naming_each_difference_with_nothing_written(tmp_path, run, tiny, trained):
    """8 heads of 4 (with 4 KV heads) fit the tensors of 4 heads of 8 exactly: only config.json tells
    them apart, and a model that loaded them would compute something else."""
    import weights

    folder = weights.export(run, "hf", tmp_path / "hf")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4,
                                                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    out = tmp_path / "r"
    code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", f"model.init_from={folder}", f"out_dir={out}")
    assert code == 2 and "Traceback" not in err
    for diff in ("num_attention_heads 8 there, model.n_heads=4 here", "num_key_value_heads 4 there, model.n_kv_heads=2 here",
                 "head_dim 4 there, model.dim / model.n_heads=8 here", "rms_norm_eps 1e-06 there, model.norm_eps=1e-05 here",
                 "tie_word_embeddings False there"):
        assert diff in err, diff
    assert not out.exists()  # refused before a step: the folder this launch made is taken back, lock and status too


@pytest.mark.e2e
def test_init_from_tensors_that_are_not_float_or_not_finite_and_a_pickled_pth_are_bad_input(tmp_path, run, tiny, trained):
    import weights

    state = storage.safe_load(weights.export(run, "minimind", tmp_path / "ok.pth"))
    cases = {"nan.pth": ("model.norm.weight", torch.full_like(state["model.norm.weight"], float("nan")), "model.norm.weight (holds NaN or inf)"),
             "int.pth": ("model.layers.0.input_layernorm.weight", torch.ones(32, dtype=torch.int64),
                         "model.layers.0.input_layernorm.weight (torch.int64)")}
    for name, (key, value, expected) in cases.items():
        torch.save({**state, key: value}, tmp_path / name)
        code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", f"model.init_from={tmp_path / name}", f"out_dir={tmp_path / name}.run")
        assert code == 2 and expected in err and "Traceback" not in err, err[-2000:]
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model.norm.weight": Payload()}, tmp_path / "evil.pth")
    code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", f"model.init_from={tmp_path / 'evil.pth'}", f"out_dir={tmp_path / 'evil'}")
    assert code == 2 and "not a plain checkpoint" in err and not marker.exists()


@pytest.mark.e2e
def test_the_recorded_source_of_an_hf_folder_covers_its_config_json(tmp_path, run):
    import weights

    a = weights.export(run, "hf", tmp_path / "a")
    b = weights.export(run, "hf", tmp_path / "b")
    hf = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**hf, "initializer_range": 0.01}))  # not architectural: accepted, but another source
    model = fp32_model(run)
    ra, rb = weights.init_from(MiniMindLM(model.cfg), a), weights.init_from(MiniMindLM(model.cfg), b)
    assert ra["files"]["model.safetensors"] == rb["files"]["model.safetensors"] and ra["sha256"] != rb["sha256"]
