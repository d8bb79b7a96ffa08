"""train.grpo's loss family as TRL 1.16 defines it (objectives/grpo.py, docs/rl.md): each loss x
importance-sampling level x reward scaling against TRL's own GRPOTrainer._compute_loss on one fixed
batch, several variants halted inside a rollout's updates on 2 processes and resumed on 3 equal to
the 1-process run, bad combinations named."""
from __future__ import annotations

import itertools
import types

import pytest
import torch

import launch
from test_grpo import REWARDS, base, task  # noqa: F401  (task: the prompts and rewards fixture)

B, T, G, MAX_NEW = 6, 7, 3, 7


def trl_loss(loss_type: str, level: str, logp, old, ref, adv, mask, beta: float, eps: float, eps_high: float):
    """TRL 1.16's GRPOTrainer._compute_loss itself, on a stand-in trainer whose model forward returns
    `logp` (one process, one accumulation step, the whole batch as its micro-batch)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Accelerator:
        num_processes = 1

        def gather(self, x):
            return x

        def reduce(self, x, reduction="sum"):
            return x

    args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                                 steps_per_generation=1)
    stub = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta, args=args,
        loss_type=loss_type, epsilon_low=eps, epsilon_high=eps_high, use_vllm=False, vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=Accelerator(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, max_completion_length=MAX_NEW,
        _metrics={"train": __import__("collections").defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(), "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(stub, None, inputs)


def trl_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """TRL 1.16's advantage arithmetic (_generate_and_score_completions, sum_then_normalize), its own nanstd."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0) if scale != "batch" else nanstd(rewards).expand_as(rewards)
    a = rewards - mean
    return a / (std + 1e-4) if scale != "none" else a


TRL_CASES = [(loss, level, scale) for loss, level, scale in itertools.product(
    ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo"), ("token", "sequence"), ("group", "batch", "none"))
    if level == "token" or loss in ("grpo", "sapo")]  # sequence level with a token-summing loss: refused here (TRL warns)


@pytest.mark.unit
@pytest.mark.parametrize("loss, level, scale", TRL_CASES)
def test_each_loss_equals_trls_compute_loss_on_a_fixed_batch(loss, level, scale):
    """Ours: the whole batch as M = 2 micro-batches of 3 completions, their shares summed (the
    reducers' average times M): TRL's loss of the batch as one micro-batch, and its gradient."""
    from objectives.grpo import GRPOConfig, advantages, per_token_loss, reduce_loss

    g = torch.Generator().manual_seed(1)
    logp0 = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp0 + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.2  # ratios from e^-0.6 to e^0.6: clips reached
    ref = logp0 + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.25, 0.9], dtype=torch.float64)
    cfg = GRPOConfig(loss=loss, importance_sampling=level, scale_rewards=scale, std="sample", beta=0.04, eps=0.2,
                     eps_high=1.3 if loss == "cispo" else 5.0, normalize="tokens" if loss == "cispo" else "", generations=G)
    adv = advantages(rewards, G, scale, True, rewards)
    want_adv = trl_advantages(rewards, scale)
    # Tolerances, 10x the measured (float64): TRL's nanstd multiplies by count / (count - 1) computed in float32
    # (6 / 5 = 1.2000000477): under scale_rewards=batch the advantages differ by 2.5e-8, the loss by 4.0e-9,
    # the gradient by 2.5e-9; otherwise equal advantages and gradients, losses <= 5.6e-17 apart.
    tol_adv, tol_loss, tol_grad = (2.5e-7, 4e-8, 2.5e-8) if scale == "batch" else (0.0, 6e-16, 1e-16)
    assert (adv - want_adv).abs().max() <= tol_adv

    logp_trl = logp0.clone().requires_grad_()
    want = trl_loss(loss, level, logp_trl, old, ref, want_adv, mask, 0.04, 0.2, cfg.eps_high if loss == "cispo" else 0.2)
    want.backward()
    logp = logp0.clone().requires_grad_()
    m = mask.double()
    denominator = {"tokens": float(mask.sum()), "max_tokens": float(B * MAX_NEW), "sequence": float(B)}[cfg.norm]
    got = sum(reduce_loss(*[x for x in per_token_loss(logp[h], old[h], ref[h], adv[h], cfg, mask[h])][:1], m[h], cfg.norm, 2, B, denominator)
              for h in (slice(0, 3), slice(3, 6))) / 2
    got.backward()
    ratio = torch.exp(logp0 - old)[mask]
    assert (ratio > 1.3).any() and (ratio < 0.8).any()  # both clips (and CISPO's cap) reached
    assert (logp_trl.grad != 0).sum() == mask.sum() and (want - got).abs() <= tol_loss, (want, got)
    assert (logp.grad - logp_trl.grad).abs().max() <= tol_grad, (logp.grad - logp_trl.grad).abs().max()



VARIANTS = {
    "dapo-batch-truncated": ["train.grpo.loss=dapo", "train.grpo.scale_rewards=batch", "train.grpo.std=sample",
                             "train.grpo.mask_truncated=true"],
    "gspo-sapo-unscaled": ["train.grpo.loss=sapo", "train.grpo.importance_sampling=sequence", "train.grpo.scale_rewards=none"],
    "dr_grpo-sample-std": ["train.grpo.loss=dr_grpo", "train.grpo.std=sample"],
    "bnpo-unscaled": ["train.grpo.loss=bnpo", "train.grpo.scale_rewards=none"],
    "trl-cispo": ["train.grpo.loss=cispo", "train.grpo.normalize=tokens", "train.grpo.eps_high=1.1"],
}


@pytest.mark.e2e
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variant_halted_inside_a_rollouts_updates_on_2_resumed_on_3_equals_the_1_process_run(variant, task, tmp_path):
    """Global-batch normalizations (the tokens of every rank's rollout, the batch's reward std) and
    sequence-level ratios: halted after step 3 (inside the second rollout's updates) on 2 processes,
    resumed on 3 to step 5, then on 1: the 1-process run's weights and every logged figure."""
    extra = VARIANTS[variant]
    one = tmp_path / "one"
    assert launch.in_process(*base(task, tmp_path / "cache"), *extra, f"out_dir={one}")[0] == 0
    args = [*base(task, tmp_path / "cache"), *extra, f"out_dir={tmp_path / 'moved'}"]
    launch.run(2, *args, "train.halt_at=3")
    launch.run(3, *args, "train.halt_at=5")
    assert launch.in_process(*args)[0] == 0
    launch.assert_identical(tmp_path / "moved", one)
    got, want = launch.metrics(tmp_path / "moved"), launch.metrics(one)
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for key in (*REWARDS, "loss"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert len({r["loss"] for r in want}) > 1 and any(r["zero_advantage_groups"] < 1 for r in want)  # it learns something
    if "mask_truncated" in " ".join(extra):  # some completions end with an EOS, the truncated ones are masked out
        lengths = [r["completion_length"] for r in want]
        assert 0 < max(lengths) < 6 and min(lengths) == 0, lengths


@pytest.mark.unit
def test_batch_scaled_advantages_and_the_token_denominator_are_the_global_batchs():
    """A rank's micro-batches (here 1 of 0, 1) take the std of every rank's rewards and the count of
    every rank's completion tokens (GRPO._globals on the gathered rollout)."""
    from objectives.grpo import GRPO, GRPOConfig, advantages

    g = GRPO.__new__(GRPO)
    g.cfg, g.global_completions = GRPOConfig(loss="dapo", scale_rewards="batch", generations=2), 4
    r0, r1 = torch.tensor([0.0, 1.0]), torch.tensor([0.25, 0.5])
    m0, m1 = torch.tensor([[True, True], [True, False]]), torch.tensor([[False, False], [True, True]])
    g.buffer = {1: {"rewards": r1, "mask": m1, "advantages": advantages(r1, 2, "batch", False, r1)}}
    g._globals({0: {"rewards": r0, "mask": m0}, 1: {"rewards": r1, "mask": m1}})
    assert g.denominator == 5.0
    want = (r1 - r1.mean()) / (torch.cat([r0, r1]).std(unbiased=False) + 1e-4)
    assert torch.equal(g.buffer[1]["advantages"], want) and not torch.equal(want, advantages(r1, 2, "batch", False, r1))


@pytest.mark.e2e
def test_an_unknown_loss_or_a_sequence_level_token_sum_exits_2_naming_the_key(task, tmp_path):
    cases = [(["train.grpo.loss=ppo"], "train.grpo.loss: expected one of cispo, grpo, dr_grpo, dapo, bnpo, sapo, got 'ppo'"),
             (["train.grpo.loss=dapo", "train.grpo.importance_sampling=sequence"], "train.grpo.importance_sampling=sequence: loss=dapo"),
             (["train.grpo.loss=grpo", "train.grpo.normalize=tokens", "train.grpo.importance_sampling=sequence"],
              "train.grpo.importance_sampling=sequence: loss=grpo (normalize=tokens)"),
             (["train.grpo.scale_rewards=global"], "train.grpo.scale_rewards: expected one of 'group', 'batch', 'none', got 'global'")]
    for extra, expected in cases:
        code, err = launch.in_process(*base(task, tmp_path / "cache"), *extra, f"out_dir={tmp_path / 'b'}")
        assert code == 2 and expected in err and "Traceback" not in err, (extra, err)
