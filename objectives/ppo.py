"""PPO with a critic, as MiniMind's trainer/train_ppo.py (docs/rl.md), exact on any world size and across resumes.

The rollout is GRPO's (objectives/grpo.py: train.grpo's rollout keys, generations completions a
prompt, seeded per completion, scored by train.grpo.reward), then the critic's values at the
completion tokens' positions (model/critic.py, a value head on the policy's body, from the policy's
weights), the reward at each completion's last token, GAE (gamma, lam), the advantages whitened over
the global batch's completion tokens (gathered in micro-batch order). Each of `updates_per_rollout`
steps: the clipped policy loss plus kl_coef times the k3 KL to the reference for the policy, the
clipped value loss times vf_coef for the critic (its own AdamW and LR schedule, critic_lr, in the
checkpoint), each a sum over a micro-batch's completion tokens divided by the global batch's count
(MiniMind divides by each mini-batch's own). From a rollout's second update on, the approximate KL
0.5 * (logp - old)^2 of the policy as it stands, over the global batch (summed in micro-batch
order, a figure every world size computes alike), above early_stop_kl stops the rollout's updates
as MiniMind's stops its `ppo_update_iters` loop: that update trains with a zero loss (MiniMind's
`loss * 0.0`, the optimizers still step), and the rollout's later updates step no optimizer (MiniMind
breaks out of the loop; here the steps are the loop's, so each still runs and logs, `skip_update` set).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, replace

import torch

from checkpoint import ModelState, OptimizerState
from common.outcome import attempt
from common.seeds import derive_seed
from model.critic import Critic

from .grpo import GRPO, NO_FSDP, RL_PINS, RolloutState, completions_check, prompts_plan, token_logps
from .optim import lr_at, make_optimizer
from .spec import ALL, MatrixValue, ObjectiveSpec, register

CRITIC_STREAM = 0x50504F56  # "PPOV": the value head's init draws from derive_seed(seed, CRITIC_STREAM)


@dataclass
class PPOConfig:
    """train.ppo: MiniMind's names and defaults (train_ppo.py's arguments)."""

    critic: str = ""
    """The critic's body at the start: any model.init_from source of the run's shape and tokenizer ('': the policy's,
    as MiniMind), a value head added."""
    critic_lr: float = 5e-7
    """The critic's learning rate (MiniMind's critic_learning_rate)."""
    gamma: float = 1.0
    """GAE's discount, in [0, 1]."""
    lam: float = 0.95
    """GAE's lambda, in [0, 1]."""
    clip: float = 0.2
    """The policy ratio's clip range (MiniMind's clip_epsilon)."""
    cliprange_value: float = 0.2
    """The value's clip range around the rollout's values."""
    vf_coef: float = 0.5
    """The value loss's weight."""
    kl_coef: float = 0.02
    """The k3 KL to the reference's weight."""
    updates_per_rollout: int = 2
    """Optimizer passes over each rollout (MiniMind's ppo_update_iters)."""
    early_stop_kl: float = 0.25
    """A rollout's updates stop once the approximate KL to the rollout's policy passes it."""

    def __post_init__(self) -> None:
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"train.ppo.{key} must be in [0, 1], got {getattr(self, key)}")
        if not (self.clip > 0 and self.cliprange_value > 0 and self.vf_coef >= 0 and self.kl_coef >= 0 and self.critic_lr > 0):
            raise ValueError("train.ppo: clip > 0, cliprange_value > 0, vf_coef >= 0, kl_coef >= 0, critic_lr > 0 expected")
        if self.updates_per_rollout < 1 or not self.early_stop_kl > 0:
            raise ValueError("train.ppo.updates_per_rollout must be >= 1 and train.ppo.early_stop_kl > 0")


def token_rewards(rewards: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, R): each sequence's reward at its last response token (lengths >= 1), zero elsewhere."""
    out = torch.zeros(len(rewards), width, dtype=rewards.dtype)
    out[torch.arange(len(rewards)), lengths - 1] = rewards
    return out


def gae(values: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the response tokens (values zero past each response, the
    value after the last position 0): (advantages, returns = advantages + values), both (B, R)."""
    width = values.shape[1]
    last = torch.zeros(values.shape[0], dtype=values.dtype)
    out = []
    for t in reversed(range(width)):
        nxt = values[:, t + 1] if t < width - 1 else 0.0
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def whiten(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(adv - mean) / sqrt(var + 1e-8) over the masked tokens of the batch given (the global batch's: all
    of it, in micro-batch order), zero where masked."""
    n = mask.sum().clamp(min=1)
    mean = (adv * mask).sum() / n
    var = ((adv - mean) ** 2 * mask).sum() / n
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask


def policy_terms(logp, old, ref, adv, mask, cfg: PPOConfig, tokens: float) -> dict[str, torch.Tensor]:
    """A micro-batch's sums over its masked tokens divided by `tokens` (the global batch's count): the
    clipped policy loss plus kl_coef times the k3 KL to the reference ("policy"), the KL ("kl_ref"),
    the approximate KL 0.5 * log_ratio^2 ("approx_kl") and the clip fraction ("clipfrac")."""
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    kl = torch.exp(ref - logp) - (ref - logp) - 1.0
    clipped = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - cfg.clip, 1.0 + cfg.clip))
    kl_ref = (kl * mask).sum() / tokens
    return {"policy": (clipped * mask).sum() / tokens + cfg.kl_coef * kl_ref, "kl_ref": kl_ref,
            "approx_kl": (0.5 * log_ratio ** 2 * mask).sum().detach() / tokens,
            "clipfrac": (((ratio - 1.0).abs() > cfg.clip).float() * mask).sum().detach() / tokens}


def value_loss(values, old_values, returns, mask, cliprange: float, tokens: float) -> torch.Tensor:
    """0.5 * max((v - R)^2, (clamp(v, old - c, old + c) - R)^2) summed over the masked tokens / `tokens`."""
    clipped = torch.clamp(values, old_values - cliprange, old_values + cliprange)
    return 0.5 * (torch.max((values - returns) ** 2, (clipped - returns) ** 2) * mask).sum() / tokens


def last_tokens(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T-1): each completion's reward at its last completion target (none for a masked-out one)."""
    out = torch.zeros(mask.shape, dtype=rewards.dtype)
    rows = mask.any(1)
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
    out[rows, last[rows]] = rewards[rows]
    return out


def critic_weights(cfg, source: str, agree, tok_files: dict[str, bytes]) -> dict:
    """train.ppo.critic's weights for the critic's body, read on every rank and agreed: a source of the
    run's shape and tokenizer (else bad input naming the key)."""
    from model.formats import WeightsError
    from weights import base_weights

    from .reference import check_tokenizer

    got = []

    def read() -> None:
        try:
            state, record = base_weights(cfg.model, cfg.seed, source, "train.ppo.critic")
        except WeightsError as e:
            raise WeightsError(str(e) if str(e).startswith("train.ppo.critic") else f"train.ppo.critic: {e}") from None
        check_tokenizer(record, tok_files, source, "train.ppo.critic")
        got.append(state)

    agree("train.ppo.critic", attempt(read))
    return got[0]


class PPO(GRPO):
    """PPO's step (module docstring): GRPO's rollout, then the critic's."""

    def __init__(self, dataset, micro_batches: int, global_completions: int, grpo_cfg, cfg: PPOConfig, train_cfg, seed: int, tok, rt,
                 model) -> None:
        rollout_cfg = replace(grpo_cfg, beta=cfg.kl_coef, updates_per_rollout=cfg.updates_per_rollout, normalize="tokens",
                              scale_rewards="group", importance_sampling="token")
        super().__init__(dataset, micro_batches, global_completions, rollout_cfg, seed, tok, rt, model)
        self.ppo, self.train_cfg = cfg, train_cfg
        with torch.random.fork_rng():
            torch.manual_seed(derive_seed(seed, CRITIC_STREAM))
            self.critic = Critic.from_policy(model).to(next(model.parameters()).device)
        self.critic_opt = make_optimizer(self.critic, train_cfg)
        self.critic_reducer = None
        self.stopped = False
        self.skip_update = False  # this step steps no optimizer (train.py train_step): the early stop fired at an earlier update

    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """GRPO's, then the critic: the policy's weights (model.init_from's) on a fresh run, the checkpoint's on a resume."""
        from runtime import make_reducer

        super().start(cfg, rt, meta, resumed, agree, tok_files)
        if not resumed and self.ppo.critic:
            self.critic.body.load_state_dict(critic_weights(cfg, self.ppo.critic, agree, tok_files))
        elif not resumed:
            self.critic.body.load_state_dict(self.policy.state_dict())
        self.critic.to(rt.device).train()
        self.critic_reducer = make_reducer(cfg.dist.strategy, cfg.dist.reduce, self.critic, rt, self.micro_batches // rt.world_size)

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> str | None:
        rolled = self.rollout_at == self.step
        self.skip_update = False
        out = super().prepare(model, micro_batches, rt, agree, stop)
        if out is not None:
            return out
        mine = [j * rt.world_size + rt.rank for j in range(len(micro_batches))]
        if rolled:  # the advantages whitened over the global batch's completion tokens
            merged: dict = {}
            for part in rt.all_gather({i: {"advantages": self.buffer[i]["advantages"], "mask": self.buffer[i]["mask"]} for i in mine}):
                merged.update(part)
            order = sorted(merged)
            adv = whiten(torch.cat([merged[i]["advantages"] for i in order]), torch.cat([merged[i]["mask"] for i in order]).float())
            rows = len(merged[order[0]]["mask"])
            for k, i in enumerate(order):
                if i in self.buffer:
                    self.buffer[i]["advantages"] = adv[k * rows:(k + 1) * rows]
            self.stopped = False
        elif not self.stopped:  # MiniMind's early stop, on the global batch's approximate KL of the policy as it stands
            was = model.training
            model.eval()
            sums = {}
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                for i in mine:
                    ro = self.buffer[i]
                    x = ro["tokens"].to(rt.device)
                    lr = token_logps(model(x)[0], x).cpu() - ro["old"]
                    sums[i] = float((0.5 * lr ** 2 * ro["mask"].float()).double().sum())
            model.train(was)
            merged = {}
            for part in rt.all_gather(sums):
                merged.update(part)
            self.stopped = sum(merged[i] for i in sorted(merged)) / self.denominator > self.ppo.early_stop_kl
        else:  # stopped at an earlier update of this rollout: MiniMind's loop is left, no optimizer steps
            self.skip_update = True
        return None

    def _rollout(self, model, batch, i: int, check: bool = False) -> None:
        super()._rollout(model, batch, i, check)
        ro = self.buffer[i]
        was = self.critic.training
        self.critic.eval()
        with torch.no_grad():
            values = self.critic(ro["tokens"].to(next(self.critic.parameters()).device))[:, :-1].float().cpu() * ro["mask"]
        self.critic.train(was)
        adv, returns = gae(values, last_tokens(ro["rewards"], ro["mask"]), self.ppo.gamma, self.ppo.lam)
        ro.update(values=values, advantages=adv, returns=returns)

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        ro = self.buffer[i]
        x, mask = ro["tokens"].to(device), ro["mask"].to(device)
        logp = token_logps(net(x)[0], x)
        if "old" not in ro:  # the rollout's first update: the old and reference log-probabilities are this forward's
            ro["old"] = logp.detach().cpu()
            if self.reference is not None:
                with torch.no_grad():
                    ro["ref"] = token_logps(self.reference(x)[0], x).cpu()
        old = ro["old"].to(device)
        ref = ro["ref"].to(device) if "ref" in ro else logp.detach()  # kl_coef=0: a KL of 0
        m = mask.float()
        scale = 0.0 if self.stopped else float(self.micro_batches)  # the reducers average the M micro-batches
        terms = policy_terms(logp, old, ref, ro["advantages"].to(device), m, self.ppo, self.denominator)
        j = (i - self.rt.rank) // self.rt.world_size
        with self.critic_reducer.no_sync(j):
            values = self.critic_reducer.net(x)[:, :-1].float()
            vl = value_loss(values, ro["values"].to(device), ro["returns"].to(device), m, self.ppo.cliprange_value, self.denominator)
            self.critic_reducer.backward(self.ppo.vf_coef * vl * scale, j)
        with torch.no_grad():
            r = ro["rewards"].double()
            row = torch.stack([r.sum(), torch.tensor(float(len(r)), dtype=torch.float64), m.sum().double().cpu(),
                               *(terms[k].detach().double().cpu() for k in ("policy", "kl_ref", "approx_kl", "clipfrac")),
                               vl.detach().double().cpu()])
            self.stats.append((i, row))
        loss = terms["policy"] * scale
        if self.moe is not None:
            loss = loss + self.moe.aux_loss()
        return loss

    def step_metrics(self, rt) -> dict:
        """The critic's optimizer step (its gradients reduced as the policy's, clipped, its own LR), then the
        step's figures, summed in micro-batch order over every rank."""
        t = self.train_cfg
        self.critic_reducer.reduce()
        if t.grad_clip:
            self.critic_reducer.clip(t.grad_clip)
        lr = lr_at(self.step, types.SimpleNamespace(lr=self.ppo.critic_lr, warmup_steps=t.warmup_steps, steps=t.steps,
                                                    min_lr_ratio=t.min_lr_ratio))
        for group in self.critic_opt.param_groups:
            group["lr"] = lr
        if not self.skip_update:
            self.critic_opt.step()
        self.critic_opt.zero_grad(set_to_none=True)
        rows = sorted((i, row.tolist()) for part in rt.all_gather(self.stats) for i, row in part)
        names = ("reward_sum", "sequences", "tokens", "policy", "kl_ref", "approx_kl", "clipfrac", "value")
        s = dict(zip(names, (sum(col) for col in zip(*(row for _, row in rows)))))
        n = s["sequences"]
        return {"reward/mean": s["reward_sum"] / n, "completion_length": s["tokens"] / n, "policy_loss": s["policy"],
                "value_loss": s["value"], "kl": s["kl_ref"], "approx_kl": s["approx_kl"], "clip_fraction": s["clipfrac"],
                "early_stopped": float(self.stopped), "critic_lr": lr, "rollout_s": round(self.rollout_s, 5)}

    def states(self) -> dict:
        """The critic and its optimizer; the rollout under update when a rollout serves several steps."""
        return {"critic": ModelState(self.critic), "critic_optimizer": OptimizerState(self.critic, self.critic_opt),
                **({"rollout": PPOState(self, self.rt)} if self.ppo.updates_per_rollout > 1 else {})}


class PPOState(RolloutState):
    """GRPO's rollout state, with the critic's values, the returns, per-token advantages and the early stop."""

    KEYS = (*RolloutState.KEYS, "values", "returns")

    def _template(self) -> dict:
        out = super()._template()
        rows, t = self.grpo.global_completions, self.grpo.dataset.seq_len
        out.update(advantages=torch.zeros(rows, t - 1), values=torch.zeros(rows, t - 1), returns=torch.zeros(rows, t - 1),
                   stopped=torch.tensor(False))
        return out

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["stopped"] = torch.tensor(self.grpo.stopped)
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.grpo.stopped = bool(state["stopped"])


ROLLOUT_KEYS = ("generations", "temperature", "top_p", "max_new_tokens", "mask_truncated", "reference", "reward", "reward_timeout_s")
"""The keys of train.grpo that PPO reads (GRPO's rollout); its loss, KL weight and updates are train.ppo's."""

register(ObjectiveSpec(
    name="ppo", order=40, summary="PPO with a critic over prompts, GRPO's rollout", docs="docs/rl.md", formats=("prompts",),
    classes=(PPO,), sections={"ppo": PPOConfig}, reads={"grpo": ROLLOUT_KEYS, "ppo": ALL},
    build=lambda c: PPO(c.dataset, c.micro_batches, c.cfg.train.global_batch, c.cfg.train.grpo, c.cfg.train.ppo, c.cfg.train, c.cfg.seed,
                        c.tok, c.rt, c.model),
    plan=lambda cfg: prompts_plan(cfg, cfg.train.ppo.updates_per_rollout), supports=frozenset(), check=completions_check,
    why={"fsdp": NO_FSDP, "lora": "the critic starts from the policy's whole weights: train the policy in full"},
    pins=(*RL_PINS[:2], "the critic and its optimizer (states critic, critic_optimizer)",
          "the rollout with the critic's values and the early stop (state rollout) when updates_per_rollout > 1"),
    headline=(("reward", "reward/mean"), ("loss", "loss")), matrix=(MatrixValue("ppo", "ppo"),)))
