"""Next-token prediction, the objective of pretraining and SFT: each micro-batch's loss, and the
validation loss (docs/design.md I15, I17)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import MatrixValue, ObjectiveSpec, register


class NextToken:
    """A micro-batch's loss for text rows (input, target) or chat rows (input, target with -100
    where nothing is taught, positions). For chat data, a step's loss is the sum over every taught
    token of the global batch divided by their global count, never a mean of micro-batch means
    (docs/design.md I17): `begin_step` reads the count from the per-row counts packing stored (no
    collective), and each micro-batch's summed loss is scaled by M / count, so that what the
    reducers average over the M micro-batches is that quotient, whatever the split.

    For an MoE model (`model`: the model itself, not a wrapper) each micro-batch's loss also holds
    its load-balancing loss, MiniMind's, computed on that micro-batch alone; `step_metrics` gives
    the step's mean auxiliary loss and each expert's share of the token slots, summed over every
    rank's micro-batches in micro-batch order: the same bits on any world size (docs/models.md).

    For a mix (data/mix.py) `step_metrics` also gives each source's `loss/<name>`, the mean token
    loss of the step's samples from it (each row's summed loss over its taught tokens, float64,
    summed in micro-batch order), and `tokens/<name>`, the row positions trained on from it since
    the run began: exact on any world size too (docs/data.md)."""

    skip_update = False

    def __init__(self, dataset, micro_batches: int, chat: bool, model=None) -> None:
        self.dataset, self.micro_batches, self.chat = dataset, micro_batches, chat
        self.model = model if model is not None and model.moe_layers() else None
        self.taught: int | None = None
        self.stats: list[tuple[int, torch.Tensor]] = []
        self.mix = dataset if hasattr(dataset, "source_of") else None
        self.rows: list[tuple[int, list[float]]] = []
        self.indices: list[int] = []
        self.step = 0

    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """Nothing beside the model (objectives/dpo.py's reads its reference here)."""

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> None:
        """Nothing before a step's forwards (objectives/grpo.py's rollout is there)."""

    def states(self) -> dict:
        return {}

    def begin_step(self, indices: list[int], step: int = 0) -> None:
        """The step's global sample indices (every rank's micro-batches)."""
        self.taught = self.dataset.taught(indices) if self.chat else None
        self.stats, self.rows, self.indices, self.step = [], [], indices, step

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        """Micro-batch `i`'s loss (`i`: its index in the step, whatever rank computes it)."""
        x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        if not self.chat:
            logits, loss = net(x, y)
        else:
            logits, loss = net(x, y, positions=batch[2].to(device, non_blocking=True), reduction="sum")
            loss = loss * self.micro_batches / self.taught
        if self.mix is not None:  # each row's summed token loss and its taught tokens, for its source's figure
            with torch.no_grad():
                rows = F.cross_entropy(logits.detach().float().flatten(0, 1), y.flatten(), reduction="none").view(len(x), -1)
            self.rows.append((i, list(zip(rows.double().sum(1).tolist(), (y != -100).sum(1).tolist()))))
        if self.model is not None:
            aux = self.model.aux_loss()
            self.stats.append((i, torch.cat([aux.detach().reshape(1), self.model.expert_load()]).float().cpu()))
            loss = loss + aux
        return loss

    def step_metrics(self, rt) -> dict:
        """The step's figures besides its loss (a collective under MoE or a mix; nothing else for a dense model)."""
        out = self.source_metrics(rt) if self.mix is not None else {}
        if self.model is None:
            return out
        rows = sorted((i, row.tolist()) for part in rt.all_gather(self.stats) for i, row in part)
        total = [0.0] * len(rows[0][1])
        for _, row in rows:  # in micro-batch order: the same sum whoever computed what
            total = [a + b for a, b in zip(total, row)]
        return {**out, "moe/aux_loss": total[0] / len(rows), "moe/load": [v / len(rows) for v in total[1:]]}

    def source_metrics(self, rt) -> dict:
        """loss/<name> and tokens/<name> of a mix's step: every rank's rows, summed per source in micro-batch order."""
        rows = [row for _, part in sorted(pair for got in rt.all_gather(self.rows) for pair in got) for row in part]
        names, sources = self.mix.names, self.mix.source_of(self.indices)
        total, count = [0.0] * len(names), [0] * len(names)
        for k, (row, tokens) in zip(sources, rows):  # position order = micro-batch order: the same sum whoever computed what
            total[k] += row
            count[k] += tokens
        seq_len = self.mix.seq_len
        consumed = self.mix.order.counts_at(self.step + 1)
        return {**{f"loss/{n}": total[k] / count[k] for k, n in enumerate(names) if count[k]},
                **{f"tokens/{n}": consumed[k] * seq_len for k, n in enumerate(names)}}


@torch.no_grad()
def evaluate(model, val, micro: int, samples: int, rt, autocast, sharded: bool) -> float:
    """The validation loss: the mean over the first `samples` validation samples (0: all) of each
    sample's mean token loss (over its taught tokens for chat rows). The samples are cut into
    blocks of `micro` whatever the world size, rank r computes blocks b = r (mod W), and every rank
    sums the per-sample losses in sample order (float64): the same number on any world size and in
    both reduction modes, for the same weights and thread count. No training randomness is drawn
    and no training state changes (docs/design.md I15)."""
    n = min(samples or len(val), len(val))
    nblocks = (n + micro - 1) // micro
    blocks = range(rt.rank, nblocks, rt.world_size)
    mine: list[tuple[int, list[float]]] = []
    was_training = model.training
    model.eval()
    # Under fsdp every rank must run each forward (its all-gathers are collectives): a rank with
    # fewer blocks runs its first block again and drops the result.
    rounds = -(-nblocks // rt.world_size) if sharded else len(blocks)
    # Eagerly, compiled or not (a compiled block would compile again for eval mode and the last block's size).
    with torch.random.fork_rng(devices=[rt.device.index] if rt.device.type == "cuda" else []), torch.compiler.set_stance("force_eager"):
        for k in range(rounds):
            b = blocks[k] if k < len(blocks) else None
            at = blocks[0] if b is None and blocks else (b or 0)
            rows = [val[i] for i in range(at * micro, min((at + 1) * micro, n))]
            x = torch.stack([r[0] for r in rows]).to(rt.device)
            y = torch.stack([r[1] for r in rows]).to(rt.device)
            pos = torch.stack([r[2] for r in rows]).to(rt.device) if len(rows[0]) == 3 else None  # chat rows
            with autocast:
                logits, _ = model(x, positions=pos)
            token_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(len(rows), -1).double()
            if b is None:
                continue
            if pos is None:
                mine.append((b, token_loss.mean(1).tolist()))
            else:  # a row's loss: the mean over its taught tokens (cross_entropy gives 0 where the target is -100)
                mine.append((b, (token_loss.sum(1) / (y != -100).sum(1)).tolist()))
    model.train(was_training)
    per_sample = [loss for _, losses in sorted(pair for part in rt.all_gather(mine) for pair in part) for loss in losses]
    total = 0.0
    for loss in per_sample:  # in sample order: the sum does not depend on who computed what
        total += loss
    return total / len(per_sample)


def validation(model, val, micro: int, samples: int, rt, autocast, sharded: bool) -> dict:
    """The figures of a validation: `val_loss` (evaluate's); for a mix's held-out tails
    (data/mix.py MixValidation) also each source's `val_loss/<name>`, over the first `samples` of
    each, and `val_loss` their mean weighted by the samples each evaluated (docs/data.md)."""
    parts = getattr(val, "named_parts", None)
    if not parts:
        return {"val_loss": evaluate(model, val, micro, samples, rt, autocast, sharded)}
    out, total, count = {}, 0.0, 0
    for name, part in parts:  # in the sources' sorted order: the same sum on any world size
        out[f"val_loss/{name}"] = evaluate(model, part, micro, samples, rt, autocast, sharded)
        n = min(samples or len(part), len(part))
        total, count = total + out[f"val_loss/{name}"] * n, count + n
    return {"val_loss": total / count, **out}


register(ObjectiveSpec(
    name="next_token", order=0, summary="pretraining on text, SFT on chat", docs="docs/sft.md", formats=("text", "chat"),
    build=lambda c: NextToken(c.dataset, c.micro_batches, c.cfg.data.format == "chat", c.model), classes=(NextToken,),
    supports=frozenset({"mix", "repack", "eval", "fsdp", "lora", "ft"}),
    headline=(("loss", "loss"), ("val_loss", "val_loss")),
    matrix=(MatrixValue("pretrain", "pretrain"), MatrixValue("mix", "mix"), MatrixValue("sft", "sft"),
            MatrixValue("lora", "lora", ("train.lora.rank=4", "train.lora.targets=q_proj,v_proj")))))
