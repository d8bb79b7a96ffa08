"""The docs test (docs/tests.md "The docs test"): every command in the bash blocks of README.md and
docs/*.md runs as written, in the docs' order, in one fresh copy of the repository, with a tiny
model and short runs through MINIMIND_OVERRIDES (the one place the docs mention it), and exits as
the docs say. A command that cannot run here is in NOT_RUN with the reason and the test that runs
it instead; a command the docs no longer show fails that table, so it stays current. The inputs the
docs assume on the reader's disk (a MiniMind tokenizer, their own corpora) are made beside the copy."""
from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import launch

DOCS = ["README.md", *sorted(str(p.relative_to(launch.ROOT)) for p in (launch.ROOT / "docs").glob("*.md"))]
"""README first (it makes runs/tiny and the stages the pages build on), then the pages by name."""

TINY = ("model.dim=32 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 train.steps=80 checkpoint.interval=20 "
        "log.every=20 log.progress=false")
"""MINIMIND_OVERRIDES for every command: the recipes' stages at a tiny size, long enough for the
README's halt at step 60."""

NOT_RUN = {
    "bash scripts/test.sh": "the suite itself (CI runs it through .ci/run)",
    "bash scripts/test.sh -m unit": "the suite itself",
    'bash scripts/test.sh -m "e2e and not elastic and not slurm"': "the suite itself",
    "bash scripts/test.sh -m elastic": "the suite itself",
    "bash scripts/test.sh -m slurm": "the suite itself",
    "bash scripts/mutants.sh": "every test again per mutant (an hour); tests/test_repository.py checks each mutant still fits the code",
    "bash scripts/preempt.sh --signal KILL --during-save": "tests/test_first_hour.py::test_preempt_sh_prints_pass_and_exits_0_in_both_documented_modes",
    "bash scripts/preempt.sh": "tests/test_first_hour.py::test_preempt_sh_prints_pass_and_exits_0_in_both_documented_modes",
    "bash scripts/preempt.sh --signal KILL --during-save --seed 1": "tests/test_first_hour.py (both modes, one kill each)",
    "sbatch scripts/slurm/train.sbatch out_dir=runs/job": "a Slurm cluster: tests/test_slurm.py submits it (the slurm tier, in CI)",
    "sbatch [sbatch options] scripts/slurm/train.sbatch [key=value ...]": "a template; tests/test_slurm.py submits it",
    "torchrun --nnodes=2 --nproc_per_node=1 --max-restarts=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=job train.py ...":
        "a template for two nodes; tests/test_preempt_e2e.py::test_a_node_that_dies_is_replaced_and_the_job_resumes_by_itself",
    ".venv/bin/python scripts/bench.py --json docs/bench.json": "the benchmark (30 min): docs/bench.json is its output",
    ".venv/bin/python scripts/bench.py --only peer": "MiniMind's own trainer, installed by the bench: docs/bench.json",
    ".venv/bin/python scripts/resume_lab.py": "tests/test_resume_lab.py runs the lab",
    **{command: "an S3 store: tests/test_object_storage_faults.py::test_the_spot_recipe_a_stopped_vms_replacement_runs_the_same_command_and_"
                "the_commands_read_the_store runs them against SeaweedFS" for command in (
        "bash scripts/train.sh out_dir=s3://my-bucket/runs/spot-1",
        ".venv/bin/python -m checkpoint status s3://my-bucket/runs/spot-1",
        ".venv/bin/python -m checkpoint inspect s3://my-bucket/runs/spot-1")},
    "bash scripts/train.sh out_dir=s3://my-bucket/runs/spot-1 data.path=s3://my-bucket/corpora/web data.cache_dir=s3://my-bucket/cache":
        "an S3 store: tests/test_object_storage_data.py::test_a_fresh_node_with_the_corpus_and_its_packed_cache_in_the_store_neither_"
        "reads_the_corpus_nor_packs_and_ends_on_the_same_bits runs it against SeaweedFS",
    **{command: "tests/test_agent.py::test_the_agent_recipes_run_the_tool_use_fine_tune_then_agent_rl_over_it_at_a_tiny_size runs "
                "both stages (an agent RL step generates episode by episode: 80 steps would be minutes here)" for command in (
        "bash scripts/train.sh --config configs/agent_sft_tiny.yaml", "bash scripts/train.sh --config configs/agent_tiny.yaml")},
    **{command: "a server and two groups at once: tests/test_ft.py::test_the_docs_two_group_recipe_runs_as_written_and_ends_on_the_one_"
                "process_bits runs these lines" for command in (
        ".venv/bin/python -m runtime.lighthouse --port 29510 &",
        ".venv/bin/python train.py dist.reduce=canonical ft.lighthouse=127.0.0.1:29510 ft.groups=2 ft.group=0 out_dir=runs/live &",
        ".venv/bin/python train.py dist.reduce=canonical ft.lighthouse=127.0.0.1:29510 ft.groups=2 ft.group=1 out_dir=runs/live")},
    "git clone https://github.com/jingyaogong/minimind": "the network: the copy's minimind/model/ is made from ../shared/minimind",
    ".venv/bin/tensorboard --logdir runs/watched/tensorboard": "a server; tests/test_watching.py reads the event files it shows",
    ".venv/bin/python -m checkpoint serve runs/sft_tiny": "a server: tests/test_serve.py::test_the_docs_commands_and_the_openai_client_"
                                                          "get_chats_greedy_reply_streamed_or_not_and_a_seeded_reply_twice runs "
                                                          "it with the curl commands below",
    **{command: "against the server above: tests/test_serve.py runs the docs' curl commands" for command in (
        "curl -s http://127.0.0.1:8000/v1/models",
        'curl -s http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" -d \'{"model": "sft_tiny", "messages": '
        '[{"role": "user", "content": "What does os.path.join do?"}], "temperature": 0, "max_tokens": 48}\'',
        'curl -sN http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" -d \'{"model": "sft_tiny", "messages": '
        '[{"role": "user", "content": "Hi"}], "max_tokens": 24, "seed": 7, "stream": true}\'')},
    **{command: "a server and the reader's task files: tests/test_serve.py::test_lm_evals_local_completions_through_the_server_"
                "scores_as_eval_does_item_by_item runs these" for command in (
        ".venv/bin/python -m checkpoint serve runs/sft_tiny --fp32 --port 8000 &",
        ".venv/bin/lm_eval --model local-completions --model_args model=sft_tiny,base_url=http://127.0.0.1:8000/v1/completions,"
        "tokenizer_backend=huggingface,tokenizer=runs/sft_tiny_hf,tokenized_requests=True,max_length=1024 --include_path tasks "
        "--tasks my_task,my_task_text,held_out --batch_size 1 --log_samples --output_path lm_eval_served")},
    **{command: "the reader's task files: tests/test_eval.py::test_the_docs_commands_run_and_lm_eval_on_the_hf_export_gives_the_"
                "same_scores_and_picks_item_by_item writes them and runs these" for command in (
        ".venv/bin/python -m checkpoint eval runs/sft_tiny --tasks my_task.jsonl text:my_task.jsonl --perplexity held_out.jsonl "
        "--out results.json",
        ".venv/bin/lm_eval --model hf --model_args pretrained=runs/sft_tiny_hf,dtype=float32 --include_path tasks --tasks "
        "my_task,my_task_text,held_out --device cpu --batch_size 1 --log_samples --output_path lm_eval_out")},
}

EXIT = {".venv/bin/python -m checkpoint compare runs/demo runs/demo_1": 0}
"""Exit codes the docs promise other than 0 (and 0 where it is the finding: identical)."""

STDIN = {".venv/bin/python -m checkpoint chat runs/sft_tiny": "What does len do?\n"}


def commands() -> list[tuple[str, str, str]]:
    """(page, the command as the docs write it, the block's shell assignments before it), in order."""
    out = []
    for page in DOCS:
        text = (launch.ROOT / page).read_text()
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
            assignments = []
            for line in block.splitlines():
                command = re.split(r"\s{2,}#", line, maxsplit=1)[0].strip()
                if not command or command.startswith("#"):
                    continue
                if re.match(r"^[A-Z_]+=\"[^\"]*\"$", command):
                    assignments.append(command)
                    continue
                out.append((page, command, "\n".join(assignments)))
    return out


def inputs(copy: Path) -> None:
    """What the docs assume the reader has: MiniMind's tokenizer beside the repository and in a clone
    of MiniMind inside it, and corpora of their own (pretraining text, chats, gzipped JSONL)."""
    shared = launch.ROOT.parent / "shared" / "minimind"
    for where in (copy.parent / "minimind" / "model", copy / "minimind" / "model"):
        where.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(shared / name, where / name)
    from data.prepare import build_stdlib_chat, build_stdlib_corpus

    docs = build_stdlib_corpus(copy.parent / "stdlib.jsonl").read_text().splitlines()[:3000]  # real prose: a BPE of 6,400 ids learns
    texts = [json.loads(line) for line in docs]
    for name in ("pretrain.jsonl", "pretrain_hq.jsonl"):
        (copy / name).write_text("".join(json.dumps(t) + "\n" for t in texts))
    chats = build_stdlib_chat(copy.parent / "stdlib-chat.jsonl").read_text().splitlines()[:400]
    (copy / "sft.jsonl").write_text("".join(line + "\n" for line in chats))
    (copy / "corpus").mkdir()
    with gzip.open(copy / "corpus" / "part1.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(t) + "\n" for t in texts)


def fresh_copy(where: Path) -> Path:
    """The repository's files as a clone would have them (tracked and new, nothing ignored), with the
    test's virtual environment as its .venv (the scripts would otherwise install one)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=launch.ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    copy = where / "repo"
    for name in filter(None, listed):
        src = launch.ROOT / name
        if src.is_file() and not src.is_symlink():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / name)
    (copy / ".venv").symlink_to(sys.prefix)
    return copy


@pytest.mark.unit
def test_every_command_the_docs_no_longer_show_is_out_of_the_not_run_table():
    shown = {command for _, command, _ in commands()}
    assert not set(NOT_RUN) - shown, set(NOT_RUN) - shown
    assert set(EXIT) <= shown and set(STDIN) <= shown


@pytest.mark.docs
@pytest.mark.e2e
def test_every_command_the_docs_show_runs_as_written_and_exits_as_they_say(tmp_path):
    copy = fresh_copy(tmp_path)
    inputs(copy)
    env = {**os.environ, "MINIMIND_OVERRIDES": TINY}
    ran = []
    for page, command, assignments in commands():
        if command in NOT_RUN:
            continue
        proc = subprocess.run(["bash", "-c", f"{assignments}\n{command}"], cwd=copy, capture_output=True, text=True,
                              input=STDIN.get(command, ""), timeout=900, env=env)
        want = EXIT.get(command, 0)
        assert proc.returncode == want, f"{page}: {command}\nexit {proc.returncode}, the docs say {want}\n" \
                                        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        ran.append(command)
    assert len(ran) >= 30, ran
