"""train.objective=grpo over data.format=prompts (data/prompts.py, objectives/grpo.py,
objectives/rewards.py, docs/rl.md): rollouts that do not depend on who makes them, the losses as
written, a run halted inside a rollout's updates and resumed on other world sizes equal to the
uninterrupted one, bad input named."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import launch

# A reward with a spread on any model, so that a group's advantages are not all zero: the share of
# vowels among the completion's letters (a pure function of the text).
REWARD = '''
def vowels(prompt, completion, **fields):
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def raises(prompt, completion, **fields):
    raise KeyError("no such thing")


def nan(prompt, completion, **fields):
    return float("nan")


import os
import time
from pathlib import Path


def sleeps_on_rank_0(prompt, completion, **fields):
    """Never returns in time on rank 0; the other ranks score at once and wait for it."""
    if os.environ.get("RANK", "0") == "0":
        time.sleep(3600)
    return 0.0


def slow_on_rank_0(prompt, completion, **fields):
    """vowels, 1.5 s a call on rank 0: its rollout takes longer than dist.timeout_s, its peers wait for it."""
    if os.environ.get("RANK", "0") == "0":
        time.sleep(1.5)
    return vowels(prompt, completion, **fields)


def draws(prompt, completion, **fields):
    import random

    return random.random()


CALLS = [0]


def vowels_then_waits(prompt, completion, **fields):
    """vowels; under WAITING_DIR, from the 8th call in a process (on 2 ranks: the second rollout) it
    says so with a file and waits for a signal."""
    CALLS[0] += 1
    if CALLS[0] >= 8 and os.environ.get("WAITING_DIR"):
        Path(os.environ["WAITING_DIR"], os.environ.get("RANK", "0")).touch()
        time.sleep(3600)
    return vowels(prompt, completion, **fields)
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("grpo")
    prompts = root / "prompts.jsonl"
    lines = [{"prompt": f"Say {w}.", "answer": w} for w in "red blue green cat dog sun moon tree river stone bird fish".split()]
    lines += [{"conversations": [{"role": "user", "content": f"Tell me about {w}."}, {"role": "assistant", "content": ""}]}
              for w in "oak pine elm ash".split()]  # MiniMind's rlaif.jsonl form
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines * 3))
    (root / "rewards.py").write_text(REWARD)
    return prompts, root / "rewards.py"


def base(task, cache: Path, reward: str = "vowels") -> list[str]:
    prompts, module = task
    # 6 prompts a step (12 completions), one prompt a micro-batch: M = 6 splits over 1, 2 and 3 processes
    return [f"data.path={prompts}", "data.format=prompts", "train.objective=grpo", f"data.cache_dir={cache}",
            "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=48",
            "train.global_batch=12", "train.micro_batch=2", "train.steps=6", "train.warmup_steps=1", "train.lr=3e-3",
            "train.grpo.generations=2", "train.grpo.max_new_tokens=6", "train.grpo.updates_per_rollout=2",
            f"train.grpo.reward={module}:{reward}", "train.grpo.loss=grpo", "dist.reduce=canonical", "checkpoint.interval=0",
            "checkpoint.keep=10", "log.progress=false", "runtime.threads=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, task):
    root = tmp_path_factory.mktemp("grpo-runs")
    code, err = launch.in_process(*base(task, root / "cache"), f"out_dir={root / 'one'}")
    assert code == 0, err
    return root


REWARDS = ("reward/mean", "reward/std", "kl", "completion_length", "clip_fraction", "zero_advantage_groups")


@pytest.mark.e2e
def test_halted_inside_a_rollouts_updates_on_2_resumed_on_3_then_on_1_equals_the_uninterrupted_run(uninterrupted, task, tmp_path):
    """Rollouts at steps 1, 3, 5 (two updates each): halted after step 3 (the rollout of step 3 is
    under update: its buffer is in the checkpoint) on 2 processes, resumed on 3 to step 5, then on 1."""
    args = [*base(task, tmp_path / "cache"), f"out_dir={tmp_path / 'moved'}"]
    launch.run(2, *args, "train.halt_at=3")
    launch.run(3, *args, "train.halt_at=5")
    assert launch.in_process(*args)[0] == 0
    launch.assert_identical(tmp_path / "moved", uninterrupted / "one")
    got, want = launch.metrics(tmp_path / "moved"), launch.metrics(uninterrupted / "one")
    for key in REWARDS:
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert len({r["reward/mean"] for r in want}) > 1 and any(r["zero_advantage_groups"] < 1 for r in want)  # it learns something
    assert [r["reward/mean"] for r in want][0::2] == [r["reward/mean"] for r in want][1::2]  # two updates, one rollout
    manifest = launch.storage_manifest(uninterrupted / "one", 6)
    assert manifest["reference"]["sha256"] and len(manifest["reward"]["sha256"]) == 64


@pytest.mark.unit
def test_a_groups_completions_are_the_same_alone_or_after_other_groups_and_a_seed_draws_them():
    from common.seeds import derive_seed
    from model import MiniMindLM, ModelConfig
    from model.generate import generate_group
    from objectives.grpo import STREAM

    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32)).eval()

    def group(step: int, index: int, prompt: list[int]):
        gens = [torch.Generator().manual_seed(derive_seed(1337, STREAM, step, index, r)) for r in range(3)]
        return generate_group(model, prompt, gens, 8, temperature=1.0)

    alone = group(4, 17, [1, 5, 6, 7])
    group(4, 3, [1, 9, 9])  # another rank's, or another prompt first
    assert torch.equal(group(4, 17, [1, 5, 6, 7]), alone)
    assert not torch.equal(group(5, 17, [1, 5, 6, 7]), alone)  # the next rollout draws others
    assert len({tuple(r) for r in alone.tolist()}) > 1  # the group's completions differ from each other


@pytest.mark.unit
def test_advantages_are_the_group_normalized_rewards_and_zero_for_a_group_of_equal_rewards():
    from objectives.grpo import advantages

    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    a = advantages(r, 3)
    assert torch.equal(a[:3], torch.zeros(3))
    g = r[3:]
    assert torch.equal(a[3:], (g - g.mean()) / (g.std(unbiased=False) + 1e-4))


@pytest.mark.unit
@pytest.mark.parametrize("loss", ["cispo", "grpo"])
def test_the_cispo_and_grpo_losses_are_the_formulas_on_a_fixed_batch(loss):
    from objectives.grpo import GRPOConfig, per_token_loss

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=g) * 3
    old = logp + (torch.rand(4, 5, generator=g) - 0.5) * 4  # ratios from e^-2 to e^2: both clips reached
    ref = logp + (torch.rand(4, 5, generator=g) - 0.5)
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0])
    cfg = GRPOConfig(loss=loss, beta=0.1, eps=0.2, eps_high=2.0)
    got, _ = per_token_loss(logp, old, ref, adv, cfg)
    ratio, a = torch.exp(logp - old), adv[:, None]
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    if loss == "cispo":
        want = -(torch.clamp(ratio, max=2.0).detach() * a * logp - 0.1 * kl)
    else:
        want = -(torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a) - 0.1 * kl)
    assert (ratio > 2.0).any() and (ratio < 0.8).any()
    assert torch.equal(got, want)


@pytest.mark.e2e
@pytest.mark.parametrize("bad, expected", [
    ("raises", "train.grpo.reward raised on prompt"),
    ("nan", "train.grpo.reward returned nan for prompt"),
])
def test_a_reward_that_raises_or_returns_nan_fails_the_run_naming_the_prompt_with_nothing_saved_past_the_checkpoint(
        task, tmp_path, bad, expected):
    out = tmp_path / "run"
    args = [*base(task, tmp_path / "cache", bad), f"out_dir={out}"]
    code, err = launch.in_process(*args)
    assert code == 1 and expected in err and "prompts.jsonl:" in err and "Traceback" not in err, err
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


@pytest.mark.e2e
def test_bad_prompts_and_bad_grpo_keys_exit_2_naming_them(task, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"conversations": [{"role": "system", "content": "x"}]}) + "\n")
    code, err = launch.in_process(*base((bad, task[1]), tmp_path / "cache"), f"out_dir={tmp_path / 'a'}")
    assert code == 2 and f"{bad}:2: the prompt has no user turn" in err, err
    cases = [(["train.grpo.generations=1", "train.global_batch=6", "train.micro_batch=1"], "train.grpo.generations must be >= 2"),
             ([f"train.grpo.reward={tmp_path / 'missing.py'}:f"], "missing.py does not exist"),
             (["train.grpo.reward=no_such_module_here:f"], "train.grpo.reward: no_such_module_here does not import"),
             (["train.micro_batch=3"], "must be multiples of train.grpo.generations=2")]
    for extra, expected in cases:
        code, err = launch.in_process(*base(task, tmp_path / "cache"), *extra, f"out_dir={tmp_path / 'b'}")
        assert code == 2 and expected in err and "Traceback" not in err, (extra, err)


@pytest.mark.e2e
def test_a_changed_reward_file_is_refused_on_resume_naming_both_hashes(task, tmp_path):
    import shutil

    module = tmp_path / "rewards.py"
    shutil.copy(task[1], module)
    args = [*base((task[0], module), tmp_path / "cache"), f"out_dir={tmp_path / 'run'}"]
    assert launch.in_process(*args, "train.halt_at=2")[0] == 0
    module.write_text(module.read_text().replace("aeiou", "aeiouy"))
    code, err = launch.in_process(*args)
    assert code == 2 and "train.grpo.reward:" in err and "were scored by one of sha256" in err and "Traceback" not in err, err


@pytest.mark.e2e
def test_a_run_in_the_same_interpreter_pins_only_its_own_code_not_an_ended_runs(task, tmp_path):
    """A run's pinned user code ends with it (objectives/worker.py Worker.close): a first run's reward file
    edited after it ended does not fail a later run in the same process when that run's worker restarts
    after a kill (seen in CI: one test's edited file failed every later reward test of its pytest worker)."""
    import shutil

    from objectives.rewards import load, score
    from objectives.worker import WORKER

    first = tmp_path / "first.py"
    shutil.copy(task[1], first)
    assert launch.in_process(*base((task[0], first), tmp_path / "cache"), f"out_dir={tmp_path / 'run'}", "train.halt_at=1")[0] == 0
    first.write_text(first.read_text().replace("aeiou", "aeiouy"))
    reward, _ = load(f"{task[1]}:vowels")
    WORKER.kill()  # as a reward's timeout does: the next call starts the process again, importing what is pinned
    assert score(reward, "p", "a cat", {}, 0, "x", timeout_s=60) == score(reward, "p", "a cat", {}, 0, "x", timeout_s=60)
    WORKER.close()


def last_line(stderr: str, rank: int) -> str:
    """The line a rank ends with ("...; exit N"; rank 0's carry no rank prefix)."""
    import re

    mine = [l for l in stderr.splitlines() if re.search(r"; exit \d+", l) and (f"[rank {rank}]" in l if rank else "[rank " not in l)]
    assert mine, stderr[-3000:]
    return mine[-1]


@pytest.mark.e2e
def test_a_reward_that_never_returns_on_rank_0_fails_both_ranks_naming_the_prompt_within_its_timeout(task, tmp_path):
    out = tmp_path / "run"
    proc = launch.run(2, *base(task, tmp_path / "cache", "sleeps_on_rank_0"), "train.grpo.reward_timeout_s=2", f"out_dir={out}",
                      expect=None, timeout=180)
    mine, theirs = last_line(proc.stderr, 0), last_line(proc.stderr, 1)
    assert "train.grpo.reward did not return within train.grpo.reward_timeout_s=2 s on prompt" in mine, mine
    assert "prompts.jsonl:" in mine and mine.endswith("exit 1"), mine
    assert "rank 0 failed during the rollout: train.grpo.reward did not return within" in theirs and theirs.endswith("exit 1"), theirs
    assert json.loads((out / "status.json").read_text())["exit_code"] == 1
    assert "Traceback" not in proc.stderr.split('Traceback (most recent call last):\n  File "<frozen runpy>')[0]  # torchrun's own, after


SLOW_REWARDS = '''
import time


def careless(prompt, completion, **fields):  # 5 s, catching what it can
    try:
        time.sleep(5)
    except Exception:  # noqa: BLE001
        pass
    return 1.0


def stubborn(prompt, completion, **fields):  # 2 s, swallowing everything
    for _ in range(20):
        try:
            time.sleep(0.1)
        except BaseException:  # noqa: BLE001
            pass
    return 1.0


def in_c(prompt, completion, **fields):  # minutes inside one call into C: no signal handler runs until it returns
    return float(sum(range(10 ** 12)))


def half(prompt, completion, **fields):
    return 0.5
'''


@pytest.mark.e2e  # a user's reward runs in the worker process (objectives/worker.py)
def test_a_reward_call_is_killed_at_its_timeout_even_inside_c_or_catching_every_exception_and_the_next_call_answers(tmp_path):
    from common.outcome import Failed
    from objectives.rewards import load, score
    from objectives.worker import WORKER

    (tmp_path / "slow.py").write_text(SLOW_REWARDS)
    for name in ("careless", "stubborn", "in_c"):
        reward, _ = load(f"{tmp_path / 'slow.py'}:{name}")
        with pytest.raises(Failed, match=r"did not return within train.grpo.reward_timeout_s=0.2 s on prompt 7 \(p.jsonl:8\)"):
            score(reward, "p", "c", {"prompt": "p", "line": "p.jsonl:8"}, 7, "p.jsonl:8", timeout_s=0.2)
        assert WORKER.proc is None  # killed, not left running
    assert score(load(f"{tmp_path / 'slow.py'}:half")[0], "p", "c", {}, 0, "x", timeout_s=5) == 0.5  # a new process answers


@pytest.mark.e2e
def test_a_rollout_on_one_rank_longer_than_dist_timeout_s_is_waited_for_and_gives_the_uninterrupted_figures(
        uninterrupted, task, tmp_path):
    """Rank 0's rollout takes about 10 s (7 reward calls of 1.5 s) with dist.timeout_s=6: rank 1 waits
    on rank 0's heartbeat, not in a collective that times out."""
    out = tmp_path / "run"
    launch.run(2, *base(task, tmp_path / "cache", "slow_on_rank_0"), "dist.timeout_s=6", "checkpoint.lock_timeout_s=3",
               "train.halt_at=2", f"out_dir={out}", timeout=240)
    got, want = launch.metrics(out), launch.metrics(uninterrupted / "one")[:2]
    for key in ("loss", *REWARDS):
        assert [r[key] for r in got] == [r[key] for r in want], key


@pytest.mark.e2e  # a user's reward runs in the worker process (objectives/worker.py)
def test_a_reward_that_draws_from_random_is_refused_naming_it(task, tmp_path):
    code, err = launch.in_process(*base(task, tmp_path / "cache", "draws"), f"out_dir={tmp_path / 'run'}")
    assert code == 2 and ":draws gave " in err and "for the same completion of prompt" in err and "a pure function" in err, err
    assert "Traceback" not in err


@pytest.mark.e2e
def test_sigterm_while_a_reward_waits_stops_both_ranks_with_75_and_the_resume_equals_the_uninterrupted_run(
        uninterrupted, task, tmp_path):
    """The reward of the second rollout (step 3) waits on both ranks; SIGTERM to the launch: the rollout
    is abandoned on every rank, step 2 is saved, exit 75; resumed on one process, the uninterrupted run."""
    import signal

    from checkpoint.storage import list_checkpoints

    out, waiting = tmp_path / "run", tmp_path / "waiting"
    waiting.mkdir()
    args = [*base(task, tmp_path / "cache", "vowels_then_waits"), "train.grpo.reward_timeout_s=600", f"out_dir={out}"]
    proc = launch.start(launch.command(2, *args), tmp_path / "log", env={"WAITING_DIR": str(waiting)})
    launch.wait_for(lambda: len(list(waiting.iterdir())) == 2, timeout=240, proc=proc)
    launch.kill_tree(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    log = (tmp_path / "log").read_text()
    assert log.count("stopped on SIGTERM at step 2: checkpoint published") == 2, log[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["exit_code"] == 75 and status["step"] == 2, status
    assert list_checkpoints(out / "checkpoints")[0][0] == 2 and launch.lines(out / "metrics.jsonl") == 2
    assert launch.in_process(*args)[0] == 0
    launch.assert_identical(out, uninterrupted / "one")
    got, want = launch.metrics(out), launch.metrics(uninterrupted / "one")
    for key in REWARDS:
        assert [r[key] for r in got] == [r[key] for r in want], key


@pytest.mark.unit
def test_top_p_keeps_tied_ids_in_id_order_whatever_the_vocabulary_size():
    """Ties at the nucleus's edge are broken by token id (a stable sort), the same on any device: 12
    tied ids of equal mass, top_p = 0.3 keeps the first 4 of them, the lowest ids."""
    from model.generate import sample

    logits = torch.full((259,), -30.0)
    tied = torch.arange(3, 259, 21)[:12]  # spread over the vocabulary
    logits[tied] = 5.0
    drawn = {sample(logits, [], 1.0, 0, 0.3, 1.0, torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == set(tied[:4].tolist()), sorted(drawn)
