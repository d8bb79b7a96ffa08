"""Knowledge distillation (docs/distill.md): MiniMind's loss, alpha * CE + (1 - alpha) * T^2 *
KL(teacher || student) at temperature T, on the taught positions, against a frozen teacher of its
own architecture pinned by its identity.

For a taught position (every position of a text row; where the chat rule teaches in a chat row,
MiniMind's loss_mask), with s the student's logits and t the teacher's, truncated to the student's
vocabulary as MiniMind does:
    ce = -log softmax(s)[target],  kl = T^2 * sum_v p(v) (log p(v) - log q(v)),
    p = softmax(t / T), q = softmax(s / T),
and the step's loss is alpha * (sum of ce) + (1 - alpha) * (sum of kl) over the taught positions
of the global batch divided by their count: each micro-batch adds its sums times M / (the step's
taught count, known before the forwards: no collective), so that what the reducers average over
the M micro-batches is that quotient, whatever the split (docs/design.md I17). MiniMind's
`batchmean` divides by each micro-batch's own count instead: equal for one micro-batch, a weighing
of micro-batches on more (docs/distill.md). An MoE student adds alpha * its micro-batch's
load-balancing loss (MiniMind adds it to the CE term). Logged: `ce_loss`, `distill_loss` (the
means of ce and kl over the same positions), `top1_agreement` (the share of them where the
student's and the teacher's most probable ids are the same), summed over every rank's micro-batches
in micro-batch order: the same bits on any world size.

The teacher's logits are a function of the row alone: computed one row at a time (a batch of one,
under the step's autocast, with the packed rows' positions and block-diagonal mask) live under
`torch.inference_mode()` (no graph kept), or with `top_k` > 0 once before training into a table
beside the packed rows (as DPO's reference table, objectives/tables.py: each rank its share of the
rows the run reads, in chunks, each published as it is done by each node's first rank and verified
on every read; named by the rows' fingerprint, the teacher's identity, the autocast and k; stale
tables removed). The table holds each taught position's k largest logits
and their ids; the KL then runs over a teacher whose other logits are -inf (its top k renormalized:
an approximation), through the same arithmetic as the live teacher's, so that top_k = the
vocabulary size gives the live teacher's bits.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from common.outcome import BadInput, attempt
from data.chat import IGNORE
from model.config import ModelConfig
from runtime import autocast as runtime_autocast
from weights import architecture_of

from . import tables
from .reference import pinned_reference, run_tokenizer, source_tokenizer, vocabulary
from .spec import ALL, MatrixValue, ObjectiveSpec, register

log = logging.getLogger("minimind")
KEY = "train.distill.teacher"
ARCHITECTURE_FROM = {"given": "train.distill.teacher_model.* (a weights file carries none)"}


@dataclass
class DistillConfig:
    """train.distill: knowledge distillation's knobs (train.objective=distill; MiniMind's defaults)."""

    teacher: str = ""
    """The teacher: one of our run or checkpoint folders, a Hugging Face folder or a weights file (a MiniMind .pth,
    safetensors). Its architecture is its own (another width, depth, head layout or an MoE), read from the folder;
    a weights file carries none: give it as train.distill.teacher_model.*. Frozen, pinned by its identity."""
    alpha: float = 0.5
    """Weight of the cross-entropy; 1 - alpha weighs the KL to the teacher (MiniMind: 0.5)."""
    temperature: float = 1.5
    """The softmax temperature of both distributions in the KL, whose gradient scale T^2 restores (MiniMind: 1.5)."""
    top_k: int = 0
    """0: the teacher runs live beside the student | k > 0: its k largest logits per taught position are computed once
    before training (beside the packed rows) and the KL runs over them renormalized (an approximation; k = the
    vocabulary size is the live teacher's bits)."""
    teacher_model: ModelConfig = field(default_factory=ModelConfig)
    """The teacher's architecture when train.distill.teacher is a weights file (model.*'s keys and defaults); a
    folder carries its own, and these keys must then stay at their defaults."""

    def __post_init__(self) -> None:
        if isinstance(self.teacher_model, dict):  # a config read back from a manifest
            self.teacher_model = ModelConfig(**self.teacher_model)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"train.distill.alpha: expected a number in [0, 1] (the weight of the cross-entropy), got {self.alpha}")
        if not self.temperature > 0:
            raise ValueError(f"train.distill.temperature: expected a number > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"train.distill.top_k: expected 0 (the live teacher) or a positive k, got {self.top_k}")
        if self.teacher_model.init_from:
            raise ValueError("train.distill.teacher_model.init_from: the teacher's weights are train.distill.teacher's")


def kl_sum(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * the sum over rows of KL(softmax(teacher / T) || softmax(student / T)), in fp32 (a teacher
    logit of -inf is a probability of exactly 0, and adds 0)."""
    p = F.softmax(teacher.float() / temperature, dim=-1)
    log_q = F.log_softmax(student.float() / temperature, dim=-1)
    return temperature ** 2 * F.kl_div(log_q, p, reduction="sum")


def cut_head(model, vocab: int) -> None:
    """The teacher's output head, and the embedding tied to it, cut to its first `vocab` ids (the
    student's): those ids' logits are then the product a teacher without the other ids computes.
    Slicing a wider product's logits is the same arithmetic, but not always the same bits: on some
    CPUs (AVX-512 with AMX, seen here) the matrix product sums in another order for another number
    of output rows (1e-7 apart at 275 against 259 ids)."""
    weight = torch.nn.Parameter(model.output.weight.detach()[:vocab].clone(), requires_grad=False)
    model.tok_embeddings.weight = model.output.weight = weight
    model.tok_embeddings.num_embeddings = model.output.out_features = vocab


def teacher_logits(teacher, x: torch.Tensor, positions: torch.Tensor | None, taught: torch.Tensor, vocab: int) -> torch.Tensor:
    """(taught positions, vocab) fp32 logits of the teacher at the taught positions of rows `x`, in
    row-major order, truncated to the student's `vocab`; each row a forward of its own (a batch of
    one: a function of the row alone), with its positions (packed rows: the block-diagonal mask)."""
    rows = []
    for b in range(len(x)):
        pos = positions[b:b + 1] if positions is not None else None
        rows.append(teacher(x[b:b + 1], positions=pos)[0][0, :, :vocab][taught[b]].float())
    return torch.cat(rows)


class TopK:
    """The precomputed teacher: for each row it holds (sorted `rows`), its taught positions' k largest
    logits and their ids, flat (`offsets[j]:offsets[j + 1]` are row j's positions)."""

    def __init__(self, rows: np.ndarray, offsets: np.ndarray, logits: np.ndarray, ids: np.ndarray) -> None:
        self.rows, self.offsets, self.logits, self.ids = rows, offsets, logits, ids
        self.slot = {int(r): j for j, r in enumerate(rows)}

    @classmethod
    def empty(cls, k: int, vocab: int) -> "TopK":
        ids = np.uint16 if vocab <= 1 << 16 else np.int32
        return cls(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros((0, k), np.float32), np.zeros((0, k), ids))

    @classmethod
    def of(cls, table: tables.Table) -> "TopK":
        return cls(table.rows, table.offsets, table.fields["logits"], table.fields["ids"])

    def teacher(self, rows: list[int], vocab: int, device) -> torch.Tensor:
        """(taught positions of `rows`, vocab): the stored logits at their ids, -inf elsewhere."""
        spans = [(self.offsets[self.slot[r]], self.offsets[self.slot[r] + 1]) for r in rows]
        logits = torch.from_numpy(np.concatenate([self.logits[a:b] for a, b in spans]))
        ids = torch.from_numpy(np.concatenate([self.ids[a:b] for a, b in spans]).astype(np.int64))
        full = torch.full((len(logits), vocab), float("-inf"))
        return full.scatter_(1, ids, logits).to(device)


class Distill:
    """A micro-batch's distillation loss (module docstring); the interface of objectives.NextToken."""

    skip_update = False

    def __init__(self, dataset, micro_batches: int, micro_batch: int, chat: bool, cfg: DistillConfig, model=None) -> None:
        self.dataset, self.micro_batches, self.micro_batch, self.chat, self.cfg = dataset, micro_batches, micro_batch, chat, cfg
        self.moe = model if model is not None and model.moe_layers() else None
        self.vocab = model.cfg.vocab_size if model is not None else 0
        self.teacher = None  # live: the frozen teacher; top_k: the table below
        self.table: TopK | None = None
        self.indices: list[int] = []
        self.taught = 0
        self.stats: list[tuple[int, torch.Tensor]] = []

    def begin_step(self, indices: list[int], step: int = 0) -> None:
        self.indices, self.stats = indices, []
        self.taught = self.dataset.taught(indices) if self.chat else len(indices) * self.dataset.seq_len

    def prepare(self, model, micro_batches: list, rt, agree, stop=None) -> None:
        """Nothing before a step's forwards."""

    def states(self) -> dict:
        return {}

    def _teacher(self, batch, device, i: int, taught: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            rows = self.indices[i * self.micro_batch:(i + 1) * self.micro_batch]
            return self.table.teacher([r + self.dataset.start for r in rows], self.vocab, device)
        x = batch[0].to(device, non_blocking=True)
        pos = batch[2].to(device, non_blocking=True) if self.chat else None
        with torch.inference_mode():  # no graph kept: the teacher is a constant of the step
            out = teacher_logits(self.teacher, x, pos, taught, self.vocab)
        return out.clone()  # an ordinary tensor (autograd may not save inference tensors)

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        """Micro-batch `i`'s loss (`i`: its index in the step, whatever rank computes it)."""
        x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        pos = batch[2].to(device, non_blocking=True) if self.chat else None
        taught = y != IGNORE
        student = net(x, positions=pos)[0][taught].float()
        teacher = self._teacher(batch, device, i, taught)
        ce = F.cross_entropy(student, y[taught], reduction="sum")
        kl = kl_sum(student, teacher, self.cfg.temperature)
        alpha = self.cfg.alpha
        loss = (alpha * ce + (1 - alpha) * kl) * self.micro_batches / self.taught
        with torch.no_grad():
            row = [ce, kl, (student.argmax(-1) == teacher.argmax(-1)).sum(), student.new_tensor(float(len(student)))]
        if self.moe is not None:  # MiniMind adds the student's load-balancing loss to its CE term
            aux = self.moe.aux_loss()
            loss = loss + alpha * aux
            row += [aux, *self.moe.expert_load()]
        self.stats.append((i, torch.stack([v.detach().to("cpu", torch.float64).reshape(()) for v in row])))
        return loss

    def step_metrics(self, rt) -> dict:
        """The step's figures (module docstring): sums over the global batch in micro-batch order."""
        rows = sorted((i, row.tolist()) for part in rt.all_gather(self.stats) for i, row in part)
        total = [0.0] * len(rows[0][1])
        for _, row in rows:  # in micro-batch order: the same sum whoever computed what
            total = [a + b for a, b in zip(total, row)]
        out = {"ce_loss": total[0] / self.taught, "distill_loss": total[1] / self.taught, "top1_agreement": total[2] / self.taught}
        if self.moe is not None:
            out.update({"moe/aux_loss": total[4] / len(rows), "moe/load": [v / len(rows) for v in total[5:]]})
        return out

    # ---------------------------------------------------------------- the teacher

    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """On every rank after the resume's load: the teacher's architecture from its source, its
        weights read (on a resume refused unless its identity is the pinned one), its tokenizer
        checked against the run's; then live, or its top k precomputed for the rows the run reads."""
        got = []

        def architecture() -> None:
            teacher_cfg, where = architecture_of(self.cfg.teacher, self.cfg.teacher_model, cfg.model.seq_len, KEY)
            if where != "given" and self.cfg.teacher_model != ModelConfig():
                raise BadInput(f"train.distill.teacher_model: {self.cfg.teacher} carries its own architecture ({where}): leave "
                               f"train.distill.teacher_model.* unset (they describe a weights file's)")
            if teacher_cfg.vocab_size < self.vocab:
                raise BadInput(f"{KEY}: {self.cfg.teacher} has {teacher_cfg.vocab_size} ids, fewer than the student's "
                               f"{self.vocab} (model.vocab_size, the tokenizer's): a teacher's vocabulary must hold the student's")
            if self.cfg.top_k > self.vocab:
                raise BadInput(f"train.distill.top_k={self.cfg.top_k}: more than the student's {self.vocab} ids (at most "
                               f"{self.vocab}: the whole distribution, the live teacher's bits)")
            got.append((teacher_cfg, where))

        agree(KEY, attempt(architecture))
        teacher_cfg, where = got[0]
        unchecked = []
        teacher, sha, path = pinned_reference(cfg, rt, meta, resumed, agree, tok_files, self.cfg.teacher, KEY, model_cfg=teacher_cfg,
                                              slot="teacher", what="teacher", check=self._tokenizer_check(unchecked),
                                              hint=f"the teacher's architecture: {ARCHITECTURE_FROM.get(where, where)}")
        meta.teacher["architecture"] = teacher_cfg.architecture()
        if teacher_cfg.vocab_size > self.vocab:  # after its identity was checked over every id
            cut_head(teacher, self.vocab)
        self.autocast = (cfg.dist.strategy, cfg.train.dtype)  # the live teacher runs inside the step's autocast: the table too
        if not self.cfg.top_k:
            self.teacher = teacher
        else:
            table = tables.table_files(self.dataset, meta.data_fingerprint, sha, f"K{self.cfg.top_k}", self.autocast, "teacher")
            needed = tables.rows_read(len(self.dataset), cfg.train.global_batch, cfg.seed, cfg.data.order, cfg.train.steps) + self.dataset.start
            writer = rt.rank == 0 or (not cfg.data.shared_cache and rt.local_rank == 0)
            self.table = self._precomputed(teacher, rt, table, needed, writer, agree)
        if rt.is_main:
            arch = teacher_cfg.architecture()
            log.info("train.distill: alpha %g, temperature %g; the teacher %s (identity %s%s; dim %d, %d layers, %d heads%s, %d ids%s; "
                     "%s parameters; architecture from %s), %s", self.cfg.alpha, self.cfg.temperature, path, sha[:12],
                     ", verified" if resumed else "", arch["dim"], arch["n_layers"], arch["n_heads"],
                     f", {arch['moe']['experts']} experts top-{arch['moe']['top_k']}" if arch["moe"] else "", arch["vocab_size"],
                     f" truncated to the student's {self.vocab}" if arch["vocab_size"] > self.vocab else "",
                     f"{teacher.num_parameters():,}", where,
                     f"its top {self.cfg.top_k} precomputed for the {len(needed):,} rows the run reads into {table.name}" if self.cfg.top_k
                     else "live beside the student (replicated on every rank)")
            if unchecked:
                log.warning("%s: %s carries no tokenizer: its first %d ids are taken to be the student's (MiniMind's assumption; "
                            "only the sizes were checked)", KEY, path, self.vocab)

    def _tokenizer_check(self, unchecked: list):
        """The teacher's tokenizer against the run's: the same, or one that gives every id of the
        student's range the same token (a larger vocabulary, truncated); a source that carries no
        tokenizer is noted in `unchecked`."""

        def check(record, tok_files, path, key) -> None:
            theirs, ours = source_tokenizer(record), run_tokenizer(tok_files)
            if theirs is None:
                unchecked.append(path)
                return
            if theirs[1] == ours[1]:
                return
            there, here = vocabulary(theirs[1]), vocabulary(ours[1])
            differs = next((i for i in range(self.vocab) if there.get(i) != here.get(i)), None)
            if differs is not None:
                raise BadInput(f"{key}: {path} was trained with another tokenizer ({theirs[0]}) than this run's ({ours[0]}): id {differs} "
                               f"is {there.get(differs)!r} there, {here.get(differs)!r} here")

        return check

    def _precomputed(self, teacher, rt, table: tables.TableFiles, needed: np.ndarray, writer: bool, agree) -> TopK:
        """The top k of every row in `needed`: the verified chunks of the table read, the missing rows
        computed in chunks, each rank its share, each chunk published as it is done by each node's first
        rank (rank 0 alone with a shared cache): objectives/tables.py. The teacher is not kept:
        training runs one model."""
        k = self.cfg.top_k
        total = self.dataset.start + len(self.dataset)
        rows = type(self.dataset)(self.dataset.bin_path, self.dataset.seq_len, total, dtype=self.dataset.dtype.name)
        strategy, dtype = self.autocast
        autocast = nullcontext() if strategy == "fsdp" else runtime_autocast(rt.device, dtype)
        empty = TopK.empty(k, self.vocab)

        def compute(r: int) -> dict[str, np.ndarray]:
            row = [t.unsqueeze(0).to(rt.device) for t in rows[r]]
            with autocast, torch.inference_mode():
                z = teacher_logits(teacher, row[0], row[2] if self.chat else None, row[1] != IGNORE, self.vocab)
            values, ids = torch.topk(z, k, dim=-1)
            return {"logits": values.cpu().numpy().astype(np.float32), "ids": ids.cpu().numpy().astype(empty.ids.dtype)}

        return TopK.of(tables.precompute(table, needed, compute, {"logits": empty.logits, "ids": empty.ids}, rt, writer, agree,
                                         "train.distill.top_k", ".teacher-"))


def _needs_teacher(train) -> None:
    if not train.distill.teacher:
        raise ValueError("train.distill.teacher: train.objective=distill needs a teacher (one of our run folders, a Hugging Face "
                         "folder or a weights file such as a MiniMind .pth)")


register(ObjectiveSpec(
    name="distill", order=20, summary="a frozen teacher's distribution into the model, on text or chat", docs="docs/distill.md",
    formats=("text", "chat"), classes=(Distill,),
    build=lambda c: Distill(c.dataset, c.micro_batches, c.cfg.train.micro_batch, c.cfg.data.format == "chat", c.cfg.train.distill, c.model),
    sections={"distill": DistillConfig}, reads={"distill": ALL}, supports=frozenset({"eval", "fsdp", "lora"}), check=_needs_teacher,
    pins=("the teacher's identity and architecture (the manifest's teacher)", "train.distill.top_k's table beside the packed rows"),
    headline=(("loss", "loss"), ("agreement", "top1_agreement")), matrix=(MatrixValue("distill", "distill"),)))
