"""Exports other tools open (weights/exports.py, docs/weights.md, docs/lora.md): the Hugging Face
export of a run on the byte tokenizer carries a tokenizer AutoTokenizer loads, with our ids and our
chat template; a PEFT adapter names its base without an absolute path and, exported with its base,
loads through AutoPeftModelForCausalLM after the folder moves; `chat` and `generate` share one set
of sampling defaults (model/generate.py)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

import launch
from test_lora import EXACT, LORA

TEXTS = ("The model saves a checkpoint.", "  two  spaces,\ttab\nnewline", "你好，世界 🙂 café naïve", "",
         "<|im_start|> written by hand", "\x00\x7f\u00ff")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Wie heißt du? 你好"},
            {"role": "assistant", "content": "MiniMind."}, {"role": "user", "content": "What does os.path.join do?"}]


def cli(*args: str) -> tuple[int, str, str]:
    """`python -m checkpoint ARGS` in this process: (exit code, stdout, stderr)."""
    from cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(map(str, args)))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory, tiny) -> Path:
    """A few steps of the tiny model on the built-in byte tokenizer (the default)."""
    out = tmp_path_factory.mktemp("exports") / "bytes"
    code, err = launch.in_process(*tiny, "train.steps=3", f"out_dir={out}")
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny) -> Path:
    """A base run, then a LoRA run over it (tests/test_lora.py's settings), in this process."""
    root = tmp_path_factory.mktemp("exports_lora")
    for name, extra in (("base", []), ("lora", [*LORA, f"model.init_from={root / 'base'}"])):
        code, err = launch.in_process(*tiny, *EXACT, *extra, f"out_dir={root / name}")
        assert code == 0, err
    return root


@pytest.mark.e2e
def test_the_hf_export_of_a_byte_tokenizer_run_carries_a_tokenizer_autotokenizer_loads_with_our_ids_and_chat_template(
        byte_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.chat import template_of
    from data.tokenizer import ByteTokenizer
    from weights import checkpoint_weights

    code, _, err = cli("export", byte_run, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    theirs, ours = AutoTokenizer.from_pretrained(str(tmp_path / "hf")), ByteTokenizer()
    for text in TEXTS[:4] + TEXTS[5:]:  # plain text: its UTF-8 bytes, as ours
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text), text
        assert theirs.decode(ids) == text
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (ours.bos, ours.eos, ours.pad)
    # A conversation: transformers' template renders our text, and its ids are ours (special tokens recognized)
    rendered = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == template_of(ours).render(MESSAGES, add_generation_prompt=True)
    assert theirs(rendered, add_special_tokens=False)["input_ids"] == ours.encode_rendered(rendered)
    assert theirs(TEXTS[4], add_special_tokens=False)["input_ids"] == ours.encode_rendered(TEXTS[4])
    # The weights beside it still give our fp32 logits, bit for bit
    _, _, cfg, state = checkpoint_weights(byte_run)
    from model import MiniMindLM

    model = MiniMindLM(cfg)
    model.load_state_dict(state)
    tokens = torch.tensor([ours.encode_rendered(rendered)[: cfg.seq_len]])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, model.eval()(tokens)[0])


@pytest.mark.unit
def test_the_byte_tokenizers_hugging_face_files_are_the_same_bytes_every_time():
    from data import tokenizer as tokenizers

    files = tokenizers.byte_tokenizer_files(32)
    assert files == tokenizers.byte_tokenizer_files(32) and set(files) == {"tokenizer.json", "tokenizer_config.json"}
    again = tokenizers.from_files(files, "the export")  # our own reader takes it too: the same special ids
    assert (again.bos, again.eos, again.pad, again.vocab_size) == (256, 257, 258, 259)
    assert [again.encode(t) for t in TEXTS] == [tokenizers.ByteTokenizer().encode(t) for t in TEXTS[:4]] + [
        tokenizers.ByteTokenizer().encode_rendered(TEXTS[4]), tokenizers.ByteTokenizer().encode(TEXTS[5])]


@pytest.mark.unit
def test_export_peft_names_its_base_relative_to_the_adapter_folder_or_as_given_never_as_an_absolute_path(lora_runs, tmp_path):
    from checkpoint import storage

    code, _, err = cli("export", lora_runs / "lora", "--format", "peft", "--out", tmp_path / "out" / "peft")
    assert code == 0, err
    assert "--with-base" in err and "--base NAME" in err  # the default does not load in PEFT: the note says what does
    name = json.loads((tmp_path / "out" / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert not os.path.isabs(name)
    assert (tmp_path / "out" / "peft" / name).resolve() == storage.find_checkpoint(lora_runs / "base")[0].resolve()
    code, _, err = cli("export", lora_runs / "lora", "--format", "peft", "--base", "jingyaogong/MiniMind2", "--out", tmp_path / "named")
    assert code == 0, err
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == "jingyaogong/MiniMind2"
    code, _, err = cli("export", lora_runs / "lora", "--format", "hf", "--base", "x", "--out", tmp_path / "hf")
    assert code == 2 and "--base and --with-base: only with --format peft" in err and not (tmp_path / "hf").exists()


@pytest.mark.e2e
def test_a_peft_adapter_exported_with_its_base_loads_after_the_folder_moves_from_any_working_directory_as_the_docs_say(
        lora_runs, tmp_path):
    import re

    import weights

    code, _, err = cli("export", lora_runs / "lora", "--format", "peft", "--with-base", "--out", tmp_path / "made" / "adapter")
    assert code == 0, err
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(tmp_path / "made" / "adapter", moved)
    shutil.rmtree(tmp_path / "made")
    config = json.loads((moved / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base" and (moved / "base" / "config.json").is_file()
    # docs/lora.md's lines, as written, with OUT where the folder now is; the working directory stays the test's
    lines = re.search(r"```python\n(.*?PeftModel\.from_pretrained.*?)```", (launch.ROOT / "docs" / "lora.md").read_text(), re.S).group(1)
    lines = re.sub(r'^\s*OUT = ".*"', f"OUT = {str(moved)!r}", textwrap.dedent(lines), flags=re.M)
    assert os.getcwd() != str(moved) and f"OUT = {str(moved)!r}" in lines
    scope: dict = {}
    exec(lines, scope)
    model = scope["model"].float().eval()
    ours = weights.load_model(lora_runs / "lora", fp32=True)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, ours.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(ids)[0], model(ids).logits
    assert torch.equal(want, got), (want - got).abs().max().item()


def _parsed(verb: str) -> dict:
    from cli import _parser

    args = vars(_parser().parse_args([verb, "run"]))
    return {k: args[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty", "seed")}


@pytest.mark.unit
def test_chat_and_generate_have_one_set_of_sampling_defaults_a_sampling_one_with_a_repetition_penalty():
    import inspect

    from cli.chat import chat_reply
    from cli.generate import generate_text
    from model.generate import DEFAULTS, generate_ids

    assert _parsed("chat") == _parsed("generate") == {"temperature": DEFAULTS.temperature, "top_k": DEFAULTS.top_k,
                                                      "top_p": DEFAULTS.top_p, "repetition_penalty": DEFAULTS.repetition_penalty,
                                                      "seed": 0}
    assert DEFAULTS.temperature > 0 and DEFAULTS.repetition_penalty > 1
    signature = inspect.signature(generate_ids).parameters
    assert {k: signature[k].default for k in ("temperature", "top_k", "top_p", "repetition_penalty")} == vars(DEFAULTS)
    for function in (chat_reply, generate_text):  # None: the defaults above, decided in model/generate.py
        parameters = inspect.signature(function).parameters
        assert all(parameters[k].default is None for k in ("temperature", "top_k", "top_p", "repetition_penalty"))


def _model():
    from model import MiniMindLM, ModelConfig

    torch.manual_seed(0)
    return MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64)).eval()


@pytest.mark.unit
def test_a_repetition_penalty_breaks_a_greedy_repeat():
    from model.generate import DEFAULTS, generate_ids, sample

    # One position: the id already in the text leads by less than the default penalty takes from it
    logits = torch.zeros(10)
    logits[5], logits[7] = 2.0, 1.9
    assert sample(logits, [5], temperature=0.0, repetition_penalty=1.0) == 5
    assert sample(logits, [5], temperature=0.0, repetition_penalty=DEFAULTS.repetition_penalty) == 7
    # A whole generation: random tied weights copy the last byte (a space) to the limit; the penalty
    # (here a strong one, for weights this flat) makes greedy decoding leave the loop
    model, prompt = _model(), [256, *b"Return the "]
    plain = generate_ids(model, prompt, 40, temperature=0.0, repetition_penalty=1.0)[len(prompt):]
    assert len(set(plain)) == 1
    penalized = generate_ids(model, prompt, 40, temperature=0.0, repetition_penalty=3.0)[len(prompt):]
    assert len(set(penalized)) > 10


@pytest.mark.unit
def test_the_same_seed_gives_the_same_text_twice_and_another_seed_another():
    from cli.chat import chat_reply
    from cli.generate import generate_text
    from data.tokenizer import ByteTokenizer

    model, tok = _model(), ByteTokenizer()
    first = generate_text(model, "The ", 30, seed=1, tok=tok)
    assert first == generate_text(model, "The ", 30, seed=1, tok=tok) != generate_text(model, "The ", 30, seed=2, tok=tok)
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_reply(model, tok, messages, 20, seed=3) == chat_reply(model, tok, messages, 20, seed=3)
