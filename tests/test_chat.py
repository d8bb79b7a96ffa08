"""Supervised fine-tuning (docs/sft.md): the tokenizer's own chat template rendered as transformers
renders it, MiniMind's assistant-only mask, packing without cross-talk, a loss that does not depend
on the split, and chatting with the result."""
import contextlib
import io
import json

import pytest
import torch

import launch
from data import chat, tokenizer
from data.chat import IGNORE, Encoder, Packer, template_of
from test_tokenizers import MINIMIND, needs_minimind

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}}]


def conversations() -> list[dict]:
    """22 conversations in MiniMind's SFT format: system prompts, several turns, reasoning, tool
    calls (as a list and as a JSON string) and tool replies, Chinese and English."""
    u, a, s = ("user", "assistant", "system")
    t = lambda role, content, **kw: {"role": role, "content": content, **kw}  # noqa: E731
    out = [
        [t(u, "Hello!"), t(a, "Hi! How can I help?")],
        [t(u, "你好"), t(a, "你好！有什么可以帮你的吗？")],
        [t(s, "You are a helpful assistant."), t(u, "What is 2+2?"), t(a, "4.")],
        [t(s, "你是一个乐于助人的助手。"), t(u, "介绍一下长城。"), t(a, "长城是中国古代的军事防御工程。")],
        [t(u, "Name a colour."), t(a, "Blue."), t(u, "Another?"), t(a, "Green."), t(u, "One more."), t(a, "Red.")],
        [t(u, "Why is the sky blue?"), t(a, "Rayleigh scattering.", reasoning_content="Short wavelengths scatter more.")],
        [t(u, "1+1 等于几？"), t(a, "等于 2。", reasoning_content="这是基本的加法。")],
        [t(u, "Think first."), t(a, "<think>\nLet me see.\n</think>\n\nDone.")],
        [t(s, "Use tools.", tools=json.dumps(TOOLS)), t(u, "北京天气怎么样？"), t(a, "", tool_calls=json.dumps(CALL)),
         t("tool", '{"temp": 20}'), t(a, "北京今天20度。")],
        [t(s, "", tools=TOOLS), t(u, "Weather in Paris?"),
         t(a, "Let me check.", tool_calls=[{"name": "get_weather", "arguments": '{"city": "Paris"}'}]),
         t("tool", "sunny"), t(a, "It is sunny in Paris.")],
        [t(u, "Two tools at once"), t(a, "", tool_calls=CALL + CALL), t("tool", "a"), t("tool", "b"), t(a, "Both done.")],
        [t(u, "Code?"), t(a, "```python\nprint('hi')\n```")],
        [t(u, "Tabs\tand\nnewlines"), t(a, "Line one\nLine two\n")],
        [t(s, "Be brief."), t(u, "Capital of France?"), t(a, "Paris."), t(u, "And Italy?"), t(a, "Rome.")],
        [t(u, "请用英文回答：猫"), t(a, "Cat.")],
        [t(u, "Emoji 🚀?"), t(a, "Rocket 🚀.")],
        [t(u, "JSON please"), t(a, '{"a": [1, 2, {"b": null}]}')],
        [t(u, "Empty answer"), t(a, "")],
        [t(u, "多轮一"), t(a, "回答一", reasoning_content="想法一"), t(u, "多轮二"), t(a, "回答二", reasoning_content="想法二")],
        [t(s, "System only then user"), t(u, "<tool_response>x</tool_response>"), t(a, "ok")],
        [t(u, "Long " + "word " * 60), t(a, "Long answer " + "text " * 40)],
        [t(u, "Special <|im_start|> text"), t(a, "Handled.")],
    ]
    return [{"conversations": c} for c in out]


@pytest.fixture(scope="module")
def sft_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "sft.jsonl"
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations()))
    return path


def parsed(corpus):
    from data.sources import Corpus, Reader

    return [item for item, _ in Reader(Corpus.of_file(corpus), parse=chat.parse_conversation)]


@needs_minimind
@pytest.mark.e2e
def test_the_ids_are_transformers_apply_chat_template_tokenized_with_minimind_and_a_trained_tokenizer(sft_corpus, trained):
    from transformers import PreTrainedTokenizerFast

    for path in (MINIMIND, trained):
        tok = tokenizer.load(str(path))
        enc = Encoder(tok, template_of(tok), chat.ChatOptions())
        hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent))
        items = parsed(sft_corpus)
        assert len(items) >= 20
        for messages, tools in items:
            text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
            assert enc.render(messages, tools) == text
            assert enc.encode(messages, tools)[0] == hf(text, add_special_tokens=False)["input_ids"]


@needs_minimind
@pytest.mark.unit
def test_only_assistant_turns_teach_from_after_the_opener_through_im_end_and_its_newline():
    tok = tokenizer.load(str(MINIMIND))
    enc = Encoder(tok, template_of(tok), chat.ChatOptions())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！", "reasoning_content": "问候"}]
    ids, taught = enc.encode(messages)
    spans, span = [], []
    for i, t in zip(ids, taught):
        if t:
            span.append(i)
        elif span:
            spans.append(tok.decode_rendered(span))
            span = []
    if span:
        spans.append(tok.decode_rendered(span))
    assert spans == ["<think>\n\n</think>\n\nHello<|im_end|>\n", "<think>\n问候\n</think>\n\n你好！<|im_end|>\n"]
    assert chat.labels_of(ids, taught)[: 3] == [IGNORE] * 3
    all_ids, all_taught = Encoder(tok, template_of(tok), chat.ChatOptions(loss_on="all")).encode(messages)
    assert all_ids == ids and all(all_taught)


@pytest.mark.unit
def test_inspect_prints_input_ids_and_labels_and_the_text_with_taught_spans_marked(sft_corpus):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert chat.main(["inspect", str(sft_corpus), "--n", "2"]) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2 and all(len(x["input_ids"]) == len(x["labels"]) for x in lines)
    tok = tokenizer.ByteTokenizer()
    first = lines[0]
    taught = [i for i, lab in zip(first["input_ids"], first["labels"]) if lab != IGNORE]
    assert tok.decode_rendered(taught) == "Hi! How can I help?<|im_end|>\n"
    assert all(lab in (IGNORE, i) for i, lab in zip(first["input_ids"], first["labels"]))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert chat.main(["inspect", str(sft_corpus), "--n", "1", "--text"]) == 0
    assert out.getvalue() == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n[[Hi! How can I help?<|im_end|>\n]]\n"


@pytest.mark.e2e
def test_a_reader_that_goes_away_ends_inspect_quietly_with_0_blaming_no_file(tmp_path, sft_corpus):
    """`python -m data.chat inspect FILE | head -1`: the reader closes its pipe after one line."""
    big = tmp_path / "many.jsonl"
    big.write_text(sft_corpus.read_text() * 400)  # far more than a pipe's buffer of output
    proc = launch.subprocess.Popen([launch.PY, "-m", "data.chat", "inspect", str(big), "--n", "100000"], cwd=launch.ROOT,
                                   stdout=launch.subprocess.PIPE, stderr=launch.subprocess.PIPE)
    assert json.loads(proc.stdout.readline())["input_ids"]
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and not err.strip(), err


@pytest.mark.unit
def test_a_conversations_logits_inside_a_pack_equal_its_logits_alone():
    from model import MiniMindLM, ModelConfig

    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=128, vocab_size=259)).eval()
    tok = tokenizer.ByteTokenizer()
    enc = Encoder(tok, template_of(tok), chat.ChatOptions())
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in
             (("Hi", "Hello there"), ("2+2?", "4"), ("Colour?", "Blue, mostly."))]
    packer = Packer(128, tok.pad, pack=True, drop_long=False)
    for messages in convs:
        assert packer.add(*enc.encode(messages)) == []
    [row] = packer.finish()
    x, pos = torch.from_numpy(row[0])[None], torch.from_numpy(row[2])[None]
    assert (pos == 0).sum() > 3  # three conversations, then padding
    with torch.no_grad():
        packed, _ = model(x, positions=pos)
        at, worst = 0, 0.0
        for messages in convs:
            ids = enc.encode(messages)[0][:-1]
            alone, _ = model(torch.tensor([ids]))
            worst = max(worst, (packed[0, at:at + len(ids)] - alone[0]).abs().max().item())
            at += len(ids)
    # Measured here: 2.4e-7 for five seeds (the masked kernel sums the same terms in another order); bound 10x.
    assert worst <= 2.4e-6, worst


@pytest.mark.unit
def test_packing_fills_rows_best_fit_and_counts_what_it_truncates_drops_or_skips():
    p = Packer(10, 0, pack=True, drop_long=False, open_rows=2)
    assert p.add(list(range(7)), [True] * 7) == []  # 6 positions
    assert p.add(list(range(5)), [True] * 5) == []  # 4: fits the first row exactly
    assert p.add(list(range(20)), [True] * 20) == []  # truncated to 10 positions: a new row
    assert p.add(list(range(4)), [False] * 4) == []  # teaches nothing: skipped
    rows = p.finish()
    assert [list(r[2]) for r in rows] == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], list(range(10))]
    assert p.stats["truncated"] == 1 and p.stats["untaught"] == 1 and p.stats["conversations"] == 3
    d = Packer(10, 0, pack=True, drop_long=True)
    assert d.add(list(range(20)), [True] * 20) == [] and d.stats["dropped_long"] == 1 and d.finish() == []
    padded = Packer(10, 0, pack=False, drop_long=False)
    [row] = padded.add(list(range(5)), [True] * 5)
    assert list(row[1]) == [1, 2, 3, 4] + [IGNORE] * 6 and list(row[2]) == [0, 1, 2, 3] + [0] * 6


def bad_chat(kind: str, d):
    good = json.dumps(conversations()[0])
    lines = {"no-conversations": '{"text": "pretraining, not chat"}',
             "unknown-role": json.dumps({"conversations": [{"role": "narrator", "content": "x"}]}),
             "content-not-string": json.dumps({"conversations": [{"role": "user", "content": ["x"]}]})}
    path = d / f"{kind}.jsonl"
    path.write_text(good + "\n" + lines.get(kind, good) + "\n")
    return path


@pytest.mark.unit
@pytest.mark.parametrize("kind, named", [
    ("no-conversations", ':2: expected an object with a non-empty "conversations" list'),
    ("unknown-role", ":2: conversations[0] has role 'narrator'; expected one of system, user, assistant, tool"),
    ("content-not-string", ":2: conversations[0] (user): content must be a string, got list"),
])
def test_bad_chat_lines_exit_2_naming_file_line_and_role_with_nothing_packed(tiny, tmp_path, kind, named):
    path = bad_chat(kind, tmp_path)
    code, err = launch.in_process(*tiny, f"data.path={path}", "data.format=chat", f"data.cache_dir={tmp_path / 'cache'}",
                                  f"out_dir={tmp_path / 'run'}")
    assert code == 2 and f"{path}{named}" in err and "Traceback" not in err, err
    assert not [p for p in (tmp_path / "cache").glob("*") if p.suffix in (".bin", ".json", ".npy")]


@needs_minimind
@pytest.mark.unit
def test_a_template_that_raises_or_a_tokenizer_without_one_is_exit_2_naming_the_config(tiny, tmp_path, sft_corpus):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(MINIMIND.read_bytes())
    config = json.loads((MINIMIND.parent / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    run = [*tiny, f"data.path={sft_corpus}", "data.format=chat", f"data.tokenizer={folder / 'tokenizer.json'}",
           f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}"]
    code, err = launch.in_process(*run)
    assert code == 2 and f"{folder / 'tokenizer_config.json'}: no chat_template" in err, err
    config["chat_template"] = "{% if messages|length > 1 %}{{ raise_exception('only one turn, please') }}{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    code, err = launch.in_process(*run)
    assert code == 2 and "raised: only one turn, please" in err and "Traceback" not in err, err
    assert not list((tmp_path / "cache").glob("*.bin"))


@pytest.mark.unit
def test_a_system_prompt_is_added_to_the_given_ratio_as_a_pure_function_of_seed_and_index():
    opts = chat.ChatOptions(system_prompt_ratio=0.2, seed=1337)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    first = [chat.with_system_prompt(messages, i, opts) for i in range(2000)]
    assert first == [chat.with_system_prompt(messages, i, opts) for i in range(2000)]
    added = sum(len(m) == 3 for m in first)
    assert 300 < added < 500  # 20% of 2000, within sampling noise
    assert chat.with_system_prompt([{"role": "system", "content": "x"}, *messages], 0, chat.ChatOptions(1, seed=0)) != messages
    assert first != [chat.with_system_prompt(messages, i, chat.ChatOptions(system_prompt_ratio=0.2, seed=1)) for i in range(2000)]


@pytest.mark.e2e
def test_a_chat_run_is_bit_identical_on_1_2_and_3_processes_and_across_a_resume_that_changes_the_world_size(sft_corpus, tmp_path):
    base = [f"data.path={sft_corpus}", "data.format=chat", f"data.cache_dir={tmp_path / 'cache'}", "model.init_from=",
            "model.dim=32", "model.n_layers=2", "model.seq_len=128", "train.global_batch=6", "train.micro_batch=1",
            "train.steps=7", "train.warmup_steps=2", "checkpoint.keep=100", "dist.reduce=canonical",
            "runtime.threads=1", "log.progress=false", "log.sample_ids=true"]
    assert launch.in_process(*base, "checkpoint.interval=1", f"out_dir={tmp_path / 'one'}")[0] == 0  # uninterrupted, 1 process
    # Steps 1-3 on 2 processes, 4-5 on 3, 6-7 on 1: each stretch is compared with the one-process run.
    launch.run(2, *base, "train.halt_at=3", f"out_dir={tmp_path / 'moved'}")  # an odd step on 2
    launch.run(3, *base, "train.halt_at=5", f"out_dir={tmp_path / 'moved'}")  # then 3
    assert launch.in_process(*base, f"out_dir={tmp_path / 'moved'}")[0] == 0  # then 1
    launch.assert_same_as_reference_at(tmp_path / "moved", tmp_path / "one", 7)


@needs_minimind
@pytest.mark.e2e
def test_chat_replies_greedily_and_transformers_reproduces_the_reply_from_the_hf_export(sft_corpus, tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cli import main as checkpoint_main
    from cli.chat import chat_reply
    from model.generate import DEFAULTS
    from weights import load_model, load_tokenizer

    out = tmp_path / "run"
    code, err = launch.in_process(*tiny, f"data.path={sft_corpus}", "data.format=chat", f"data.tokenizer={MINIMIND}",
                                  "model.seq_len=128", "train.steps=6", f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={out}")
    assert code == 0, err
    messages = [{"role": "user", "content": "What does os.path.join do?"}]
    text, ids = chat_reply(load_model(out), load_tokenizer(out), messages, max_new_tokens=24, temperature=0.0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        assert checkpoint_main(["chat", str(out), "--prompt", messages[0]["content"], "--tokens", "24", "--temperature", "0"]) == 0
    assert printed.getvalue() == text + "\n"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert checkpoint_main(["export", str(out), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "chat_template" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    start = hf_tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(start, max_new_tokens=24, do_sample=False,  # with chat's repetition penalty: HF's rule
                                   repetition_penalty=DEFAULTS.repetition_penalty)[0, start.shape[1]:].tolist()
    eos = load_tokenizer(out).eos
    assert ids and generated[: len(ids)] == ids and (len(ids) == 24 or generated[len(ids)] == eos)


@pytest.mark.e2e
def test_the_steps_loss_is_over_the_taught_tokens_of_the_global_batch_whatever_the_micro_batch(sft_corpus, tiny, tmp_path):
    """Rows teach different numbers of tokens, so a mean of per-micro-batch means would move with
    the split; the sum over the taught tokens / their global count does not (up to float order)."""
    losses = {}
    for micro in (1, 3, 6):
        out = tmp_path / f"micro{micro}"
        code, err = launch.in_process(*tiny, f"data.path={sft_corpus}", "data.format=chat", "model.seq_len=128", "train.steps=1",
                                      "train.global_batch=6", f"train.micro_batch={micro}", f"data.cache_dir={tmp_path / 'cache'}",
                                      f"out_dir={out}")
        assert code == 0, err
        losses[micro] = launch.metrics(out)[0]["loss"]
    # Measured here: equal for micro batches 1, 2, 3 and 6 (the same float sums); so asserted equal.
    assert losses[1] == losses[3] == losses[6], losses
