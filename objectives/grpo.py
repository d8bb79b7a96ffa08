"""Reinforcement learning with verifiable rewards, GRPO and CISPO (docs/rl.md), exact on any world
size and across resumes.

A step's global batch is `train.global_batch` completions: global_batch / generations prompts,
each with `generations` completions. A rollout, for each prompt of this rank's micro-batches:
  - its group generated as one fixed-shape unit (model/generate.py generate_group: the prompt
    repeated, max_new_tokens positions each, the KV cache), completion r's draws from a generator
    seeded by derive_seed(seed, STREAM, step, prompt index, r): the same ids whichever rank and
    world size generates them;
  - each completion (up to and with its first EOS) scored by the reward, a pure function of the
    prompt, the completion's text and the line's fields (objectives/rewards.py), each call bounded
    by train.grpo.reward_timeout_s, a rank's first completion scored twice (an impure reward refused);
  - advantages (r - group mean) / (group std + 1e-4) (MiniMind's, the std of the group itself;
    train.grpo.scale_rewards=batch: the std of the global batch's rewards, gathered in micro-batch
    order; none: r - group mean; train.grpo.std=sample: Bessel's, as TRL).
Then `updates_per_rollout` optimizer steps on it: per token, with logp the policy's, old the
policy's at the rollout (its first update's own forward, detached: the ratio is exactly 1 there),
ref the frozen reference's and kl = exp(ref - logp) - (ref - logp) - 1 (k3):
  CISPO: -(min(ratio, eps_high).detach() * A * logp - beta * kl)
  GRPO:  -(min(ratio * A, clamp(ratio, 1 - eps, 1 + eps) * A) - beta * kl)   (also dr_grpo, dapo, bnpo)
  SAPO:  -(sigmoid(tau * (ratio - 1)) * 4 / tau * A - beta * kl), tau sapo_tau_pos if A > 0 else sapo_tau_neg
(train.grpo.importance_sampling=sequence, GSPO: the ratio is exp of the sequence's mean log-ratio).
The step's loss, by train.grpo.normalize (by default the loss's own, as TRL 1.16 defines it):
  sequence (grpo, sapo, cispo as MiniMind's): each sequence's mean over its completion tokens,
    averaged over the global batch's sequences (a micro-batch adds its sum times M / global_batch);
  tokens (dapo, bnpo, TRL's cispo): the sum over the global batch's completion tokens divided by
    their number, counted over every rank's rollout before the updates (TRL's bnpo divides by the
    local micro-batch's: it depends on the split; this is its global-batch equivalent);
  max_tokens (dr_grpo): that sum divided by global_batch * max_new_tokens;
the reducers average the micro-batches: the world size and the micro-batch split do not matter.
train.grpo.mask_truncated: a completion without an EOS takes no part in the loss (TRL's
mask_truncated_completions), still one of the global batch's sequences.
With updates_per_rollout > 1 the rollout (tokens, masks, advantages, rewards, old and reference
log-probabilities) is part of the resume state, gathered from every rank in micro-batch order at a
save: a run halted inside a rollout's updates resumes them on any world size.

The rollout runs eagerly under train.compile (every KV-cache length would be a static graph of its
own, Dynamo's recompile limit would be reached, and which frames run compiled would depend on the
process's history); the training forwards stay compiled. Ranks wait for each other's rollouts on the
board's heartbeats, never in a collective that times out; a stop signal inside a rollout abandons it
on every rank ("stopped": the loop saves the step before it).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.outcome import Stopped, attempt
from common.seeds import derive_seed
from model.generate import generate_group
from runtime.board import hand_off

from . import rewards as reward_fns
from .reference import pinned_reference
from .spec import ALL, MatrixValue, ObjectiveSpec, register

log = logging.getLogger("minimind")
STREAM = 0x47525030  # "GRP0": completion r of a prompt draws from derive_seed(seed, STREAM, step, prompt index, r)
LOSSES = ("cispo", "grpo", "dr_grpo", "dapo", "bnpo", "sapo")
NORMALIZE = {"grpo": "sequence", "sapo": "sequence", "cispo": "sequence", "dapo": "tokens", "bnpo": "tokens", "dr_grpo": "max_tokens"}
STATS = ("reward_sum", "reward_sq", "sequences", "kl_sum", "tokens", "clipped", "zero_groups", "groups")


@dataclass
class GRPOConfig:
    """train.grpo: the RL objective's knobs (train.objective=grpo, data.format=prompts; MiniMind's defaults)."""

    generations: int = 6
    """Completions per prompt (a group); train.global_batch and train.micro_batch count completions, multiples of it."""
    temperature: float = 0.8
    """Sampling temperature of the rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts: the smallest set of tokens whose probability reaches top_p (1: all)."""
    max_new_tokens: int = 64
    """Each completion's length: generated in full (a fixed shape), masked after its first EOS."""
    beta: float = 0.1
    """Weight of the k3 KL to the reference (0: no reference, none is read)."""
    loss: str = "cispo"
    """cispo (MiniMind's default) | grpo | dr_grpo | dapo | bnpo | sapo: TRL 1.16's loss_type (docs/rl.md)."""
    importance_sampling: str = "token"
    """token | sequence (GSPO: the ratio of a sequence is exp of its mean per-token log-ratio)."""
    scale_rewards: str = "group"
    """group | batch | none: the advantages' denominator, the group's std, the global batch's, or none (TRL's)."""
    std: str = "population"
    """population (MiniMind's) | sample (Bessel's correction, TRL's): the std that scale_rewards divides by."""
    normalize: str = ""
    """'' (the loss's own, TRL's) | sequence | tokens | max_tokens: how the step's loss is averaged (module docstring)."""
    mask_truncated: bool = False
    """A completion without an EOS in max_new_tokens takes no part in the loss (TRL's mask_truncated_completions)."""
    sapo_tau_pos: float = 1.0
    """SAPO's temperature for positive advantages (TRL's sapo_temperature_pos)."""
    sapo_tau_neg: float = 1.05
    """SAPO's temperature for negative advantages (TRL's sapo_temperature_neg)."""
    eps: float = 0.2
    """GRPO's clip range: the ratio is clamped to [1 - eps, 1 + eps]."""
    eps_high: float = 5.0
    """CISPO's cap on the (detached) ratio."""
    updates_per_rollout: int = 1
    """Optimizer steps on each rollout (TRL's num_iterations); > 1 keeps the rollout in the resume state."""
    reference: str = ""
    """The reference model: any model.init_from source ('' : model.init_from, the policy's start; the seeded init
    without one). Pinned by its sha256 in the checkpoint."""
    reward: str = "answer"
    """answer (exact match with the line's "answer") | minimind_rules | module:function (or path/file.py:function):
    called with (prompt, completion, **the line's fields), returning a finite float."""
    reward_timeout_s: float = 30.0
    """The longest one reward call may take: a reward that does not return by then fails the run on every rank,
    naming the prompt (exit 1)."""

    def __post_init__(self) -> None:
        if self.generations < 2:
            raise ValueError(f"train.grpo.generations must be >= 2 (a group's advantages compare its completions), got {self.generations}")
        if self.loss not in LOSSES:
            raise ValueError(f"train.grpo.loss: expected one of {', '.join(LOSSES)}, got {self.loss!r}")
        for key, value, allowed in (("importance_sampling", self.importance_sampling, ("token", "sequence")),
                                    ("scale_rewards", self.scale_rewards, ("group", "batch", "none")),
                                    ("std", self.std, ("population", "sample")),
                                    ("normalize", self.normalize, ("", "sequence", "tokens", "max_tokens"))):
            if value not in allowed:
                raise ValueError(f"train.grpo.{key}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")
        if self.importance_sampling == "sequence" and self.norm != "sequence":
            raise ValueError(f"train.grpo.importance_sampling=sequence: loss={self.loss} (normalize={self.norm}) sums per-token terms, "
                             "weighting each sequence by its length (token level only, as TRL warns): use loss=grpo, sapo or cispo")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"train.grpo.sapo_tau_pos and sapo_tau_neg must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        if self.max_new_tokens < 1 or self.updates_per_rollout < 1:
            raise ValueError("train.grpo.max_new_tokens and train.grpo.updates_per_rollout must be >= 1")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"train.grpo.reward_timeout_s must be > 0 (seconds), got {self.reward_timeout_s}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.beta >= 0 and 0 <= self.eps < 1 and self.eps_high > 0):
            raise ValueError(f"train.grpo: temperature > 0, 0 < top_p <= 1, beta >= 0, 0 <= eps < 1, eps_high > 0 expected, got "
                             f"{self.temperature}, {self.top_p}, {self.beta}, {self.eps}, {self.eps_high}")


    @property
    def norm(self) -> str:
        """The step loss's normalization: train.grpo.normalize, or the loss's own."""
        return self.normalize or NORMALIZE[self.loss]


def token_logps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T-1) log-probabilities of tokens[:, 1:] under logits[:, :-1], fp32."""
    b, t = tokens.shape
    return -F.cross_entropy(logits[:, :-1].float().reshape(b * (t - 1), -1), tokens[:, 1:].reshape(-1), reduction="none").view(b, t - 1)


def advantages(rewards: torch.Tensor, generations: int, scale: str = "group", unbiased: bool = False,
               batch: torch.Tensor | None = None) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-4), groups of `generations` consecutive completions; scale
    "batch": the std of `batch` (the global batch's rewards), "none": r - group mean."""
    grouped = rewards.view(-1, generations)
    mean = grouped.mean(1, keepdim=True)
    if scale == "none":
        return (grouped - mean).view(-1)
    std = grouped.std(1, keepdim=True, unbiased=unbiased) if scale == "group" else batch.std(unbiased=unbiased)
    return ((grouped - mean) / (std + 1e-4)).view(-1)


def per_token_loss(logp, old, ref, adv, cfg: GRPOConfig, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss of train.grpo.loss (module docstring) and where the ratio was clipped
    (`mask`, the completion tokens, needed by importance_sampling=sequence)."""
    if cfg.importance_sampling == "sequence":
        m = mask.float()
        ratio = torch.exp(((logp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0))
    else:
        ratio = torch.exp(logp - old)
    a = adv.unsqueeze(1)
    kl = torch.exp(ref - logp) - (ref - logp) - 1 if ref is not None else torch.zeros_like(logp)
    if cfg.loss == "cispo":
        clipped = ratio > cfg.eps_high
        loss = -(torch.clamp(ratio, max=cfg.eps_high).detach() * a * logp - cfg.beta * kl)
    elif cfg.loss == "sapo":
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
        tau = torch.where(a > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        loss = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a - cfg.beta * kl)
    else:
        clipped = ((ratio < 1 - cfg.eps) & (a < 0)) | ((ratio > 1 + cfg.eps) & (a > 0))
        loss = -(torch.min(ratio * a, torch.clamp(ratio, 1 - cfg.eps, 1 + cfg.eps) * a) - cfg.beta * kl)
    return loss, clipped


def reduce_loss(per_token, m, norm: str, micro_batches: int, sequences: int, denominator: float) -> torch.Tensor:
    """A micro-batch's share of the step's loss (`m` its completion tokens, float): under "sequence" its
    sequences' means summed times M / sequences (the global batch's), else its tokens' sum times M /
    denominator (the global batch's tokens, or sequences x max_new_tokens); the reducers average the M."""
    if norm == "sequence":
        seq_loss = (per_token * m).sum(1) / m.sum(1).clamp(min=1)
        return seq_loss.sum() * micro_batches / sequences
    return (per_token * m).sum() * micro_batches / denominator


class GRPO:
    """A micro-batch's RL loss (module docstring); the interface of objectives.NextToken."""

    skip_update = False

    def __init__(self, dataset, micro_batches: int, global_completions: int, cfg: GRPOConfig, seed: int, tok, rt, model=None) -> None:
        self.dataset, self.micro_batches, self.global_completions, self.cfg, self.seed = dataset, micro_batches, global_completions, cfg, seed
        self.tok, self.policy = tok, model
        self.moe = model if model is not None and model.moe_layers() else None
        self.reward, self.reward_record = reward_fns.load(cfg.reward)
        self.reference = None
        self.buffer: dict[int, dict[str, torch.Tensor]] = {}  # micro-batch index -> its rollout
        self.rollout_at = -1
        self.step = 0
        self.rt = rt
        self.rollout_s = 0.0
        self.stall_s = 600.0  # dist.timeout_s (start): how long a rank's rollout may show no heartbeat
        self.stats: list[tuple[int, torch.Tensor]] = []
        self.denominator = float(global_completions)  # the step loss's: sequences, tokens or sequences x max_new_tokens
        self.lengths: list[tuple[int, float]] = []

    # ---------------------------------------------------------------- set-up
    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """After the resume's load: the reward's identity pinned (a changed file refused), the reference read and pinned."""
        from common.outcome import BadInput

        if resumed and meta.reward and meta.reward.get("sha256") != self.reward_record.get("sha256"):
            raise BadInput(f"train.grpo.reward: {self.reward_record.get('file') or self.reward_record['spec']} has sha256 "
                           f"{self.reward_record.get('sha256')}, but the steps of {resumed.path} were scored by one of sha256 "
                           f"{meta.reward.get('sha256')} ({meta.reward.get('spec')})")
        meta.reward = self.reward_record
        self.stall_s = cfg.dist.timeout_s
        if self.cfg.beta:
            self.reference, sha, path = pinned_reference(cfg, rt, meta, resumed, agree, tok_files, self.cfg.reference, "train.grpo.reference")
            if rt.is_main:
                log.info("train.grpo: the reference %s (weights sha256 %s)%s", path or "the seeded init", sha[:12], ", verified" if resumed else "")
        longest, k = self.dataset.longest()
        if longest + self.cfg.max_new_tokens > cfg.model.seq_len:
            from common.outcome import BadInput

            raise BadInput(f"train.grpo.max_new_tokens={self.cfg.max_new_tokens}: prompt {k} ({self.dataset.fields(k)['line']}) has "
                           f"{longest} tokens, and both must fit model.seq_len={cfg.model.seq_len}")

    # ---------------------------------------------------------------- a step
    def begin_step(self, indices: list[int], step: int = 0) -> None:
        self.step, self.stats, self.lengths = step, [], []
        if step % self.cfg.updates_per_rollout == 0:
            self.buffer, self.rollout_at = {}, step

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> str | None:
        """At a rollout step, before any forward: this rank's micro-batches' rollouts (generation,
        rewards, advantages), agreed by every rank (a reward that fails fails the run everywhere, named).
        Every rank waits for the others on the board's heartbeats (runtime/board.py hand_off): a rollout
        may take longer than dist.timeout_s. A stop signal inside a rollout (`stop`: run/stop.py's flag)
        interrupts it: every rank abandons the rollout and returns "stopped"."""
        self.rollout_s = 0.0
        if self.rollout_at != self.step:
            return None
        t0 = time.perf_counter()
        mine: dict = {"error": None, "stopped": False}

        def work(progress) -> dict:
            was = model.training
            model.eval()
            try:
                # Eager under train.compile: the training forwards' compiled graphs do not depend on the rollouts.
                with torch.compiler.set_stance("force_eager"), stop.interruptible() if stop else contextlib.nullcontext():
                    mine["error"] = attempt(lambda: [self._rollout(model, batch, j * rt.world_size + rt.rank, j == 0)
                                                     for j, batch in enumerate(micro_batches)])
            except Stopped:
                mine["stopped"] = True
            finally:
                model.train(was)
            return {"stopped": mine["stopped"]}

        key = f"rollout/{self.step}"
        outcomes = hand_off(rt, key, rt.rank, work, self.stall_s, f"the rollout of step {self.step + 1}")
        self.rollout_s = time.perf_counter() - t0
        agree("the rollout", mine["error"])
        if rt.world_size > 1:
            rt.board.delete(f"{key}/{rt.rank}")  # every rank has read it: past the agreement above
        if any(o["stopped"] for o in outcomes.values()):
            self.buffer = {}
            return "stopped"
        if self.cfg.scale_rewards == "batch" or self.cfg.norm != "sequence":  # figures of the global batch, gathered
            merged: dict = {}
            for part in rt.all_gather({i: {"rewards": ro["rewards"], "mask": ro["mask"]} for i, ro in self.buffer.items()}):
                merged.update(part)
            self._globals(merged)
        return None

    def _globals(self, rollout: dict, rescale: bool = True) -> None:
        """From the global batch's rollout (every micro-batch, any rank's): the step loss's denominator
        and, under scale_rewards=batch (`rescale`: not on a resume, they are saved), the advantages of
        this rank's micro-batches."""
        order = sorted(rollout)
        if self.cfg.norm == "tokens":  # a count: exact in any order
            self.denominator = float(max(sum(int(rollout[i]["mask"].sum()) for i in order), 1))  # TRL clamps it to 1 too
        elif self.cfg.norm == "max_tokens":
            self.denominator = float(self.global_completions * self.cfg.max_new_tokens)
        if rescale and self.cfg.scale_rewards == "batch":
            batch = torch.cat([rollout[i]["rewards"] for i in order])
            for ro in self.buffer.values():
                ro["advantages"] = advantages(ro["rewards"], self.cfg.generations, "batch", self.cfg.std == "sample", batch)

    # ---------------------------------------------------------------- the rollout: one path, a hook per variant
    def group(self, model, prompt: list[int], fields: dict, index: int, seq_len: int) -> list[dict]:
        """The hook a variant overrides (objectives/agent.py: episodes with tools): prompt `index`'s `generations`
        completions, each {"ids": the whole sequence, "mine": the positions of the model's own ids, "text": what the
        reward scores, "seen": the fields the reward sees, "truncated": no EOS ended it, "extra": the variant's own
        figures (None)}. GRPO's: the group generated as one fixed-shape unit, each completion through its first EOS."""
        gens = [torch.Generator().manual_seed(derive_seed(self.seed, STREAM, self.step, index, r)) for r in range(self.cfg.generations)]
        completions = generate_group(model, prompt, gens, self.cfg.max_new_tokens, self.cfg.temperature, self.cfg.top_p)
        eos, n, out = self.tok.eos, len(prompt), []
        for c in completions.tolist():
            end = c.index(eos) + 1 if eos in c else len(c)  # through the first EOS
            out.append({"ids": prompt + c[:end], "mine": range(n, n + end), "text": self.tok.decode([t for t in c[:end] if t != eos]),
                        "seen": fields, "truncated": eos not in c, "extra": None})
        return out

    def _rollout(self, model, batch, i: int, check: bool = False) -> None:
        """Micro-batch `i`'s rollout into the buffer: each prompt's group (the `group` hook), the loss mask (the model's
        own ids; none of a truncated completion's under mask_truncated), the rewards and the advantages
        (scale_rewards, std; batch: prepare's, of the global batch), whatever the variant."""
        rows, lengths, indices = batch
        g, seq_len, pad = self.cfg.generations, rows.shape[1], self.tok.pad
        tokens, masks, scores, extras = [], [], [], []
        for row, n, index in zip(rows, lengths.tolist(), indices.tolist()):
            prompt, fields = row[:n].tolist(), self.dataset.fields(index)
            for c in self.group(model, prompt, fields, index, seq_len):
                seq = torch.full((seq_len,), pad, dtype=torch.long)
                seq[:len(c["ids"])] = torch.tensor(c["ids"])
                mask = torch.zeros(seq_len - 1, dtype=torch.bool)
                if not (self.cfg.mask_truncated and c["truncated"]):
                    mask[torch.tensor(c["mine"], dtype=torch.long) - 1] = True  # the targets that are the model's own ids
                tokens.append(seq)
                masks.append(mask)
                extras.append(c["extra"])
                args = (self.reward, fields["prompt"], c["text"], c["seen"], index, fields["line"], self.cfg.reward_timeout_s)
                scores.append(reward_fns.score(*args))
                if check and len(scores) == 1:  # this rank's first completion of the rollout, scored again: the same value
                    reward_fns.check_pure(self.cfg.reward, scores[0], reward_fns.score(*args), index, fields["line"])
        r = torch.tensor(scores, dtype=torch.float32)
        self.buffer[i] = {"tokens": torch.stack(tokens), "mask": torch.stack(masks), "rewards": r,
                          "advantages": advantages(r, g, self.cfg.scale_rewards, self.cfg.std == "sample", r), **self.kept(extras)}

    def kept(self, extras: list) -> dict[str, torch.Tensor]:
        """The hook for what a variant keeps beside its rollout (the resume state): nothing of GRPO's."""
        return {}

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        ro = self.buffer[i]
        x, mask, adv = ro["tokens"].to(device), ro["mask"].to(device), ro["advantages"].to(device)
        logp = token_logps(net(x)[0], x)
        if "old" not in ro:  # the rollout's first update: the old and reference log-probabilities are this forward's
            ro["old"] = logp.detach().cpu()
            if self.reference is not None:
                with torch.no_grad():
                    ro["ref"] = token_logps(self.reference(x)[0], x).cpu()
        old = ro["old"].to(device)
        ref = ro["ref"].to(device) if "ref" in ro else None
        per_token, clipped = per_token_loss(logp, old, ref, adv, self.cfg, mask)
        m = mask.float()
        loss = reduce_loss(per_token, m, self.cfg.norm, self.micro_batches, self.global_completions, self.denominator)
        with torch.no_grad():
            r = ro["rewards"].double()
            kl = (torch.exp(ref - logp) - (ref - logp) - 1) if ref is not None else torch.zeros_like(logp)
            groups = adv.view(-1, self.cfg.generations)
            row = torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(len(r)), dtype=torch.float64),
                               (kl * m).sum().double().cpu(), m.sum().double().cpu(), (clipped & mask).sum().double().cpu(),
                               (groups == 0).all(1).sum().double().cpu(), torch.tensor(float(groups.shape[0]), dtype=torch.float64)])
            self.stats.append((i, row))
        if self.moe is not None:
            loss = loss + self.moe.aux_loss()
        return loss

    def step_metrics(self, rt) -> dict:
        """The step's rollout figures, summed in micro-batch order over every rank: the same bits on any world size."""
        rows = sorted((i, row.tolist()) for part in rt.all_gather(self.stats) for i, row in part)
        t = dict(zip(STATS, (sum(col) for col in zip(*(row for _, row in rows)))))
        n, tokens = t["sequences"], max(t["tokens"], 1.0)
        mean = t["reward_sum"] / n
        return {"reward/mean": mean, "reward/std": math.sqrt(max(t["reward_sq"] / n - mean * mean, 0.0)), "kl": t["kl_sum"] / tokens,
                "completion_length": t["tokens"] / n, "clip_fraction": t["clipped"] / tokens,
                "zero_advantage_groups": t["zero_groups"] / t["groups"], "rollout_s": round(self.rollout_s, 5)}

    # ---------------------------------------------------------------- the resume state (updates_per_rollout > 1)
    def states(self) -> dict:
        """The rollout under update, when a rollout serves several steps (else nothing)."""
        return {"rollout": RolloutState(self, self.rt)} if self.cfg.updates_per_rollout > 1 else {}


class RolloutState:
    """The rollout being updated, for the checkpoint: every rank's micro-batches gathered in
    micro-batch order (the same state on every rank: any world size reads it back)."""

    KEYS = ("tokens", "mask", "rewards", "advantages", "old", "ref")

    def __init__(self, grpo: GRPO, rt) -> None:
        self.grpo, self.rt = grpo, rt

    def _template(self) -> dict:
        """The state's shape, for a resume to load into: M micro-batches of rows, each seq_len tokens."""
        g = self.grpo
        rows, t = g.global_completions, g.dataset.seq_len
        out = {"at": torch.tensor(-1), "micro_batches": torch.arange(g.micro_batches), "tokens": torch.zeros(rows, t, dtype=torch.long),
               "mask": torch.zeros(rows, t - 1, dtype=torch.bool), "rewards": torch.zeros(rows), "advantages": torch.zeros(rows),
               "old": torch.zeros(rows, t - 1)}
        if g.cfg.beta:
            out["ref"] = torch.zeros(rows, t - 1)
        return out

    def state_dict(self) -> dict:
        mine = {i: {k: v for k, v in ro.items()} for i, ro in self.grpo.buffer.items()}
        merged: dict[int, dict] = {}
        for part in self.rt.all_gather(mine):  # a collective: every rank saves together
            merged.update(part)
        if len(merged) != self.grpo.micro_batches or any("old" not in ro for ro in merged.values()):
            return self._template()  # a fresh process (a resume's template), or no rollout under update
        out = {"at": torch.tensor(self.grpo.rollout_at), "micro_batches": torch.tensor(sorted(merged), dtype=torch.long)}
        for k in self.KEYS:
            if k in merged[0]:
                out[k] = torch.cat([merged[i][k] for i in sorted(merged)])
        return out

    def load_state_dict(self, state: dict) -> None:
        order = state["micro_batches"].tolist()
        self.grpo.rollout_at = int(state["at"])
        if self.grpo.rollout_at < 0:
            self.grpo.buffer = {}
            return
        per = len(state["tokens"]) // len(order)
        self.grpo.buffer = {i: {k: state[k][j * per:(j + 1) * per].clone() for k in self.KEYS if k in state} for j, i in enumerate(order)}
        if self.grpo.cfg.norm != "sequence":  # the denominator, from the whole rollout (its advantages are saved)
            self.grpo._globals(self.grpo.buffer, rescale=False)


def completions_check(train) -> None:
    """train.global_batch and train.micro_batch count completions: whole groups (GRPO, PPO, agents)."""
    g = train.grpo.generations
    if train.global_batch % g or train.micro_batch % g:
        raise ValueError(f"train.global_batch={train.global_batch} and train.micro_batch={train.micro_batch} count completions "
                         f"under train.objective={train.objective}: both must be multiples of train.grpo.generations={g} (a group is "
                         f"generated and scored within one micro-batch)")


def prompts_plan(cfg, serves: int | None = None) -> tuple[int, int, int]:
    """The batch plan in prompts: train.global_batch and train.micro_batch count completions; a batch serves
    updates_per_rollout steps (`serves`, else train.grpo's)."""
    g = cfg.train.grpo.generations
    return cfg.train.global_batch // g, cfg.train.micro_batch // g, serves or cfg.train.grpo.updates_per_rollout


RL_PINS = ("the reward's sha256 (the manifest's reward): a changed file refused on resume",
           "the reference's identity when train.grpo.beta > 0 (the manifest's reference)",
           "the rollout under update (state rollout) when updates_per_rollout > 1")
RL_HEADLINE = (("reward", "reward/mean"), ("loss", "loss"))
NO_FSDP = "each rank generates its groups alone, which a sharded model cannot"

register(ObjectiveSpec(
    name="grpo", order=30, summary="GRPO, CISPO and TRL's family over prompts with a verifiable reward", docs="docs/rl.md",
    formats=("prompts",), classes=(GRPO,), sections={"grpo": GRPOConfig}, reads={"grpo": ALL},
    build=lambda c: GRPO(c.dataset, c.micro_batches, c.cfg.train.global_batch, c.cfg.train.grpo, c.cfg.seed, c.tok, c.rt, c.model),
    plan=prompts_plan, supports=frozenset({"lora"}), why={"fsdp": NO_FSDP}, check=completions_check, pins=RL_PINS, headline=RL_HEADLINE,
    matrix=(MatrixValue("grpo", "grpo"), MatrixValue("cispo2", "grpo", ("train.grpo.loss=cispo", "train.grpo.updates_per_rollout=2")),
            # TRL's default: token-level over the global batch, batch-scaled rewards, truncations masked
            MatrixValue("dapo", "grpo", ("train.grpo.loss=dapo", "train.grpo.scale_rewards=batch", "train.grpo.mask_truncated=true",
                                         "train.grpo.updates_per_rollout=2")))))
