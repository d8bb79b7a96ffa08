"""Direct preference optimization over packed pairs (docs/dpo.md): TRL's sigmoid loss on the sums
of the completions' log-probabilities, against a reference pinned by its hash.

For pair k of a micro-batch row, with logp the sum over the completion's taught tokens,
    delta = (logp(y_w) - logp_ref(y_w)) - (logp(y_l) - logp_ref(y_l)),  loss = -log sigmoid(beta * delta),
and the step's loss is the mean over the global batch's pairs: each micro-batch contributes the
sum of its pairs' losses times M / (the step's pair count, read from what packing stored: no
collective), so that what the reducers average over the M micro-batches is that mean, whatever
the split (as chat data's taught tokens: docs/design.md I17). The rewards TRL logs,
rewards/chosen = beta * (logp(y_w) - logp_ref(y_w)), rewards/rejected, rewards/accuracies (chosen >
rejected) and rewards/margins, are means over the same pairs, summed in micro-batch order over every
rank: the same bits on any world size.

The reference's log-probabilities are a function of the row alone: computed one row at a time
(a batch of one), live (`train.dpo.precompute=false`: a frozen copy beside the policy, eval mode)
or once before training (`precompute`: every rank its share of the rows the run reads, gathered,
and kept in a table beside the packed rows named by the rows' fingerprint, the reference's identity
and the autocast, built in chunks and verified on every read: objectives/tables.py): the same bits
either way, for the same threads and train.dtype.
"""
from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from data.chat import IGNORE
from data.dataset import PreferenceDataset
from runtime import autocast as runtime_autocast

from . import tables
from .reference import pinned_reference
from .spec import ALL, MatrixValue, ObjectiveSpec, register

log = logging.getLogger("minimind")
STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@dataclass
class DPOConfig:
    """train.dpo: the preference objective's knobs (train.objective=dpo)."""

    beta: float = 0.1
    """The DPO temperature (TRL's default 0.1; MiniMind uses 0.15)."""
    reference: str = ""
    """The reference model: any model.init_from source ('' : model.init_from itself, the policy's start, as
    MiniMind and TRL do; with no model.init_from, the seeded init). Pinned by its sha256 in the checkpoint."""
    precompute: bool = True
    """Compute the reference's log-probabilities once before training (beside the packed rows) and train one
    model, not two | false: a live reference forward per row."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"train.dpo.beta must be > 0, got {self.beta}")


def segment_logps(logits: torch.Tensor, targets: torch.Tensor, sides: torch.Tensor, segments: int) -> torch.Tensor:
    """(B, segments) sums of the taught targets' log-probabilities per side of each row (side s in
    column s - 1), in fp32; a fixed-shape sum, so the same bits for the same row whatever else runs."""
    b, t = targets.shape
    lp = -F.cross_entropy(logits.float().reshape(b * t, -1), targets.reshape(-1), ignore_index=IGNORE, reduction="none").view(b, t)
    onehot = F.one_hot(sides, segments + 1)[..., 1:].to(lp.dtype)  # (B, T, S): side 0 (padding) in no column
    return (lp.unsqueeze(-1) * onehot).sum(1)


@torch.no_grad()
def reference_logps(reference, batch, device, segments: int) -> torch.Tensor:
    """The reference's (B, segments) sums, one row at a time (docstring above)."""
    x, y, pos, side = (t.to(device) for t in batch[:4])
    rows = [segment_logps(reference(x[b:b + 1], positions=pos[b:b + 1])[0], y[b:b + 1], side[b:b + 1], segments) for b in range(len(x))]
    return torch.cat(rows)


class DPO:
    """A micro-batch's DPO loss (module docstring); the interface of objectives.NextToken."""

    skip_update = False

    def __init__(self, dataset, micro_batches: int, micro_batch: int, cfg: DPOConfig, model=None) -> None:
        self.dataset, self.micro_batches, self.micro_batch, self.cfg = dataset, micro_batches, micro_batch, cfg
        self.segments = 2 * dataset.max_pairs
        self.policy = model  # the model being trained (the reference is a frozen copy of another's weights, never it)
        self.moe = model if model is not None and model.moe_layers() else None
        self.reference = None  # live: a frozen model; precompute: the table below
        self.table: np.ndarray | None = None
        self.indices: list[int] = []
        self.pairs = 0
        self.stats: list[tuple[int, torch.Tensor]] = []

    def begin_step(self, indices: list[int], step: int = 0) -> None:
        self.indices, self.pairs, self.stats = indices, self.dataset.pairs(indices), []

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> None:
        """Nothing before a step's forwards."""

    def states(self) -> dict:
        return {}

    def _reference(self, batch, device, i: int) -> torch.Tensor:
        if self.table is not None:
            rows = self.indices[i * self.micro_batch:(i + 1) * self.micro_batch]
            return torch.from_numpy(self.table[np.asarray(rows) + self.dataset.start]).to(device)
        return reference_logps(self.reference, batch, device, self.segments)

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        x, y, pos, side = (t.to(device, non_blocking=True) for t in batch[:4])
        policy = segment_logps(net(x, positions=pos)[0], y, side, self.segments)
        ref = self._reference(batch, device, i)
        present = F.one_hot(side, self.segments + 1)[..., 1::2].any(1)  # (B, pairs): the row has pair k
        chosen, rejected = policy[:, 0::2] - ref[:, 0::2], policy[:, 1::2] - ref[:, 1::2]
        delta = chosen - rejected
        losses = -F.logsigmoid(self.cfg.beta * delta)
        loss = torch.where(present, losses, 0.0).sum() * self.micro_batches / self.pairs
        with torch.no_grad():
            rc, rr = self.cfg.beta * chosen, self.cfg.beta * rejected
            sums = [torch.where(present, v, 0.0).sum() for v in (losses, rc, rr, (rc > rr).float(), rc - rr)]
            self.stats.append((i, torch.stack(sums).double().cpu()))
        if self.moe is not None:
            loss = loss + self.moe.aux_loss()
        return loss

    def step_metrics(self, rt) -> dict:
        """The step's rewards (TRL's names): means over the global batch's pairs, summed in micro-batch order."""
        total = summed_in_order(rt, self.stats, len(STATS))
        return {name: v / self.pairs for name, v in zip(STATS[1:], total[1:])}

    # ---------------------------------------------------------------- the reference

    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """On every rank after the resume's load: read the reference (train.dpo.reference, else
        model.init_from, else the seeded init; on a resume, refused unless its identity is the one
        the checkpoint pinned), then precompute its log-probabilities for the rows the run reads,
        or keep it live."""
        reference, sha, path = pinned_reference(cfg, rt, meta, resumed, agree, tok_files, self.cfg.reference, "train.dpo.reference")
        # The reference runs under the policy's autocast live (inside the step's), so the table is
        # computed under the same one: the same bits either way (under fsdp neither has autocast).
        self.autocast = (cfg.dist.strategy, cfg.train.dtype)
        if not self.cfg.precompute:
            self.reference = reference
        else:
            table = tables.table_files(self.dataset, meta.data_fingerprint, sha, f"S{self.segments}", self.autocast, "ref")
            needed = tables.rows_read(len(self.dataset), cfg.train.global_batch, cfg.seed, cfg.data.order, cfg.train.steps) + self.dataset.start
            writer = rt.rank == 0 or (not cfg.data.shared_cache and rt.local_rank == 0)
            self.table = _precomputed(self, reference, rt, table, needed, writer, agree)
        if rt.is_main:
            log.info("train.dpo: beta %g; the reference %s (identity %s)%s, %s", self.cfg.beta, path or "the seeded init",
                     sha[:12], ", verified" if resumed else "",
                     f"precomputed for the {len(needed):,} rows the run reads into {table.name}" if self.cfg.precompute
                     else "live beside the policy")


def summed_in_order(rt, stats: list, width: int) -> list[float]:
    """Every rank's (micro-batch index, figures) rows summed in micro-batch order: the same sums on any world size."""
    rows = sorted((i, row.tolist()) for part in rt.all_gather(stats) for i, row in part)
    total = [0.0] * width
    for _, row in rows:
        total = [a + b for a, b in zip(total, row)]
    return total


def _precomputed(dpo: DPO, reference, rt, table: tables.TableFiles, needed: np.ndarray, writer: bool, agree) -> np.ndarray:
    return reference_table(dpo, PreferenceDataset, reference, rt, table, needed, writer, agree, "train.dpo.precompute")


def reference_table(objective, dataset_type, reference, rt, table: tables.TableFiles, needed: np.ndarray, writer: bool, agree,
                    key: str) -> np.ndarray:
    """The reference sums of every row in `needed` (a row not computed is NaN) of a pinned-reference objective
    (DPO, KTO: its `dataset`, `autocast`, `segments`; the rows read as `dataset_type`): the verified chunks
    of the table read, the missing rows computed in chunks, each rank its share, each chunk published
    as it is done by each node's first rank (rank 0 alone with a shared cache): objectives/tables.py."""
    total = objective.dataset.start + len(objective.dataset)
    rows = dataset_type(objective.dataset.bin_path, objective.dataset.seq_len, total, dtype=objective.dataset.dtype.name)
    strategy, dtype = objective.autocast
    autocast = nullcontext() if strategy == "fsdp" else runtime_autocast(rt.device, dtype)

    def compute(k: int) -> dict[str, np.ndarray]:
        with autocast:
            return {"logps": reference_logps(reference, [t.unsqueeze(0) for t in rows[k]], rt.device, objective.segments).cpu().numpy()}

    empty = {"logps": np.zeros((0, objective.segments), np.float32)}
    got = tables.precompute(table, needed, compute, empty, rt, writer, agree, key, ".ref-")
    have = np.full((total, objective.segments), np.nan, dtype=np.float32)
    keep = got.rows < total
    have[got.rows[keep]] = got.fields["logps"][keep]
    return have


def ln2() -> float:
    """The loss of a policy equal to its reference: -log sigmoid(0)."""
    return math.log(2.0)


register(ObjectiveSpec(
    name="dpo", order=10, summary="DPO over preference pairs against a pinned reference", docs="docs/dpo.md", formats=("preference",),
    build=lambda c: DPO(c.dataset, c.micro_batches, c.cfg.train.micro_batch, c.cfg.train.dpo, c.model), classes=(DPO,),
    sections={"dpo": DPOConfig}, reads={"dpo": ALL}, supports=frozenset({"fsdp", "lora"}),
    pins=("the reference's identity (the manifest's reference)", "train.dpo.precompute's table beside the packed rows, keyed by it"),
    headline=(("loss", "loss"), ("accuracy", "rewards/accuracies")),
    matrix=(MatrixValue("dpo_live", "dpo", ("train.dpo.precompute=false",)), MatrixValue("dpo_pre", "dpo"))))
