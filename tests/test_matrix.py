"""The combinations matrix (tests/matrix.py, docs/tests.md "The matrix"): every generated case
halted and resumed equals its uninterrupted run (sha256 and every logged figure), and its result
exports, inspects and generates; every refused case exits 2 naming its keys. `-m matrix` runs it, and
CI (`CI=true` adds it in scripts/test.sh); a plain `bash scripts/test.sh` leaves it out (pytest.ini)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import launch
import matrix
from run.metrics import TIMING

CASES = matrix.cases()


def _inputs(out: Path, corpus: Path) -> None:
    """Each objective's corpus, small: text, chats, preference pairs, unpaired examples, prompts and a pure reward; and
    distillation's teacher, an MoE of twice the width (2 steps on the text)."""
    from test_chat import conversations
    from test_dpo import pairs, write
    from test_agent import AGENT_MODULE, TOOL_SCHEMAS
    from test_grpo import REWARD
    from test_kto import examples

    out.mkdir(parents=True)
    (out / "corpus.txt").write_bytes(corpus.read_bytes())
    write(out / "chats.jsonl", conversations())
    write(out / "dpo.jsonl", pairs(24))
    write(out / "kto.jsonl", examples(24))
    words = "red blue green cat dog sun moon tree river stone bird fish".split()
    write(out / "prompts.jsonl", [{"prompt": f"Say {w}.", "answer": w} for w in words] * 2)
    (out / "rewards.py").write_text(REWARD)
    (out / "corpus2.txt").write_text("".join(reversed(corpus.read_text().splitlines(keepends=True))))
    write(out / "agent.jsonl", [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "tools": TOOL_SCHEMAS,
                                 "gt": [str(a + b)]} for a, b in [(3, 4), (12, 7), (5, 5), (40, 2), (9, 9), (1, 30)]] * 2)
    (out / "agent_tools.py").write_text(AGENT_MODULE)
    launch.run(0, *matrix.COMMON, *data_overrides(out)["pretrain"], *TEACHER, "train.steps=2", f"out_dir={out / 'teacher'}")


TEACHER = ["model.dim=64", "model.qk_norm=true", "model.norm_eps=1e-6", "model.moe.experts=4", "model.moe.top_k=2"]
"""Distillation's teacher in every case: an MoE of twice the width, whatever the student's model."""


def data_overrides(inputs: Path) -> dict[str, list[str]]:
    cache = f"data.cache_dir={inputs / 'cache'}"
    return {
        "pretrain": [f"data.path={inputs / 'corpus.txt'}", cache, "train.global_batch=12", "train.micro_batch=2"],
        "sft": [f"data.path={inputs / 'chats.jsonl'}", "data.format=chat", cache, "train.global_batch=6", "train.micro_batch=1"],
        "lora": [f"data.path={inputs / 'corpus.txt'}", cache, "train.global_batch=12", "train.micro_batch=2"],
        "dpo": [f"data.path={inputs / 'dpo.jsonl'}", "data.format=preference", "train.objective=dpo", cache,
                "train.global_batch=6", "train.micro_batch=1", "train.dpo.beta=0.2"],
        "kto": [f"data.path={inputs / 'kto.jsonl'}", "data.format=unpaired", "train.objective=kto", cache,
                "train.global_batch=6", "train.micro_batch=1"],
        "grpo": [f"data.path={inputs / 'prompts.jsonl'}", "data.format=prompts", "train.objective=grpo", cache,
                 "train.global_batch=12", "train.micro_batch=2", "train.grpo.generations=2", "train.grpo.max_new_tokens=6",
                 f"train.grpo.reward={inputs / 'rewards.py'}:vowels"],
        "mix": [f"data.mix=[{{path: {inputs / 'corpus.txt'}, weight: 2, name: a}}, {{path: {inputs / 'corpus2.txt'}, weight: 1, name: b}}]",
                cache, "train.global_batch=12", "train.micro_batch=2"],
        "ppo": [f"data.path={inputs / 'prompts.jsonl'}", "data.format=prompts", "train.objective=ppo", cache,
                "train.global_batch=12", "train.micro_batch=2", "train.grpo.generations=2", "train.grpo.max_new_tokens=6",
                f"train.grpo.reward={inputs / 'rewards.py'}:vowels", "train.ppo.updates_per_rollout=2"],
        "agent": [f"data.path={inputs / 'agent.jsonl'}", "data.format=agent", "train.objective=grpo", cache,
                  "train.global_batch=12", "train.micro_batch=2", "train.grpo.generations=2", "train.grpo.max_new_tokens=6",
                  "train.grpo.updates_per_rollout=2", f"train.grpo.reward={inputs / 'agent_tools.py'}:episode",
                  f"train.agent.tools={inputs / 'agent_tools.py'}:double,{inputs / 'agent_tools.py'}:broken",
                  f"train.agent.parser={inputs / 'agent_tools.py'}:calls", "train.agent.max_turns=3"],
        "distill": [f"data.path={inputs / 'corpus.txt'}", cache, "train.global_batch=12", "train.micro_batch=2",
                    "train.objective=distill", f"train.distill.teacher={inputs / 'teacher'}"],
    }


def _sources(out: Path, model: str, inputs: Path) -> None:
    """A model's weights in every form a case starts from: a run folder, its Hugging Face export, its
    MiniMind .pth export, and a PEFT folder of adapters trained over it."""
    base = [*matrix.COMMON, *matrix.MODELS[model], *data_overrides(inputs)["pretrain"], "train.steps=2"]
    launch.run(0, *base, f"out_dir={out / 'run'}")
    launch.run(0, *base, "train.lora.rank=4", "train.lora.targets=q_proj,v_proj", f"model.init_from={out / 'run'}",
               f"out_dir={out / 'lora'}")
    for src, fmt, dest in (("run", "hf", "hf"), ("run", "minimind", "model.pth"), ("lora", "peft", "peft")):
        cli("export", out / src, "--format", fmt, "--out", out / dest)


def cli(*args) -> str:
    """`python -m checkpoint ARGS` as main() in this process (each case's figures are launched runs;
    the commands' own launches are tested in test_weights.py and test_lora.py): its stdout."""
    import contextlib
    import io

    from cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    assert code == 0, f"checkpoint {' '.join(map(str, args))}: exit {code}\n{err.getvalue()[-3000:]}"
    return out.getvalue()


@pytest.fixture(scope="session")
def inputs(tmp_path_factory, worker_id, corpus) -> Path:
    return launch.once(launch.shared_root(tmp_path_factory, worker_id), "matrix-inputs", lambda out: _inputs(out, corpus))


@pytest.fixture(scope="session")
def sources(tmp_path_factory, worker_id, inputs):
    root = launch.shared_root(tmp_path_factory, worker_id)

    def get(model: str) -> dict[str, str]:
        folder = launch.once(root, f"matrix-sources-{model}", lambda out: _sources(out, model, inputs))
        return {"run": str(folder / "run"), "hf": str(folder / "hf"), "pth": str(folder / "model.pth"), "peft": str(folder / "peft")}

    return get


def figures(out: Path) -> list[dict]:
    """Every logged figure of every step, the timing fields aside."""
    return [{k: v for k, v in m.items() if k not in TIMING} for m in launch.metrics(out)]


@pytest.mark.matrix
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_case_is_exact_or_refused_naming_its_keys(case, inputs, sources, tmp_path, request):
    args = matrix.overrides(case, data_overrides(inputs), sources(case["model"]) if case["source"] != "seeded" else {})
    (w0, s0), (w1, s1) = matrix.geometry(case)
    env, out, refused = None, tmp_path / "run", tmp_path / "refused"
    if case["storage"] == "s3":  # the run folder in object storage (docs/object_storage.md): a real S3 server
        request.getfixturevalue("s3_server")
        env = {"MINIMIND_STAGING_DIR": str(tmp_path / "staging")}
        out = refused = f"s3://runs/matrix-{tmp_path.name}"
    if case.verdict != "run":  # refused at the first launch whose settings the rule names (the start, or the resume)
        proc = launch.run(w0, *args, f"dist.strategy={s0}", f"train.halt_at={matrix.HALT}", f"out_dir={refused}",
                          expect=None, launcher="runtime.launch", env=env)
        if proc.returncode == 0:
            proc = launch.run(w1, *args, f"dist.strategy={s1}", f"out_dir={refused}", expect=None, launcher="runtime.launch", env=env)
        assert proc.returncode == 2, proc.stderr[-3000:]
        said = [line for line in proc.stderr.strip().splitlines() if not re.match(r"[WEI]\d{4} ", line)]  # torchrun's own log aside
        last = said[-2:]  # the refusal, then at most the launcher's one-line summary
        assert any(all(key in line for key in case.keys) for line in last), last
        assert "Traceback" not in proc.stderr
        return
    one = tmp_path / "one"
    if case["compile"] == "eager":  # the uninterrupted run in this process; a compiled one in its own (no compile cache shared)
        code, err = launch.in_process(*args, f"dist.strategy={s0}", f"out_dir={one}")
        assert code == 0, err[-3000:]
    else:
        launch.run(0, *args, f"dist.strategy={s0}", f"out_dir={one}")
    launch.run(w0, *args, f"dist.strategy={s0}", f"train.halt_at={matrix.HALT}", f"out_dir={out}", env=env)
    resumed = launch.run(w1, *args, f"dist.strategy={s1}", f"out_dir={out}", env=env)
    assert f"step {matrix.HALT}" in resumed.stderr, resumed.stderr[-3000:]
    if env:  # read back from the store: the verified copy every command reads (checkpoint/remote.py: fetch)
        from checkpoint import remote

        out = remote.fetch(out, tmp_path / "fetched")
    assert figures(out) == figures(one)
    info = launch.inspect(out)
    assert info["model_sha256"] == launch.inspect(one)["model_sha256"] and info["manifest_model_sha256_matches"]
    cli("export", out, "--format", "hf", "--out", tmp_path / "hf")
    if case["objective"] == "lora":
        cli("export", out, "--format", "peft", "--out", tmp_path / "peft")
    assert cli("generate", out, "--prompt", "Say red.", "--tokens", "4", "--seed", "1").strip(), "generate wrote nothing"


@pytest.mark.unit
def test_the_cases_cover_every_pair_of_values_a_runnable_combination_holds_and_each_refusal():
    import itertools

    every = [dict(zip(matrix.DIMENSIONS, v)) for v in itertools.product(*matrix.DIMENSIONS.values())]
    want = set().union(*(matrix._pairs(c) for c in every if matrix.verdict(c)[0] == "run"))
    got = set().union(*(matrix._pairs(dict(c.values)) for c in CASES if c.verdict == "run"))
    assert want == got
    assert {c.verdict for c in CASES if c.verdict != "run"} == {f"refused:{name}" for name, _, _ in matrix.REFUSALS}
    assert [c.name for c in matrix.cases()] == [c.name for c in CASES]  # a seed, not a draw
    assert len({c.name for c in CASES}) == len(CASES)
    assert json.dumps([c.name for c in matrix.cases(1)]) != json.dumps([c.name for c in CASES])
