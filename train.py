"""Train the MiniMind-style LM, resumably.

    python train.py --config configs/tiny.yaml [key=value ...]
    torchrun --standalone --nproc_per_node=N train.py --config configs/tiny.yaml [key=value ...]

Stop it at any moment and run the same command again: it resumes from the newest valid checkpoint
in out_dir and ends bit-for-bit where the uninterrupted run would (docs/resuming.md).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from torch.utils.data import DataLoader
from tqdm import tqdm

import runtime
import tracking
import weights
from checkpoint import (EXIT_STOPPED, CheckpointError, CheckpointManager, CheckpointMismatch, Resumed, RunMeta, StopFlag,
                        model_sha256, new_run_id, runfolder)
from checkpoint.files import atomic_write
from checkpoint.stop import ignore_stop_signals
from configs import Config, ConfigError, TrainConfig, describe, load_config, load_tokenizer, to_dict
from data.run import data_of_run
from data import BatchPlan, BatchPlanError, BlockDistributedSampler, DataError, PackedDataset, SkipBatchSampler, unigram_entropy
from model import MiniMindLM
from model.formats import WeightsError

log = logging.getLogger("minimind")


def lr_at(step: int, t: TrainConfig) -> float:
    """LR of optimizer step `step` (0-based): linear warm-up, then cosine down to min_lr_ratio * lr.
    A pure function of the step (docs/design.md I5), so only the step is saved."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


@torch.no_grad()
def evaluate(cfg: Config, rt: runtime.Runtime, run: "Run") -> float:
    """The validation loss: the mean over the first eval.samples validation samples of each
    sample's mean token loss. The samples are cut into blocks of train.micro_batch whatever the
    world size, rank r computes blocks b = r (mod W), and every rank sums the per-sample losses in
    sample order (float64): the same number on any world size and in both reduction modes, for the
    same weights and thread count. No training randomness is drawn and no training state changes."""
    val, m = run.val_dataset, cfg.train.micro_batch
    n = min(cfg.eval.samples or len(val), len(val))
    blocks = range(rt.rank, (n + m - 1) // m, rt.world_size)
    autocast = runtime.autocast(rt.device, cfg.train.dtype)
    mine: list[tuple[int, list[float]]] = []
    was_training = run.model.training
    run.model.eval()
    # Under fsdp every rank must run each forward (its all-gathers are collectives): a rank with
    # fewer blocks runs its first block again and drops the result.
    rounds = -(-((n + m - 1) // m) // rt.world_size) if run.sharded else len(blocks)
    with torch.random.fork_rng(devices=[rt.device.index] if rt.device.type == "cuda" else []):
        for k in range(rounds):
            b = blocks[k] if k < len(blocks) else None
            first = blocks[0] if blocks else 0
            pairs = [val[i] for i in range((first if b is None else b) * m, min(((first if b is None else b) + 1) * m, n))]
            x = torch.stack([p[0] for p in pairs]).to(rt.device)
            y = torch.stack([p[1] for p in pairs]).to(rt.device)
            pos = torch.stack([p[2] for p in pairs]).to(rt.device) if len(pairs[0]) == 3 else None  # chat rows
            with autocast:
                logits, _ = run.model(x, positions=pos)
            token_loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            token_loss = token_loss.view(len(pairs), -1).double()
            if b is None:
                continue
            if pos is None:
                mine.append((b, token_loss.mean(1).tolist()))
            else:  # a row's loss: the mean over its taught tokens (cross_entropy gives 0 where the target is -100)
                mine.append((b, (token_loss.sum(1) / (y != -100).sum(1)).tolist()))
    run.model.train(was_training)
    per_sample = [loss for _, losses in sorted(pair for part in rt.all_gather(mine) for pair in part) for loss in losses]
    total = 0.0
    for loss in per_sample:  # in sample order: the sum does not depend on who computed what
        total += loss
    return total / len(per_sample)


@dataclass
class TrainState:
    """Where the run is (docs/design.md I2): optimizer steps done (the LR is a function of it, I5), and the
    data position: the epoch of the last step and the samples of that epoch consumed so far, which
    is what a resume continues the data from. `metrics.jsonl` logs the same two after each step."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.samples_seen = int(state["step"]), int(state["epoch"]), int(state["samples_seen"])

    def position(self, plan: BatchPlan, steps_per_epoch: int) -> tuple[int, int]:
        """(epoch, step in that epoch) where the data continues: a finished epoch continues at the next."""
        done = self.samples_seen // plan.global_batch
        return (self.epoch + 1, 0) if done >= steps_per_epoch else (self.epoch, done)


def step_batches(dataset, sampler: BlockDistributedSampler, epoch: int, first: int, cfg: Config, rt) -> Iterator[tuple[int, int, list]]:
    """(epoch, step_in_epoch, this rank's micro-batches) for every optimizer step from step `first`
    of `epoch` on.

    Each epoch gets a fresh loader over `sampler.set_epoch(epoch)` and a SkipBatchSampler that skips
    what this rank's stream already consumed: `step_in_epoch * accum` (docs/design.md I4).
    """
    plan, spe = sampler.plan, sampler.plan.steps_per_epoch(len(dataset))
    while True:
        sampler.set_epoch(epoch)  # before the loader's iterator exists, so workers prefetch this epoch
        loader = DataLoader(
            dataset, batch_sampler=SkipBatchSampler(sampler, first * plan.accum), num_workers=cfg.data.num_workers,
            pin_memory=rt.device.type == "cuda", generator=torch.Generator().manual_seed(cfg.seed + epoch),
            # A SIGTERM to the whole process group must reach the trainer's stop flag, not kill the
            # loader's workers mid-batch; the trainer shuts them down itself.
            worker_init_fn=ignore_stop_signals if cfg.data.num_workers else None,
        )
        it = iter(loader)
        for s in range(first, spe):
            yield epoch, s, [next(it) for _ in range(plan.accum)]
        epoch, first = epoch + 1, 0


# What a resume checks against the checkpoint (dotted paths into the resume file -> the name users know).
MUST_MATCH = {"config.seed": "seed", "global_batch": "train.global_batch",
              **{f"data_fingerprint.{k}": f"data {k}" for k in ("source_sha256", "files", "tokenizer", "seq_len", "num_samples", "options")},
              "data_fingerprint.order": "data.order"}
_DIFFERS = "the optimization from here on differs from the uninterrupted run"
MAY_CHANGE = {
    "config.train.steps": ("train.steps", "the LR schedule from here on spans the new count"),
    "config.train.dtype": ("train.dtype", "autocast changes the arithmetic: not bit-identical to the uninterrupted run"),
    **{f"config.train.{k}": (f"train.{k}", _DIFFERS)
       for k in ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")},
    "threads": ("intra-op threads per process", "floating-point results differ, so bit-equality with an uninterrupted run is not promised"),
    "config.dist.reduce": ("dist.reduce", "the gradients are summed in another order: not bit-identical to the uninterrupted run"),
    "config.runtime.deterministic": ("runtime.deterministic", "other kernels may run: bit-equality with the uninterrupted run is not promised"),
}


@dataclass
class Run:
    """Everything a run is built from; `states` is what a checkpoint holds."""

    dataset: PackedDataset
    val_dataset: PackedDataset | None
    plan: BatchPlan
    steps_per_epoch: int
    model: MiniMindLM
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    train_state: TrainState
    ckpt: CheckpointManager
    unigram_entropy: float
    sharded: bool = False

    @property
    def states(self) -> dict:
        if self.sharded:  # model and optimizer in one state, saved shard by shard (runtime/sharding.py)
            return {"sharded": runtime.sharding.ShardedState(self.model, self.opt), "train": self.train_state}
        return {"model": self.model, "optimizer": self.opt, "train": self.train_state, **({"scaler": self.scaler} if self.scaler else {})}


def build(cfg: Config, rt: runtime.Runtime) -> Run:
    tok = load_tokenizer(cfg)
    dataset, val_dataset, fingerprint = data_of_run(cfg.data, cfg.model.seq_len, cfg.seed, cfg.dist.timeout_s, rt, tok)
    plan = BatchPlan(cfg.train.global_batch, cfg.train.micro_batch, rt.world_size)
    spe = plan.steps_per_epoch(len(dataset))
    if spe == 0:
        raise BatchPlanError(f"data: {len(dataset)} samples do not fill one global batch of {plan.global_batch}")
    runtime.seed_all(cfg.seed)  # identical model init on every rank
    model = MiniMindLM(cfg.model).to(rt.device)
    fsdp = cfg.dist.strategy == "fsdp"
    if fsdp:  # before the optimizer, which then holds the shards
        runtime.sharding.shard(model, cfg.train.dtype, cfg.dist.reshard_after_forward)
    scaler = torch.amp.GradScaler(rt.device.type) if cfg.train.dtype == "float16" else None
    meta = RunMeta(rt.world_size, plan.global_batch, plan.micro_batch, plan.accum, rt.threads, cfg.dist.reduce,
                   to_dict(cfg), fingerprint, rt.broadcast(new_run_id()), MUST_MATCH | {
                       # model.init_from is where a run began: a resume continues it whatever the key says now
                       f"config.model.{k}": f"model.{k}" for k in to_dict(cfg.model) if k != "init_from"}, MAY_CHANGE, tok.files)
    ckpt = CheckpointManager(cfg.checkpoint, Path(cfg.out_dir), rt, meta)
    chat = cfg.data.format == "chat"  # the unigram entropy is the pretraining yardstick; a chat run's is its taught tokens'
    entropy = unigram_entropy(dataset.bin_path, len(dataset) * (cfg.model.seq_len + 1), dataset.dtype) if rt.is_main and not chat else float("nan")
    run = Run(dataset, val_dataset, plan, spe, model, make_optimizer(model, cfg.train), scaler, TrainState(), ckpt, entropy, fsdp)
    if rt.is_main:
        log.info("model: %s parameters | world size %d (%s, %s, %d threads/process) | dist.reduce=%s",
                 f"{model.num_parameters():,}", rt.world_size, rt.backend or "no process group", rt.device, rt.threads, cfg.dist.reduce)
        log.info("data: %d samples of %d tokens, %d steps/epoch | global batch %d = micro %d x accum %d x world %d",
                 len(dataset), cfg.model.seq_len, spe, plan.global_batch, plan.micro_batch, plan.accum, rt.world_size)
        if not chat:
            log.info("data: unigram entropy of the corpus %.4f nats/token (a model that beats it has learnt context)", entropy)
        else:
            m = fingerprint
            log.info("data: %d conversations, %d of %d tokens taught (data.loss_on=%s), %.1f%% of the rows' positions padding",
                     m["conversations"], m["taught"], m["tokens"], cfg.data.loss_on, 100 * m["padding"] / max(1, m["tokens"] + m["padding"]))
    return run


def make_reducer(cfg: Config, rt: runtime.Runtime, run: Run):
    """DDP or the canonical reduction, wrapped after the load so that every rank starts from the same weights."""
    if run.sharded:
        kind = runtime.sharding.FSDPReduce if cfg.dist.reduce == "ddp" else runtime.sharding.FSDPCanonicalReduce
        return kind(run.model, rt, run.plan.accum)
    if cfg.dist.reduce == "ddp":
        return runtime.DDPReduce(run.model, rt, run.plan.accum)
    hashes = rt.all_gather(model_sha256(run.model.state_dict()))
    if len(set(hashes)) > 1:
        raise RuntimeError(f"dist.reduce=canonical: ranks hold different weights at step {run.train_state.step}: {hashes}")
    reducer = runtime.CanonicalReduce(run.model, rt, run.plan.accum)
    if rt.is_main:
        log.info("canonical reduce: gradient buffers %.1f MiB per rank (M=%d micro-batches x %s parameters)",
                 reducer.buffer_bytes / 2**20, run.plan.micro_batches, f"{reducer.numel:,}")
    return reducer


def train_step(cfg: Config, rt: runtime.Runtime, run: Run, reducer, micro_batches: list, epoch: int, s: int,
               taught: int | None = None) -> float:
    """Forward/backward over this rank's micro-batches, reduce, clip, optimizer step. Returns the
    step's loss, averaged over the global batch: over its tokens, or for chat data over its `taught`
    tokens (the global count: each micro-batch's summed loss is scaled by M / taught, so what the
    reducers average over the M micro-batches is the sum over every taught token / their count,
    whatever the split; docs/design.md I17)."""
    # Under fsdp the precision is FSDP's mixed-precision policy (runtime/sharding.py), not autocast.
    autocast = contextlib.nullcontext() if run.sharded else runtime.autocast(rt.device, cfg.train.dtype)
    rng_devices = [rt.device.index] if rt.device.type == "cuda" else []
    scaler = run.scaler
    for j, batch in enumerate(micro_batches):
        i = j * rt.world_size + rt.rank  # this micro-batch's index in the step, whatever W (docs/design.md I4)
        x, y = batch[0].to(rt.device, non_blocking=True), batch[1].to(rt.device, non_blocking=True)
        # In-step randomness (dropout) is a function of (seed, epoch, step, i), on whichever rank (docs/design.md I6).
        with torch.random.fork_rng(devices=rng_devices), reducer.no_sync(j):
            torch.manual_seed(runtime.derive_seed(cfg.seed, epoch, s, i))
            with autocast:
                if taught is None:
                    _, loss = reducer.net(x, y)
                else:
                    _, loss = reducer.net(x, y, positions=batch[2].to(rt.device, non_blocking=True), reduction="sum")
                    loss = loss * run.plan.micro_batches / taught
            reducer.backward(loss, j, scaler.scale if scaler else None)
    loss = reducer.reduce()
    if scaler:
        scaler.unscale_(run.opt)
    if cfg.train.grad_clip:
        reducer.clip(cfg.train.grad_clip)
    if scaler:
        scaler.step(run.opt)
        scaler.update()
    else:
        run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return loss


class Metrics:
    """OUT/metrics.jsonl, one line per optimizer step, the tracker's curves and the human lines: rank 0 only."""

    def __init__(self, cfg: Config, rt: runtime.Runtime, run: Run, sampler: BlockDistributedSampler, start: int) -> None:
        self.cfg, self.run, self.sampler = cfg, run, sampler
        self.file = open(Path(cfg.out_dir) / runfolder.METRICS, "a") if rt.is_main else None
        # Watching does not touch training (docs/design.md I15): the tracker starts after the load, with
        # the checkpoint's run id, and purges or rewinds what a killed run logged past it.
        self.tracker = tracking.open_tracker(cfg.log.tracker, Path(cfg.out_dir), cfg.log.project, run.ckpt.meta.run_id,
                                             start, to_dict(cfg)) if rt.is_main else tracking.Tracker()
        # The bar starts at the resumed step; on a terminal only (a log file gets the step lines).
        self.bar = tqdm(total=cfg.train.steps, initial=start, dynamic_ncols=True, mininterval=1.0,
                        disable=not (rt.is_main and cfg.log.progress and sys.stderr.isatty()))
        self.t0 = time.perf_counter()
        self.losses: list[float] = []
        self.val_loss: tuple[int, float] | None = None

    def step(self, state: TrainState, s: int, loss: float, lr: float, seconds: float, val_loss: float | None) -> None:
        self.losses.append(loss)
        if val_loss is not None:
            self.val_loss = (state.step, val_loss)
        self.bar.update(1)
        if not self.file:
            return
        g, seq, step, epoch = self.run.plan.global_batch, self.cfg.model.seq_len, state.step, state.epoch
        rec = {"step": step, "epoch": epoch, "loss": loss, "lr": lr, "samples_seen": state.samples_seen,
               **({"val_loss": val_loss} if val_loss is not None else {}),
               # timing fields: the only ones that differ between an interrupted run and the one that was not
               "tokens_per_s": round(g * seq / seconds, 1), "step_s": round(seconds, 5),
               "elapsed_s": round(time.perf_counter() - self.t0, 4)}
        if self.cfg.log.sample_ids:
            rec["sample_ids"] = self.sampler.step_indices(s)
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        self.tracker.log(step, {k: rec[k] for k in ("loss", "lr", "tokens_per_s", "val_loss") if k in rec})
        if step % self.cfg.log.every == 0 or step == self.cfg.train.steps:
            log.info("step %d/%d | epoch %d | loss %.4f | lr %.2e | %s tok/s%s", step, self.cfg.train.steps, epoch, loss, lr,
                     f"{rec['tokens_per_s']:,.0f}", f" | val loss {val_loss:.4f}" if val_loss is not None else "")

    def close(self) -> None:
        self.bar.close()
        self.tracker.close()
        if self.file:
            self.file.close()


def train(cfg: Config, rt: runtime.Runtime, stop: StopFlag) -> tuple[str, int]:
    """The run, from build to the last save. Returns how it ended (finished, halted, stopped) and its step."""
    run = build(cfg, rt)
    resumed = run.ckpt.load(run.states)
    start_from_weights(cfg, rt, run, resumed)
    if rt.is_main:  # after the load: a run that cannot resume leaves the folder as it found it
        source = run.ckpt.meta.init_from
        head = f"# model.init_from: {source['path']} (sha256 {source['sha256']}, {source['format']})\n" if source else ""
        resolved = to_dict(cfg)
        resolved["model"]["init_from"] = source["path"] if source else ""  # the source this run used, not what the key says now
        atomic_write(Path(cfg.out_dir) / runfolder.CONFIG, head + yaml.safe_dump(resolved, sort_keys=False))
    epoch, first = run.train_state.position(run.plan, run.steps_per_epoch)
    if resumed:
        log_position(resumed, run, epoch, first)
    reducer = make_reducer(cfg, rt, run)
    sampler = BlockDistributedSampler(len(run.dataset), run.plan, rt.rank, cfg.seed, cfg.data.order)
    step = start = run.train_state.step
    metrics = Metrics(cfg, rt, run, sampler, start)
    halted = 0 < cfg.train.halt_at <= start
    if halted:
        log.warning("train.halt_at=%d is not after the resumed step %d: nothing to do", cfg.train.halt_at, start)
    todo = start < cfg.train.steps and not halted
    reason = None
    run.model.train()
    stop.under_way()  # set-up is over: a signal from here on is voted on at the step boundary
    for epoch, s, micro_batches in step_batches(run.dataset, sampler, epoch, first, cfg, rt) if todo else ():
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.train)
        for group in run.opt.param_groups:
            group["lr"] = lr
        taught = run.dataset.taught(sampler.step_indices(s)) if cfg.data.format == "chat" else None
        loss = train_step(cfg, rt, run, reducer, micro_batches, epoch, s, taught)
        step += 1
        seconds = time.perf_counter() - t0
        # The state a checkpoint holds: taken after optimizer.step(), with no gradient pending (docs/design.md I7).
        run.train_state.step, run.train_state.epoch, run.train_state.samples_seen = step, epoch, (s + 1) * run.plan.global_batch
        evaluating = cfg.eval.interval and (step % cfg.eval.interval == 0 or step == cfg.train.steps)
        metrics.step(run.train_state, s, loss, lr, seconds, evaluate(cfg, rt, run) if evaluating else None)
        end = "halted" if step == cfg.train.halt_at else "finished" if step == cfg.train.steps else None
        reason = run.ckpt.after_step(step, run.states, stop.poll(), end)
        if reason:
            break
    metrics.close()
    report(cfg, rt, stop, reason, step, metrics, run.unigram_entropy)
    return reason or ("halted" if halted else "finished"), step


def start_from_weights(cfg: Config, rt: runtime.Runtime, run: Run, resumed: Resumed | None) -> None:
    """model.init_from: a fresh run loads the weights (every rank reads and checks them; all fail
    together); a resumed run has them in its checkpoint and its record of the source, and never
    reads the source again."""
    source = run.ckpt.meta.init_from
    if resumed:
        if source and rt.is_main:
            log.info("the run began from %s (sha256 %s); resumed from its checkpoint, the source is not read again",
                     source["path"], source["sha256"][:12])
        elif cfg.model.init_from and rt.is_main:
            log.warning("model.init_from=%s is ignored: this run began from its seeded init and resumes from its checkpoint",
                        cfg.model.init_from)
        return
    if not cfg.model.init_from:
        return
    record, error, whole = None, None, None
    try:
        if run.sharded:  # read into a whole model, handed to the shards once every rank has it
            whole = MiniMindLM(cfg.model)
            record = weights.init_from(whole, cfg.model.init_from)
        else:
            record = weights.init_from(run.model, cfg.model.init_from)
    except (WeightsError, CheckpointError) as e:
        error = (type(e).__name__, str(e))
    failed = [e for e in rt.all_gather(error) if e]
    if failed:
        kind, message = failed[0]
        raise (WeightsError if kind == "WeightsError" else CheckpointError)(message)
    if whole is not None:
        runtime.sharding.load_full(run.model, whole.state_dict())
    run.ckpt.meta.init_from = record
    if rt.is_main:
        log.info("model.init_from: %s weights from %s (sha256 %s); optimizer, LR schedule and data start fresh",
                 record["format"], record["path"], record["sha256"][:12])


def log_position(resumed: Resumed, run: Run, epoch: int, first: int) -> None:
    """Where the data continues, and the world-size rescale that gets it there (docs/design.md I4)."""
    t, plan = run.train_state, run.plan
    where = (f"step {t.step} resumes at sample {first * plan.global_batch} of epoch {epoch}, "
             f"skipping {first * plan.accum} micro-batches per rank")
    if resumed.world_size != plan.world_size or resumed.micro_batch != plan.micro_batch:
        log.info("world size %d → %d, micro batch %d → %d: %s", resumed.world_size, plan.world_size,
                 resumed.micro_batch, plan.micro_batch, where)
    else:
        log.info("%s", where)
    if epoch * run.steps_per_epoch + first != t.step:
        log.warning("the saved data position (epoch %d, %d samples in) is not where step %d would be: the data "
                    "continues from the saved position", t.epoch, t.samples_seen, t.step)


def report(cfg: Config, rt: runtime.Runtime, stop: StopFlag, reason: str | None, step: int, metrics: Metrics, entropy: float) -> None:
    losses = metrics.losses
    if reason == "stopped" and stop.poll():  # this rank was signalled: it knows when
        (log.info if rt.is_main else log.warning)(
            "stopped on %s at step %d: checkpoint published %.2fs after the signal; exit %d (resume me)",
            stop.signal, step, time.monotonic() - stop.received_at, EXIT_STOPPED)
    elif reason == "stopped" and rt.is_main:
        log.info("stopped on a signal to another rank at step %d: checkpoint published; exit %d (resume me)", step, EXIT_STOPPED)
    elif rt.is_main and losses:
        tail = losses[-min(10, len(losses)):]
        val = metrics.val_loss
        yardstick = f"the corpus's unigram entropy: {entropy:.4f}" if entropy == entropy else "over the taught tokens"
        log.info("%s at step %d: loss %.4f, mean of the last %d steps %.4f (%s)%s",
                 reason, step, losses[-1], len(tail), sum(tail) / len(tail), yardstick,
                 f"; validation loss {val[1]:.4f} at step {val[0]}" if val else "")
    elif rt.is_main:
        log.info("nothing to do: the run is at step %d of %d", step, cfg.train.steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="keys (key=value overrides the YAML):\n" + describe(),
    )
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML file (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. train.lr=3e-4")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = StopFlag()  # first: a signal during set-up ends the launch with 75 (see checkpoint/stop.py)
    rt = lock = None
    clean = False  # every rank reached the end together
    try:
        rt = runtime.setup(cfg)
        runtime.setup_logging(rt)
        lock = take_run_folder(cfg, rt)
        state, step = train(cfg, rt, stop)
        code = runfolder.EXIT_CODES[state]
        if lock:
            runfolder.write_status(lock.out_dir, state, step, code)
        clean = True
        return code
    except BaseException as e:
        if stop.signal is not None and stop.setup:
            # Stopped before the run was under way (StopDuringSetup, or whatever a peer's leaving on
            # its own signal made fail here): nothing to save, the previous checkpoint stands.
            cause = f"stopped on {stop.signal} during set-up: nothing to save; the previous checkpoint (if any) stands"
            say(rt, logging.WARNING, f"{cause}; exit {EXIT_STOPPED} (resume me)")
            if lock:
                runfolder.write_status(lock.out_dir, "stopped", None, EXIT_STOPPED, cause)
            return EXIT_STOPPED
        if isinstance(e, KNOWN_ERRORS):
            say(rt, logging.ERROR, f"error: {e}")
            # 1: a damaged checkpoint or an I/O failure; 2: bad input or config
            code = 1 if isinstance(e, OSError) or (isinstance(e, CheckpointError) and not isinstance(e, CheckpointMismatch)) else 2
            if lock:
                runfolder.write_status(lock.out_dir, "failed", None, code, str(e))
            return code
        # a bug: the traceback goes on, the status says it failed
        if lock:
            runfolder.write_status(lock.out_dir, "failed", None, 1, f"{type(e).__name__}: {e}")
        raise
    finally:
        if rt is not None:
            runtime.teardown(rt, clean)
        if lock:
            lock.release()
        stop.restore()


KNOWN_ERRORS = (ConfigError, runtime.SetupError, DataError, BatchPlanError, CheckpointError, runfolder.RunFolderError, WeightsError,
                OSError)
"""Errors with a message for the user (no traceback): exit 2 for bad input, 1 for I/O and damaged checkpoints."""


def say(rt: runtime.Runtime | None, level: int, message: str) -> None:
    """A line to the log, or to stderr before logging is set up."""
    if rt is None:
        print(message, file=sys.stderr)
    else:
        log.log(level, "%s", message)


def take_run_folder(cfg: Config, rt: runtime.Runtime) -> runfolder.RunLock | None:
    """Global rank 0 locks out_dir before anything touches it (docs/design.md I12); every rank learns
    the outcome, so all of them refuse together when another run holds the folder."""
    lock, outcome = None, None
    if rt.is_main:
        try:
            lock = runfolder.acquire(Path(cfg.out_dir), cfg.checkpoint.lock_timeout_s)
            runfolder.write_status(lock.out_dir, "running")
        except (runfolder.RunFolderError, OSError) as e:
            outcome = str(e)
    outcome = rt.broadcast(outcome)
    if outcome:
        raise runfolder.RunFolderError(outcome)
    return lock


def exit_now(code: int) -> None:
    """Exit with `code` once everything is written, skipping the interpreter's teardown.

    Every file is closed and fsynced, the process group destroyed and the run folder's lock
    released before this point. What is skipped is the finalization of torch's C++ objects, where a
    gloo worker rank sometimes aborted ("terminate called without an active exception", SIGABRT,
    seen twice in about 300 launches here, after a clean finish and a published checkpoint), which
    turned a finished run into a failed one for torchrun."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    ignore_stop_signals()  # see its docstring: exit with `code`, not with torchrun's late SIGTERM
    exit_now(code)
