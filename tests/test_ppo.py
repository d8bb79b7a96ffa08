"""PPO's terms (objectives/ppo.py, model/critic.py) against MiniMind's own trainer/train_ppo.py: its GAE,
whitening, policy, KL, value and approximate-KL arithmetic, cut from a scratch copy of the file and run
on the same tensors; the critic's values from the policy's weights; bad keys named."""
from __future__ import annotations

import re
import shutil
import textwrap
import types
from pathlib import Path

import pytest
import torch

from conftest import MINIMIND_SHARED, needs_referee
from test_grpo import task  # noqa: F401  (the prompts and rewards fixture)

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = MINIMIND_SHARED / "upstream" / "trainer" / "train_ppo.py"
needs_upstream = needs_referee(UPSTREAM, "MiniMind's train_ppo.py")


def cut(source: str, first: str, last: str) -> str:
    """The lines of `source` from the one starting with `first` through the one starting with `last`, dedented."""
    lines = source.splitlines()
    i = next(k for k, line in enumerate(lines) if line.strip().startswith(first))
    j = next(k for k in range(i, len(lines)) if lines[k].strip().startswith(last))
    while lines[j].count("(") + sum(l.count("(") for l in lines[i:j]) > sum(l.count(")") for l in lines[i:j + 1]):
        j += 1  # the statement's continuation lines
    return textwrap.dedent("\n".join(lines[i:j + 1]))


@needs_upstream
@pytest.mark.unit
def test_gae_whitening_policy_kl_value_and_approx_kl_equal_minimind_train_ppo_on_one_batch(tmp_path):
    from objectives.ppo import PPOConfig, gae, policy_terms, token_rewards, value_loss, whiten

    scratch = tmp_path / "minimind"
    scratch.mkdir()
    source = shutil.copy(UPSTREAM, scratch / "train_ppo.py")
    text = Path(source).read_text()
    g = torch.Generator().manual_seed(3)
    B, R = 5, 6
    lengths = torch.tensor([6, 2, 4, 1, 5])
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    rewards = torch.tensor([1.0, -0.5, 0.25, 2.0, 0.0])
    values = torch.randn(B, R, generator=g) * mask
    old = -torch.rand(B, R, generator=g) * 3
    logp = (old + (torch.rand(B, R, generator=g) - 0.5) * 0.8).requires_grad_()  # ratios e^-0.4..e^0.4: the clip reached
    ref = old + (torch.rand(B, R, generator=g) - 0.5)
    new_values = (values + (torch.rand(B, R, generator=g) - 0.5)).requires_grad_()  # beyond cliprange_value for some
    cfg = PPOConfig(gamma=0.9, lam=0.8)
    args = types.SimpleNamespace(device="cpu", gamma=cfg.gamma, lam=cfg.lam, clip_epsilon=cfg.clip, kl_coef=cfg.kl_coef,
                                 cliprange_value=cfg.cliprange_value)
    # MiniMind's rollout-side code: the reward at the last token, GAE, returns, whitening
    ns = {"torch": torch, "args": args, "B": B, "old_resp_logp": old, "resp_lengths": lengths, "valid_resp": lengths > 0,
          "rewards": rewards, "old_resp_values": values, "resp_policy_mask": mask}
    exec(cut(text, "token_rewards = torch.zeros_like(old_resp_logp)", "advantages = (advantages - adv_mean)"), ns)
    want_tr = token_rewards(rewards, lengths, R)
    adv, returns = gae(values, want_tr, cfg.gamma, cfg.lam)
    assert torch.equal(want_tr, ns["token_rewards"]) and torch.equal(returns, ns["returns"])
    advw = whiten(adv, mask)
    assert torch.equal(advw, ns["advantages"])
    # MiniMind's update-side code, the whole batch as one mini-batch (inds: all of it)
    inds = torch.arange(B)
    ns.update({"mb_resp_logp": logp, "log_ratio": logp - old, "inds": inds, "ref_resp_logp": ref, "mb_resp_values": new_values,
               "returns": returns, "resp_value_mask": mask, "advantages": advw})
    exec(cut(text, "approx_kl = (0.5 * (log_ratio ** 2)", "approx_kl = (0.5 * (log_ratio ** 2)"), ns)
    exec(cut(text, "ratio = torch.exp(log_ratio)", "value_loss = 0.5 * (torch.max("), ns)
    got = policy_terms(logp, old, ref, advw, mask, cfg, float(mask.sum()))
    vl = value_loss(new_values, values, returns, mask, cfg.cliprange_value, float(mask.sum()))
    for ours, theirs in ((got["policy"], "policy_loss"), (got["kl_ref"], "kl_ref_penalty"), (got["approx_kl"], "approx_kl"),
                         (got["clipfrac"], "clipfrac"), (vl, "value_loss")):
        assert torch.equal(ours, ns[theirs]), (theirs, ours, ns[theirs])
    assert 0 < float(got["clipfrac"]) < 1
    clipped_v = (new_values - values).abs() > cfg.cliprange_value
    assert (clipped_v & mask.bool()).any() and (~clipped_v & mask.bool()).any()
    # the gradients, too: MiniMind's loss and ours, the same bits
    theirs = torch.autograd.grad(ns["policy_loss"] + 0.5 * ns["value_loss"], (logp, new_values))
    ours = torch.autograd.grad(got["policy"] + 0.5 * vl, (logp, new_values))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.unit
def test_a_micro_batchs_share_divided_by_the_global_count_sums_to_the_batchs_terms():
    """Split into micro-batches, each dividing by the global batch's token count: the sum is the
    batch's, whatever the split (to the float addition's last bit: measured 0 or 1 ulp)."""
    from objectives.ppo import PPOConfig, policy_terms, value_loss

    g = torch.Generator().manual_seed(4)
    B, R = 6, 5
    mask = (torch.arange(R)[None] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]).double()
    logp, old, ref, adv = (torch.randn(B, R, generator=g, dtype=torch.float64) for _ in range(4))
    cfg, n = PPOConfig(), float(mask.sum())
    whole = policy_terms(logp, old, ref, adv, mask, cfg, n)["policy"] + value_loss(adv, old, ref, mask, 0.2, n)
    for parts in ((slice(0, 2), slice(2, 6)), (slice(0, 3), slice(3, 6)), (slice(0, 1), slice(1, 4), slice(4, 6))):
        split = sum(policy_terms(logp[p], old[p], ref[p], adv[p], mask[p], cfg, n)["policy"] + value_loss(adv[p], old[p], ref[p], mask[p], 0.2, n)
                    for p in parts)
        assert abs(float(split - whole)) <= 1e-15  # measured: <= 2.2e-16 (float64)


@pytest.mark.unit
def test_a_critic_from_the_policy_carries_its_weights_and_gives_one_value_per_position():
    from model import MiniMindLM, ModelConfig
    from model.critic import Critic

    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64)
    policy = MiniMindLM(cfg).eval()
    critic = Critic.from_policy(policy).eval()
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), critic.body.state_dict().values()))
    tokens = torch.randint(0, 64, (3, 9))
    values = critic(tokens)
    hidden = {}
    policy.norm.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    policy(tokens)
    assert values.shape == (3, 9) and torch.equal(values, critic.value_head(hidden["h"]).squeeze(-1))


@pytest.mark.unit
@pytest.mark.parametrize("key, value", [("gamma", 1.5), ("lam", -0.1)])
def test_gamma_or_lam_outside_0_1_is_named(key, value):
    from objectives.ppo import PPOConfig

    with pytest.raises(ValueError, match=rf"train\.ppo\.{key} must be in \[0, 1\], got {value}"):
        PPOConfig(**{key: value})


def ppo_args(task, cache: Path, out: Path) -> list[str]:
    from test_grpo import base

    args = [a for a in base(task, cache) if not a.startswith(("train.objective=", "train.grpo.updates_per_rollout=", "train.grpo.loss="))]
    # 6 prompts x 2 completions a step, one prompt a micro-batch; two updates a rollout; an early stop low
    # enough to be reached: rollouts at steps 1, 3, 5
    return [*args, "train.objective=ppo", "train.ppo.updates_per_rollout=2", "train.ppo.critic_lr=3e-3", "train.ppo.early_stop_kl=0.008",
            f"out_dir={out}"]


def critic_sha(out: Path) -> str:
    """The sha256 of the newest checkpoint's critic tensors (its state under "critic"), name by name."""
    import hashlib

    from checkpoint import storage

    newest = sorted((p for p in (out / "checkpoints").iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)[-1]
    critic = storage.read_tensors(newest, storage.verify(newest), prefix="critic.")  # our reader: format 3's raw bytes, verified
    assert critic, f"no critic tensors in {newest}"
    h = hashlib.sha256()
    for k in sorted(critic):
        h.update(k.encode() + critic[k].float().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.e2e
def test_ppo_halted_inside_a_rollouts_updates_on_2_resumed_on_3_equals_the_1_process_run(task, tmp_path):
    """Rollouts at steps 1, 3, 5: halted after step 3 on 2 processes (inside the second rollout's updates:
    its buffer, values, returns and the early stop in the checkpoint), resumed on 3 to step 5, then on 1:
    the 1-process run's actor and critic, and every logged figure."""
    import launch

    assert launch.in_process(*ppo_args(task, tmp_path / "cache", tmp_path / "one"))[0] == 0
    args = ppo_args(task, tmp_path / "cache", tmp_path / "moved")
    launch.run(2, *args, "train.halt_at=3")
    launch.run(3, *args, "train.halt_at=5")
    assert launch.in_process(*args)[0] == 0
    launch.assert_identical(tmp_path / "moved", tmp_path / "one")
    got, want = launch.metrics(tmp_path / "moved"), launch.metrics(tmp_path / "one")
    keys = ("reward/mean", "completion_length", "policy_loss", "value_loss", "kl", "approx_kl", "clip_fraction", "early_stopped", "critic_lr")
    for key in keys:
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert critic_sha(tmp_path / "moved") == critic_sha(tmp_path / "one")
    assert len({r["value_loss"] for r in want}) > 1 and 0 < sum(r["early_stopped"] for r in want) < 3  # one rollout stopped early, not all


def state_sha(out: Path, step: int, prefix: str) -> str:
    """The sha256 of a checkpoint's tensors under `prefix` (the critic, the optimizers), name by name."""
    import hashlib

    from checkpoint import storage

    folder = out / "checkpoints" / storage.step_dir_name(step)
    tensors = storage.read_tensors(folder, storage.verify(folder), prefix=prefix)
    assert tensors, f"no {prefix} tensors in {folder}"
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode() + tensors[k].double().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.e2e
def test_after_the_early_stop_fires_the_rollouts_later_updates_step_no_optimizer_as_minimind_leaves_its_loop(task, tmp_path):
    """MiniMind's train_ppo.py: the update whose approximate KL passes early_stop_kl trains with `loss * 0.0` and its
    optimizers still step (momentum and weight decay move the weights); then `if stop_ppo: break` leaves the
    ppo_update_iters loop: no later update steps either optimizer. Three updates a rollout (rollouts at steps 1 and 4):
    a step after the one that stopped leaves the actor, the critic and both optimizers' states as they were."""
    import launch

    out = tmp_path / "run"
    args = [a for a in ppo_args(task, tmp_path / "cache", out) if not a.startswith(("train.ppo.updates_per_rollout=", "checkpoint."))]
    assert launch.in_process(*args, "train.ppo.updates_per_rollout=3", "checkpoint.interval=1", "checkpoint.keep=10")[0] == 0
    stopped = [r["early_stopped"] for r in launch.metrics(out)]
    states = {step: (launch.sha_at(out, step), *(state_sha(out, step, p) for p in ("critic.", "optimizer.", "critic_optimizer.")))
              for step in range(1, 7)}
    fired = [s for s in range(2, 7) if stopped[s - 1] and not stopped[s - 2] and s % 3 != 1]  # the KL passed at update 2 of a rollout
    assert fired, stopped
    for s in fired:
        assert all(a != b for a, b in zip(states[s], states[s - 1]))  # the stopping update: loss * 0, the optimizers stepped
        assert s % 3 == 2 and stopped[s] and states[s + 1] == states[s]  # update 3: no step at all
    kept = [s for s in range(2, 7) if not stopped[s - 1] or s in fired]
    assert kept and all(states[s][0] != states[s - 1][0] for s in kept)


@pytest.mark.e2e
def test_ppo_gamma_or_lam_outside_0_1_exits_2_naming_the_key(task, tmp_path):
    import launch

    for extra, expected in ((["train.ppo.gamma=1.5"], "train.ppo.gamma must be in [0, 1], got 1.5"),
                            (["train.ppo.lam=-0.5"], "train.ppo.lam must be in [0, 1], got -0.5"),
                            (["dist.strategy=fsdp"], "train.objective=ppo with dist.strategy=fsdp: not supported"),
                            (["train.lora.rank=4"], "train.objective=ppo with train.lora.rank: not supported")):
        code, err = launch.in_process(*ppo_args(task, tmp_path / "cache", tmp_path / "bad"), *extra)
        assert code == 2 and expected in err and "Traceback" not in err, (extra, err)


@pytest.mark.e2e
def test_a_critic_from_a_weights_source_starts_from_it_and_one_of_another_tokenizer_is_refused(task, tmp_path, corpus):
    """train.ppo.critic: a run folder of the same shape gives the critic its weights (not the policy's);
    one trained with another tokenizer is refused, exit 2 naming the key, nothing saved."""
    import launch
    from conftest import train_in_process

    args = ppo_args(task, tmp_path / "cache", tmp_path / "x")[:-1]
    src = tmp_path / "src"
    assert launch.in_process(*[a for a in args if not a.startswith("train.")], "train.global_batch=2", "train.micro_batch=1",
                             "train.objective=next_token", "data.format=text", f"data.path={corpus}", "train.steps=1",
                             f"out_dir={src}")[0] == 0
    out = tmp_path / "from-src"
    assert launch.in_process(*args, f"train.ppo.critic={src}", "train.steps=1", f"out_dir={out}")[0] == 0
    assert critic_sha(out) != critic_sha_after_one_step(task, tmp_path)
    assert train_in_process("--vocab-size", "259", "--out", str(tmp_path / "tok"), str(corpus)) == 0
    other = tmp_path / "other-tokenizer"
    code, err = launch.in_process(f"data.path={corpus}", f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}",
                                  f"data.cache_dir={tmp_path / 'c'}", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
                                  "model.n_kv_heads=2", "model.seq_len=48", "train.steps=1", "train.global_batch=2",
                                  "train.micro_batch=1", "log.progress=false", f"out_dir={other}")
    assert code == 0, err
    code, err = launch.in_process(*args, f"train.ppo.critic={other}", f"out_dir={tmp_path / 'b'}")
    assert code == 2 and f"train.ppo.critic: {other} was trained with another tokenizer" in err and "Traceback" not in err, err
    assert not (tmp_path / "b" / "checkpoints").exists()


def critic_sha_after_one_step(task, tmp_path) -> str:
    """The critic after one step from the policy's weights (train.ppo.critic unset)."""
    import launch

    out = tmp_path / "from-policy"
    assert launch.in_process(*ppo_args(task, tmp_path / "cache", out), "train.steps=1")[0] == 0
    return critic_sha(out)


@pytest.mark.e2e
@pytest.mark.parametrize("bad, expected", [("raises", "train.grpo.reward raised on prompt"), ("nan", "train.grpo.reward returned nan for prompt")])
def test_a_reward_that_raises_or_returns_nan_fails_a_ppo_run_naming_the_prompt_nothing_saved(task, tmp_path, bad, expected):
    import launch

    out = tmp_path / "run"
    args = [a if not a.startswith("train.grpo.reward=") else f"train.grpo.reward={task[1]}:{bad}" for a in ppo_args(task, tmp_path / "c", out)]
    code, err = launch.in_process(*args)
    assert code == 1 and expected in err and "prompts.jsonl:" in err and "Traceback" not in err, err
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
