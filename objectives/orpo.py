"""ORPO, odds-ratio preference optimization (docs/preference.md): TRL's `ORPOTrainer` loss on packed preference
pairs, reference-free, exact on any world size and across resumes.

For pair k of a micro-batch row, with logp the mean log-probability of the completion's taught tokens
(TRL's `get_batch_logps(average_log_prob=True)`) and log1mexp(x) = log(1 - exp(x)) (TRL's, branched at -ln 2),
    log_odds = (logp(y_w) - logp(y_l)) - (log1mexp(logp(y_w)) - log1mexp(logp(y_l))),
    loss = NLL(y_w) - beta * log sigmoid(log_odds)      (TRL's `odds_ratio_loss`, beta TRL's lambda),
with NLL(y_w) the chosen completions' cross-entropy. TRL takes both means over one device's micro-batch
(the NLL over its chosen tokens, the odds term over its pairs): they depend on the split. Here each is the
global batch's: the NLL's sum over every chosen taught token of the step divided by their count (counted in
`prepare` from every rank's micro-batches, gathered: a count, exact in any order), the odds term's sum over
the step's pairs divided by their number (what packing stored); each micro-batch adds its sums times M over
those, and the reducers average the M micro-batches: the same bits on any world size. With one micro-batch
of the whole batch both are TRL's (tests/test_orpo.py referees it against TRL's own function).

Logged as TRL names them, means over the step's pairs summed in micro-batch order over every rank:
rewards/chosen = beta * logp(y_w), rewards/rejected, rewards/accuracies, rewards/margins, log_odds_ratio
(the mean log sigmoid), log_odds_chosen (the mean log_odds), and nll_loss.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data.chat import IGNORE

from .dpo import summed_in_order
from .spec import ALL, MatrixValue, ObjectiveSpec, register

log = logging.getLogger("minimind")
STATS = ("nll_sum", "or_sum", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "log_odds_ratio",
         "log_odds_chosen")


@dataclass
class ORPOConfig:
    """train.orpo: odds-ratio preference optimization's knob (train.objective=orpo, data.format=preference)."""

    beta: float = 0.1
    """The odds-ratio term's weight beside the chosen NLL (TRL's ORPOConfig.beta, the paper's lambda; default 0.1)."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"train.orpo.beta must be > 0, got {self.beta}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branched at -ln 2 against cancellation (TRL's)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's odds_ratio_loss on mean log-probabilities: (beta * log sigmoid(log_odds), log sigmoid(log_odds), log_odds)."""
    chosen, rejected = chosen.float(), rejected.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    return beta * ratio, ratio, log_odds


def segment_sums(logits: torch.Tensor, targets: torch.Tensor, sides: torch.Tensor, segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, segments) sums of the taught targets' log-probabilities per side of each row and their counts, fp32."""
    b, t = targets.shape
    lp = -F.cross_entropy(logits.float().reshape(b * t, -1), targets.reshape(-1), ignore_index=IGNORE, reduction="none").view(b, t)
    onehot = F.one_hot(sides, segments + 1)[..., 1:].to(lp.dtype)  # (B, T, S): side 0 (padding) in no column
    taught = (targets != IGNORE).to(lp.dtype).unsqueeze(-1)
    return (lp.unsqueeze(-1) * onehot).sum(1), (taught * onehot).sum(1)


def chosen_tokens(batch) -> int:
    """The chosen completions' taught tokens of a micro-batch (odd sides: side 2k + 1 is pair k's chosen)."""
    y, side = batch[1], batch[3]
    return int(((y != IGNORE) & (side % 2 == 1)).sum())


class ORPO:
    """A micro-batch's ORPO loss (module docstring); objectives.spec.Objective."""

    skip_update = False

    def __init__(self, dataset, micro_batches: int, cfg: ORPOConfig, model=None) -> None:
        self.dataset, self.micro_batches, self.cfg = dataset, micro_batches, cfg
        self.segments = 2 * dataset.max_pairs
        self.moe = model if model is not None and model.moe_layers() else None
        self.pairs, self.tokens = 0, 0
        self.stats: list[tuple[int, torch.Tensor]] = []

    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """Nothing beside the model: ORPO has no reference."""
        if rt.is_main:
            log.info("train.orpo: beta %g (the odds ratio's weight beside the chosen NLL); no reference", self.cfg.beta)

    def begin_step(self, indices: list[int], step: int = 0) -> None:
        self.pairs, self.stats = self.dataset.pairs(indices), []

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> None:
        """The step's chosen taught tokens over every rank's micro-batches (the NLL's global denominator)."""
        mine = {j * rt.world_size + rt.rank: chosen_tokens(batch) for j, batch in enumerate(micro_batches)}
        self.tokens = sum(n for part in rt.all_gather(mine) for n in part.values())

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        x, y, pos, side = (t.to(device, non_blocking=True) for t in batch[:4])
        sums, counts = segment_sums(net(x, positions=pos)[0], y, side, self.segments)
        present = counts[:, 0::2] > 0  # (B, pairs): the row has pair k
        # an absent pair's sides at a finite stand-in: log1mexp(0) is -inf, whose gradient torch.where would not stop
        mean = torch.where(counts > 0, sums / counts.clamp(min=1), -1.0)
        losses, ratio, log_odds = odds_ratio(mean[:, 0::2], mean[:, 1::2], self.cfg.beta)
        nll = -torch.where(present, sums[:, 0::2], 0.0).sum()
        odds = torch.where(present, losses, 0.0).sum()
        loss = nll * self.micro_batches / max(self.tokens, 1) - odds * self.micro_batches / self.pairs
        with torch.no_grad():
            rc, rr = self.cfg.beta * mean[:, 0::2], self.cfg.beta * mean[:, 1::2]
            sums_ = [nll, odds] + [torch.where(present, v, 0.0).sum() for v in (rc, rr, (rc > rr).float(), rc - rr, ratio, log_odds)]
            self.stats.append((i, torch.stack([s.detach().float() for s in sums_]).double().cpu()))
        if self.moe is not None:
            loss = loss + self.moe.aux_loss()
        return loss

    def step_metrics(self, rt) -> dict:
        """TRL's figures: means over the global batch's pairs (the NLL over its chosen tokens), summed in micro-batch order."""
        total = summed_in_order(rt, self.stats, len(STATS))
        t = dict(zip(STATS, total))
        return {"nll_loss": t["nll_sum"] / max(self.tokens, 1), **{k: t[k] / self.pairs for k in STATS[2:]}}

    def states(self) -> dict:
        return {}


register(ObjectiveSpec(
    name="orpo", order=60, summary="ORPO over preference pairs: the chosen NLL and an odds-ratio term, no reference",
    docs="docs/preference.md", formats=("preference",), classes=(ORPO,),
    build=lambda c: ORPO(c.dataset, c.micro_batches, c.cfg.train.orpo, c.model),
    sections={"orpo": ORPOConfig}, reads={"orpo": ALL}, supports=frozenset({"fsdp", "lora"}),
    pins=(), headline=(("loss", "loss"), ("accuracy", "rewards/accuracies")),
    # the matrix's preference corpus sets train.dpo.beta for DPO: back to its default, which ORPO does not read
    matrix=(MatrixValue("orpo", "dpo", ("train.objective=orpo", "train.dpo.beta=0.1")),)))
