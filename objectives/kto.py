"""KTO, Kahneman-Tversky optimization (docs/preference.md): TRL's `KTOTrainer` loss on packed unpaired examples
against a reference pinned by its hash, with its KL term and every mean over the global batch: exact on any world size.

For example i of a step (data/formats/unpaired.py: its completion y_i, labelled desirable or not, and its KL sequence,
its prompt with another line's completion), with logp the sum of a completion's taught log-probabilities (TRL's),
    r_i  = logp(y_i) - logp_ref(y_i),
    KL   = max(0, mean over the step's examples of (logp(KL_i) - logp_ref(KL_i))),      detached (TRL's)
    loss_i = desirable_weight   * (1 - sigmoid(beta * (r_i - KL)))   for a desirable example,
             undesirable_weight * (1 - sigmoid(beta * (KL - r_i)))   for an undesirable one,
and the step's loss is the mean of loss_i over the global batch's examples. TRL takes the KL's mean over one device's
micro-batch (then the devices' means' mean) and the loss's over that micro-batch: both depend on the split. Here the
KL is the global batch's: in `prepare`, before any forward with a gradient, each rank computes its micro-batches' KL
sequences under the policy (no gradient, a row at a time: a function of the row alone), the sums are gathered and
added in micro-batch order over every rank; the loss's mean is the sum over the step's examples divided by their
count (what packing stored); each micro-batch adds its sum times M over that, and the reducers average the M
micro-batches. With one micro-batch of the whole batch both are TRL's (tests/test_kto.py referees it against TRL's
own `KTOTrainer._compute_loss`).

The reference's sums (the example's and its KL sequence's) are DPO's: live, or precomputed once into a verified table
beside the packed rows (`train.kto.precompute`, objectives/tables.py). Logged as TRL names them: kl, rewards/chosen
(the mean beta * r_i of the desirable examples), rewards/rejected, rewards/margins, logps/chosen, logps/rejected.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from data.formats.unpaired import DESIRABLE, UNDESIRABLE, UnpairedDataset
from runtime import autocast as runtime_autocast

from . import tables
from .dpo import reference_logps, reference_table, segment_logps, summed_in_order
from .reference import pinned_reference
from .spec import ALL, MatrixValue, ObjectiveSpec, register

log = logging.getLogger("minimind")
STATS = ("chosen", "rejected", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


@dataclass
class KTOConfig:
    """train.kto: KTO's knobs (train.objective=kto, data.format=unpaired)."""

    beta: float = 0.1
    """The KTO temperature (TRL's KTOConfig.beta, default 0.1)."""
    desirable_weight: float = 1.0
    """A desirable example's loss weight (TRL's desirable_weight)."""
    undesirable_weight: float = 1.0
    """An undesirable example's loss weight (TRL's undesirable_weight)."""
    precompute: bool = True
    """Compute the reference's log-probabilities once before training (beside the packed rows) | false: live."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"train.kto.beta must be > 0, got {self.beta}")
        if not (self.desirable_weight > 0 and self.undesirable_weight > 0):
            raise ValueError(f"train.kto.desirable_weight and undesirable_weight must be > 0, got "
                             f"{self.desirable_weight} and {self.undesirable_weight}")


def labels_of(side: torch.Tensor, label: torch.Tensor, segments: int) -> torch.Tensor:
    """(B, examples) of each row's k-th example's label: 1 desirable, 2 undesirable, 0 absent."""
    onehot = F.one_hot(side, segments + 1)[..., 1::2]  # (B, T, examples): the example's own sequence
    return (onehot * label.unsqueeze(-1)).amax(1)


def kto_losses(r: torch.Tensor, kl: torch.Tensor, desirable: torch.Tensor, cfg: KTOConfig) -> torch.Tensor:
    """TRL's per-example KTO losses, weighted (module docstring)."""
    chosen = cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * (r - kl)))
    rejected = cfg.undesirable_weight * (1 - torch.sigmoid(cfg.beta * (kl - r)))
    return torch.where(desirable, chosen, rejected)


class KTO:
    """A micro-batch's KTO loss (module docstring); objectives.spec.Objective."""

    skip_update = False

    def __init__(self, dataset, micro_batches: int, micro_batch: int, cfg: KTOConfig, model=None) -> None:
        self.dataset, self.micro_batches, self.micro_batch, self.cfg = dataset, micro_batches, micro_batch, cfg
        self.segments = 2 * dataset.max_pairs
        self.moe = model if model is not None and model.moe_layers() else None
        self.reference, self.table = None, None
        self.autocast = ("ddp", "float32")
        self.indices: list[int] = []
        self.examples, self.kl = 0, torch.zeros(())
        self.local: dict[int, tuple[float, int]] = {}  # this rank's micro-batches' KL sums and counts, by index in the step
        self.stats: list[tuple[int, torch.Tensor]] = []

    def begin_step(self, indices: list[int], step: int = 0) -> None:
        self.indices, self.examples, self.stats = indices, self.dataset.pairs(indices), []

    def _reference(self, batch, device, i: int) -> torch.Tensor:
        if self.table is not None:
            rows = self.indices[i * self.micro_batch:(i + 1) * self.micro_batch]
            return torch.from_numpy(self.table[np.asarray(rows) + self.dataset.start]).to(device)
        return reference_logps(self.reference, batch, device, self.segments)

    def kl_sum(self, model, batch, device, i: int) -> tuple[float, int]:
        """(the sum over a micro-batch's examples of logp(KL_i) - logp_ref(KL_i), their number): the policy's without a
        gradient, a row at a time."""
        present = F.one_hot(batch[3].to(device), self.segments + 1)[..., 2::2].any(1)
        policy = reference_logps(model, batch, device, self.segments)[:, 1::2]
        return float(torch.where(present, policy - self._reference(batch, device, i)[:, 1::2], 0.0).double().sum()), int(present.sum())

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> None:
        """The step's KL estimate over every rank's micro-batches, summed in micro-batch order (the module docstring)."""
        strategy, dtype = self.autocast
        context = nullcontext() if strategy == "fsdp" else runtime_autocast(rt.device, dtype)
        with context:
            # keyed by the micro-batch's index in the step (train.py's reducer.index: j * W + rank), as the loss's `i`
            self.local = {(i := j * rt.world_size + rt.rank): self.kl_sum(model, batch, rt.device, i) for j, batch in enumerate(micro_batches)}
        total, count = 0.0, 0
        for _, (s, n) in sorted((i, part) for gathered in rt.all_gather(self.local) for i, part in gathered.items()):
            total, count = total + s, count + n
        self.kl = torch.tensor(max(total / count, 0.0), dtype=torch.float32)

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        x, y, pos, side, label = (t.to(device, non_blocking=True) for t in batch[:5])
        policy = segment_logps(net(x, positions=pos)[0], y, side, self.segments)[:, 0::2]
        r = policy - self._reference(batch, device, i)[:, 0::2]
        labels = labels_of(side, label, self.segments)
        present, desirable = labels > 0, labels == DESIRABLE
        kl = self.kl.to(device)  # the global batch's (prepare)
        losses = kto_losses(r, kl, desirable, self.cfg)
        loss = torch.where(present, losses, 0.0).sum() * self.micro_batches / self.examples
        with torch.no_grad():
            chosen, rejected = desirable & present, labels == UNDESIRABLE
            rewards = self.cfg.beta * r
            sums = [chosen.sum(), rejected.sum()] + [torch.where(m, v, 0.0).sum() for v in (rewards, policy) for m in (chosen, rejected)]
            rc, rr, lc, lr = sums[2], sums[3], sums[4], sums[5]
            self.stats.append((i, torch.stack([s.double() for s in (sums[0], sums[1], rc, rr, lc, lr)]).cpu()))
        if self.moe is not None:
            loss = loss + self.moe.aux_loss()
        return loss

    def step_metrics(self, rt) -> dict:
        """TRL's figures over the global batch (the desirable's means over the desirable examples, ...), in micro-batch order."""
        total = summed_in_order(rt, self.stats, len(STATS))
        t = dict(zip(STATS, total))
        out = {"kl": float(self.kl)}
        for side in ("chosen", "rejected"):
            if t[side]:
                out[f"rewards/{side}"], out[f"logps/{side}"] = t[f"rewards/{side}"] / t[side], t[f"logps/{side}"] / t[side]
        if t["chosen"] and t["rejected"]:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def states(self) -> dict:
        return {}

    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """After the resume's load: the pinned reference (the policy's start, model.init_from, else the seeded init: TRL's
        when it is given no ref_model), precomputed for the rows the run reads or kept live (as DPO's)."""
        reference, sha, path = pinned_reference(cfg, rt, meta, resumed, agree, tok_files, "", "model.init_from")
        self.autocast = (cfg.dist.strategy, cfg.train.dtype)
        if not self.cfg.precompute:
            self.reference = reference
        else:
            table = tables.table_files(self.dataset, meta.data_fingerprint, sha, f"S{self.segments}", self.autocast, "ref")
            needed = tables.rows_read(len(self.dataset), cfg.train.global_batch, cfg.seed, cfg.data.order, cfg.train.steps) + self.dataset.start
            writer = rt.rank == 0 or (not cfg.data.shared_cache and rt.local_rank == 0)
            self.table = _precomputed(self, reference, rt, table, needed, writer, agree)
        if rt.is_main:
            log.info("train.kto: beta %g, weights %g (desirable) and %g (undesirable); the reference %s (identity %s)%s, %s",
                     self.cfg.beta, self.cfg.desirable_weight, self.cfg.undesirable_weight, path or "the seeded init", sha[:12],
                     ", verified" if resumed else "", "precomputed" if self.cfg.precompute else "live beside the policy")


def _precomputed(kto: KTO, reference, rt, table, needed: np.ndarray, writer: bool, agree) -> np.ndarray:
    return reference_table(kto, UnpairedDataset, reference, rt, table, needed, writer, agree, "train.kto.precompute")


register(ObjectiveSpec(
    name="kto", order=70, summary="KTO over unpaired examples (desirable or not) against a pinned reference",
    docs="docs/preference.md", formats=("unpaired",), classes=(KTO,),
    build=lambda c: KTO(c.dataset, c.micro_batches, c.cfg.train.micro_batch, c.cfg.train.kto, c.model),
    sections={"kto": KTOConfig}, reads={"kto": ALL}, supports=frozenset({"lora"}),
    pins=("the reference's identity (the manifest's reference)", "train.kto.precompute's table beside the packed rows, keyed by it"),
    headline=(("loss", "loss"), ("kl", "kl")),
    matrix=(MatrixValue("kto", "kto"),)))
