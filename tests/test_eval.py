"""Benchmarks (objectives/benchmark.py, cli/evaluate.py, docs/eval.md): multiple-choice tasks in C-Eval's
layout and perplexity scored as lm-evaluation-harness scores them, with `lm_eval` itself on our Hugging
Face export as the referee; bad task files exit 2 naming file:line; eval.tasks during training draws
nothing of training's."""
import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch
from objectives import benchmark
from objectives.benchmark import Item, TaskError

DOCS = launch.ROOT / "docs" / "eval.md"
MIXED = [  # choices whose lengths in characters, bytes and byte tokens disagree, so acc_norm is tested
    {"question": "猫的英文是什么？", "A": "cat", "B": "狗", "C": "a small bird", "D": "鱼类", "answer": "A"},
    {"question": "Which is a fruit?", "A": "苹果", "B": "stone", "C": "桌子和椅子", "D": "river bank", "answer": "A"},
    {"question": "1 + 1 = ?", "A": "二", "B": "two", "C": "3", "D": "eleven", "answer": "B"},
    {"question": "天空是什么颜色？", "A": "green grass", "B": "红", "C": "蓝色", "D": "blue", "answer": "D"},
]


def tiny_model(seq_len: int = 64):
    from model import MiniMindLM, ModelConfig

    torch.manual_seed(0)
    return MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=seq_len, vocab_size=259)).eval()


def cli(*args: str) -> tuple[int, str, str]:
    """`python -m checkpoint ...`'s main() in this process: (exit code, stdout, stderr)."""
    from cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny):
    """A tiny chat run on the built-in conversations (byte tokenizer), 6 steps."""
    out = tmp_path_factory.mktemp("eval") / "sft_tiny"
    code, err = launch.in_process(*tiny, "data.path=stdlib-chat", "data.format=chat", "model.seq_len=128", "train.steps=6",
                                  f"out_dir={out}")
    assert code == 0, err
    return out


# ---------------------------------------------------------------------------------------------- the harness's rules

@pytest.mark.unit
def test_the_continuation_is_the_whole_texts_ids_past_the_contexts_and_trailing_spaces_move_to_it(trained):
    from data.tokenizer import ByteTokenizer, load

    byte = ByteTokenizer()
    assert benchmark.encode_pair(byte, "Q: hi\nA: ", "yes") == (list(b"Q: hi\nA:"), list(b" yes"))
    bpe = load(str(trained))
    ctx, cont = benchmark.encode_pair(bpe, "the model", " data")
    assert ctx + cont == bpe.encode("the model data") and ctx == bpe.encode("the model")


@pytest.mark.unit
def test_acc_norm_divides_by_characters_acc_bytes_by_utf8_bytes_and_ties_go_to_the_first_choice():
    # "猫" is 1 character and 3 bytes (3 byte tokens), "dog" 3 of each: per character the English choice
    # wins, per byte or per token the Chinese one
    picks = benchmark.choose([-3.0, -4.0], ["猫", "dog"])
    assert picks == {"pred": 0, "pred_norm": 1, "pred_bytes": 0}
    assert benchmark.choose([-2.0, -2.0, -5.0], ["A", "B", "C"]) == {"pred": 0, "pred_norm": 0, "pred_bytes": 0}


@pytest.mark.unit
def test_the_letters_style_asks_c_evals_prompt_and_the_text_style_each_choices_text():
    item = Item(" What is 3 + 4? ", ("7", "12", "5", "9"), 0, "x:1")
    ctx, conts, texts = benchmark.requests(item, "letters")
    assert ctx == "What is 3 + 4?\nA. 7\nB. 12\nC. 5\nD. 9\n答案：" and conts == [" A", " B", " C", " D"] and texts == list("ABCD")
    ctx, conts, texts = benchmark.requests(item, "text")
    assert ctx == "Question: What is 3 + 4?\nAnswer:" and conts == [" 7", " 12", " 5", " 9"] and texts == ["7", "12", "5", "9"]


@pytest.mark.unit
def test_rolling_windows_predict_every_id_once_the_first_after_bos_and_the_last_with_a_full_windows_context():
    ids = list(range(10, 20))
    assert benchmark.rolling_windows(ids, 1, 4) == [([1], [10, 11, 12, 13]), ([13], [14, 15, 16, 17]), ([15, 16, 17], [18, 19])]
    assert benchmark.rolling_windows([], 1, 4) == []


@pytest.mark.unit
def test_a_choices_log_likelihood_is_the_sum_of_its_ids_log_softmax_after_the_context_alone_or_in_a_padded_batch():
    model = tiny_model()
    pairs = [([1, 2, 3], [4, 5]), ([7], [8, 9, 10, 11]), ([3, 3, 3, 3, 3], [6])]
    got = benchmark.loglikelihoods(model, pairs)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        with torch.no_grad():
            logits, _ = model(torch.tensor([ctx + cont]))
        logp = torch.log_softmax(logits[0].float(), -1)[len(ctx) - 1: len(ctx) + len(cont) - 1]
        assert ll == pytest.approx(float(logp.gather(1, torch.tensor(cont)[:, None]).sum()), abs=1e-5)
        assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())
    assert [ll for ll, _ in benchmark.loglikelihoods(model, pairs[1:2])] == pytest.approx([got[1][0]], abs=1e-5)


@pytest.mark.unit
def test_items_split_across_ranks_and_gathered_give_the_one_process_figures_item_by_item_and_touch_no_generator():
    from data.tokenizer import ByteTokenizer

    model, tok = tiny_model(), ByteTokenizer()
    tasks = benchmark.read_tasks("arith,text:arith")
    tasks = [benchmark.Task(t.name, t.style, t.items[:9], t.source) for t in tasks]
    state = torch.get_rng_state()
    model.train()
    alone = benchmark.evaluate_tasks(model, tok, tasks)
    assert model.training and torch.equal(torch.get_rng_state(), state)
    for world, sharded in ((2, False), (3, True)):
        parts = [[] for _ in range(world)]
        for r in range(world):  # each rank's share (the figures of a partial gather are ignored) ...
            benchmark.evaluate_tasks(model, tok, tasks, r, world, lambda mine, r=r: parts.__setitem__(r, mine) or parts, sharded)
            assert [k for k, _ in parts[r]] == list(range(r, 18, world))
        # ... then what every rank computes from the whole gather
        assert benchmark.evaluate_tasks(model, tok, tasks, 1, world, lambda mine: parts, sharded) == alone


# ---------------------------------------------------------------------------------------------- task files

def bad_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.unit
@pytest.mark.parametrize("name, text, named", [
    ("no_answer.jsonl", '{"question": "q", "A": "1", "B": "2", "answer": "A"}\n{"question": "q", "A": "1", "B": "2"}\n',
     r"no_answer\.jsonl:2: no column 'answer'"),
    ("no_d.jsonl", '{"question": "q", "A": "1", "B": "2", "C": "3", "D": "4", "answer": "A"}\n\n'
                   '{"question": "q", "A": "1", "B": "2", "C": "3", "answer": "B"}\n', r"no_d\.jsonl:3: no column 'D'"),
    ("outside.jsonl", '{"question": "q", "A": "1", "B": "2", "C": "3", "D": "4", "answer": "E"}\n',
     r"outside\.jsonl:1: answer 'E' is not one of the choices A, B, C, D"),
    ("no_question.csv", "id,A,B,C,D,answer\n1,a,b,c,d,A\n", r"no_question\.csv:1: no column 'question'"),
    ("outside.csv", 'id,question,A,B,C,D,answer\n1,"two\nlines",a,b,c,d,A\n2,q,a,b,c,d,7\n',
     r"outside\.csv:4: answer '7' is not one of the choices"),
    ("empty_choice.csv", "question,A,B,C,D,answer\nq,a,b,,d,A\n", r"empty_choice\.csv:2: choice 'C' is empty"),
    ("not_json.jsonl", '{"question": "q", "A": "1", "B": "2", "answer": "A"}\n{"question": \n', r"not_json\.jsonl:2: not JSON"),
    ("list.jsonl", '{"question": ["q"], "A": "1", "B": "2", "answer": "A"}\n', r"list\.jsonl:1: column 'question' must be text"),
])
def test_a_bad_task_file_exits_2_naming_file_and_line_before_any_model_is_read(tmp_path, name, text, named):
    path = bad_file(tmp_path, name, text)
    with pytest.raises(TaskError, match=named):
        benchmark.read_tasks([str(path)])
    code, out, err = cli("eval", str(tmp_path / "no_run_here"), "--tasks", str(path))
    assert code == 2 and re.search(named, err) and "Traceback" not in err and out == ""


@pytest.mark.unit
def test_cmmlus_capitalized_columns_and_csv_files_read_as_c_evals(tmp_path):
    path = bad_file(tmp_path, "cmmlu.csv", ",Question,A,B,C,D,Answer\n0,天空是什么颜色？,红,蓝,绿,黄,B\n")
    (task,) = benchmark.read_tasks([str(path)])
    assert task.name == "cmmlu" and task.items == (Item("天空是什么颜色？", ("红", "蓝", "绿", "黄"), 1, f"{path}:2"),)
    with pytest.raises(TaskError, match="named twice"):
        benchmark.read_tasks([str(path), str(path)])
    with pytest.raises(TaskError, match="not a file, nor a built-in task"):
        benchmark.read_tasks(["no_such_task"])


@pytest.mark.e2e
def test_eval_on_a_fresh_run_scores_the_built_in_task_with_a_line_per_task_and_json_per_task_and_overall(run, tmp_path):
    code, out, err = cli("eval", str(run), "--tasks", "arith", "text:arith", "--limit", "12", "--out", str(tmp_path / "r.json"))
    assert code == 0, err
    got = json.loads(out)
    assert set(got["tasks"]) == {"arith", "arith_text"} and got["overall"]["items"] == 24
    for name, r in got["tasks"].items():
        assert r["items"] == 12 and 0 <= r["acc"] <= 1 and re.search(rf"^{name}: acc {r['acc']:.4f}  acc_norm", err, re.M)
    assert got["overall"]["acc"] == pytest.approx((got["tasks"]["arith"]["acc"] + got["tasks"]["arith_text"]["acc"]) / 2)
    assert len(json.loads((tmp_path / "r.json").read_text())["tasks"]["arith"]["picks"]) == 12


# ---------------------------------------------------------------------------------------------- the referee

def docs_blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOCS.read_text(), re.S)


@pytest.mark.e2e
def test_the_docs_commands_run_and_lm_eval_on_the_hf_export_gives_the_same_scores_and_picks_item_by_item(run, tmp_path):
    """docs/eval.md's commands as written (the run's path for runs/sft_tiny), then lm-evaluation-harness on
    the export with the docs' local tasks: acc and acc_norm per task, pred and pred_norm per item, and
    the byte perplexity of the held-out text."""
    items = [*({"question": i.question, **dict(zip("ABCD", i.choices)), "answer": "ABCD"[i.answer]}
               for i in benchmark.builtin_arith()[:24]), *MIXED]
    (tmp_path / "my_task.jsonl").write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items), encoding="utf-8")
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in (
        "os.path.join joins one or more path components intelligently. " * 6, "天空是蓝色的。Short line.")), encoding="utf-8")
    (tmp_path / "tasks").mkdir()
    for block in docs_blocks("yaml"):
        name = re.match(r"task: (\w+)", block).group(1)
        (tmp_path / "tasks" / f"{name}.yaml").write_text(block, encoding="utf-8")
    venv_bin = Path(sys.executable).parent
    env = {**launch.os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(launch.ROOT)}
    commands = [line for block in docs_blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(commands) == 4
    for line in commands:
        line = line.split("  #")[0].replace("runs/sft_tiny", str(run)).replace(".venv/bin/python", sys.executable)
        line = line.replace(".venv/bin/lm_eval", str(venv_bin / "lm_eval"))
        proc = subprocess.run(shlex.split(line), cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    ours = json.loads((tmp_path / "results.json").read_text())
    (results,) = (tmp_path / "lm_eval_out").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]
    for name in ("my_task", "my_task_text"):
        mine = ours["tasks"][name]
        assert mine["items"] == len(items)
        assert (mine["acc"], mine["acc_norm"]) == (theirs[name]["acc,none"], theirs[name]["acc_norm,none"])
        (samples,) = [p for p in (tmp_path / "lm_eval_out").rglob("samples_*.jsonl") if re.fullmatch(rf"samples_{name}_\d.*", p.name)]
        rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
        for pick, row, item in zip(mine["picks"], rows, items):
            lls = [float(r[0][0]) for r in row["resps"]]
            texts = list("ABCD") if name == "my_task" else [item[k] for k in "ABCD"]
            assert {k: pick[k] for k in ("pred", "pred_norm")} == {k: v for k, v in benchmark.choose(lls, texts).items()
                                                                   if k != "pred_bytes"}, (name, row["doc_id"])
            assert (row["acc"], row["acc_norm"]) == (float(pick["pred"] == pick["answer"]), float(pick["pred_norm"] == pick["answer"]))
    mine = ours["perplexity"]["held_out.jsonl"]
    assert mine["byte_perplexity"] == pytest.approx(theirs["held_out"]["byte_perplexity,none"], rel=1e-5)
    assert mine["bits_per_byte"] == pytest.approx(theirs["held_out"]["bits_per_byte,none"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- during training

def saved_generators(out: Path) -> bytes:
    """The generator states a run's newest checkpoint holds (rank 0's blob), read as the manager reads them."""
    from checkpoint import format, storage

    folder, manifest, _ = storage.find_checkpoint(out)
    state = format.load({"rng": {"0": b""}}, folder, manifest["files"], storage.read_metadata(folder, manifest), no_dist=True)
    return state["rng"]["0"]


@pytest.mark.e2e
def test_a_run_scoring_eval_tasks_logs_them_and_ends_bit_identical_to_the_run_without_weights_losses_and_generators(tiny, tmp_path):
    """Dropout is on, so an evaluation that left the model training or drew from the global generators
    would show: in the losses, or in the generator states every checkpoint saves (docs/design.md I6, I15)."""
    base = [*tiny, "model.dropout=0.1", "train.steps=6", "checkpoint.interval=3", "data.val_samples=16", "eval.interval=3"]
    code, err = launch.in_process(*base, f"out_dir={tmp_path / 'plain'}")
    assert code == 0, err
    code, err = launch.in_process(*base, "eval.tasks=arith,text:arith", f"out_dir={tmp_path / 'tasks'}")
    assert code == 0, err
    launch.assert_identical(tmp_path / "tasks", tmp_path / "plain")
    plain, tasks = launch.metrics(tmp_path / "plain"), launch.metrics(tmp_path / "tasks")
    assert [m.get("val_loss") for m in plain] == [m.get("val_loss") for m in tasks]
    scored = [m for m in tasks if "eval/arith/acc" in m]
    assert [m["step"] for m in scored] == [3, 6]
    assert all(0 <= m[f"eval/{t}/{k}"] <= 1 for m in scored for t in ("arith", "arith_text") for k in ("acc", "acc_norm"))
    a, b = saved_generators(tmp_path / "tasks"), saved_generators(tmp_path / "plain")
    assert len(a) > 1000 and a == b


@pytest.mark.unit
def test_eval_tasks_without_an_interval_or_with_a_bad_file_is_a_config_error_naming_it(tiny, tmp_path):
    from configs import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.tasks: scored every eval.interval steps"):
        load_config(None, [*tiny, "eval.tasks=arith"])
    path = bad_file(tmp_path, "t.jsonl", '{"question": "q", "A": "1", "B": "2", "answer": "C"}\n')
    with pytest.raises(ConfigError, match=rf"eval.tasks: {re.escape(str(path))}:1: answer 'C' is not one of the choices A, B"):
        load_config(None, [*tiny, "eval.interval=2", f"eval.tasks={path}"])
    assert load_config(None, [*tiny, "eval.interval=2", "eval.tasks=arith"]).eval.tasks == "arith"
