"""Train the MiniMind-style LM, resumably.

    python train.py --config configs/tiny.yaml [key=value ...]
    torchrun --standalone --nproc_per_node=N train.py --config configs/tiny.yaml [key=value ...]

Stop it at any moment and run the same command again: it resumes from the newest valid checkpoint
in out_dir and ends bit-for-bit where the uninterrupted run would (docs/resuming.md). This file is
the loop: build, resume, then per step the batch, forward/backward, the optimizer step, the log,
the agreement at the boundary and the checkpoint; each concern lives in its room (docs/design.md).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import time
from dataclasses import dataclass

from common.versions import require_torch

require_torch()  # a torch outside the supported range stops here, before an import needs its API (common/versions.py)

import torch
import yaml

import runtime
import weights
from checkpoint import CheckpointManager, ModelState, OptimizerState, Resumed, RunMeta, model_sha256, new_run_id
from common.files import atomic_write
from common.kernels import reproducible_kernels
from common.outcome import attempt, exit_code, outcome_of
from common.seeds import derive_seed, seed_all
from configs import Config, ConfigError, describe, load_config, load_tokenizer, to_dict
from configs.resume import policy
from data import BatchPlan, BatchPlanError, PackedDataset, unigram_entropy
from data.loader import make_sampler, step_batches
from data.run import data_of_run, summary
from model import MiniMindLM
from model.lora import attach
from objectives import Objective, lr_at, make_objective, make_optimizer, make_plan, optimizer_step, validation
from objectives.benchmark import TaskScores
from objectives.worker import WORKER
from run import folder, tracking
from run.live import Live, LiveMetrics
from run.metrics import Metrics, truncate
from run.protocol import Protocol, describe as describe_error
from run.state import TrainState
from run.stop import StopFlag, exit_now, ignore_stop_signals
from runtime.logs import say, say_refusal

log = logging.getLogger("minimind")


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
    objective: Objective
    unigram_entropy: float
    sharded: bool
    compiled: runtime.speed.CompileWatch | None
    tasks: TaskScores

    @property
    def states(self) -> dict:
        # The same states, under the same names, whatever the strategy: a checkpoint resumes under either (docs/sharding.md).
        # A LoRA run's model state is its adapters: the frozen base is referenced by its hash (docs/lora.md).
        return {"model": ModelState(self.model, trainable_only=self.ckpt.meta.config["train"]["lora"]["rank"] > 0), "optimizer": OptimizerState(self.model, self.opt), "train": self.train_state,
                **({"scaler": self.scaler} if self.scaler else {}), **self.objective.states(), **self.dataset.states(self.train_state)}


def build(cfg: Config, rt: runtime.Runtime, protocol: Protocol) -> Run:
    """Set-up on every rank: the data (packed once per node), the model, its optimizer and the
    checkpoint manager. Ends in an agreement: no rank enters the resume alone."""
    tok = load_tokenizer(cfg)
    dataset, val_dataset, fingerprint = data_of_run(cfg.data, cfg.model.seq_len, cfg.seed, cfg.dist.timeout_s, rt, tok)
    plan = make_plan(cfg, rt.world_size)
    spe = plan.steps_per_epoch(len(dataset))
    if spe == 0:
        raise BatchPlanError(f"data: {len(dataset)} samples do not fill one global batch of {plan.global_batch}")
    seed_all(cfg.seed)  # identical model init on every rank
    model = MiniMindLM(cfg.model).to(rt.device)
    if cfg.train.lora.rank:  # adapters on the targets, everything else frozen (the base comes in start_from_weights)
        attach(model, cfg.train.lora, cfg.seed)
    sharded = cfg.dist.strategy == "fsdp"
    if sharded:  # before the optimizer, which then holds the shards
        runtime.sharding.shard(model, cfg.train.dtype, cfg.dist.reshard_after_forward)
    watch = runtime.speed.apply(model, cfg.train.compile, cfg.train.activation_checkpointing, cfg.runtime.deterministic, rt.device.type)
    scaler = torch.amp.GradScaler(rt.device.type) if cfg.train.dtype == "float16" else None
    must_match, may_change = policy(to_dict(cfg.model), cfg.data.resume_seq_len == "repack")
    meta = RunMeta(world_size=rt.world_size, global_batch=plan.global_batch, micro_batch=plan.micro_batch, accum=plan.accum,
                   threads=rt.threads, reduce=cfg.dist.reduce, strategy=cfg.dist.strategy, config=to_dict(cfg),
                   data_fingerprint=fingerprint, run_id=rt.broadcast(new_run_id()), must_match=must_match, may_change=may_change,
                   files=tok.files, architecture=cfg.model.architecture())
    local = folder.local_dir(cfg.out_dir)  # out_dir, or the staging copy of a run folder in the store
    ckpt = CheckpointManager(cfg.checkpoint, cfg.out_dir, rt, meta, durable=(local / folder.METRICS, local / folder.CONFIG),
                             shared=bool(cfg.ft.lighthouse))
    chat = cfg.data.format != "text"
    entropy = [float("nan")]  # the pretraining yardstick, from the counts packing stored beside the corpus (rank 0)
    if rt.is_main and not chat:
        failed = attempt(lambda: entropy.__setitem__(0, unigram_entropy(dataset.bin_path, len(dataset) * (cfg.model.seq_len + 1),
                                                                          dataset.dtype)))
    else:
        failed = None
    protocol.agree("set-up", failed)
    run = Run(dataset, val_dataset, plan, spe, model, make_optimizer(model, cfg.train), scaler, TrainState(), ckpt,
              make_objective(cfg, dataset, plan.micro_batches, model, tok, rt), entropy[0], sharded, watch, TaskScores(cfg.eval.tasks, tok))
    if rt.is_main:
        log.info("model: %s parameters | world size %d (%s, %s, %d threads/process) | dist.reduce=%s | dist.strategy=%s",
                 f"{model.num_parameters():,}", rt.world_size, rt.backend or "no process group", rt.device, rt.threads,
                 cfg.dist.reduce, cfg.dist.strategy)
        log.info("data: %d samples of %d tokens, %d steps/epoch | global batch %d = micro %d x accum %d x world %d",
                 len(dataset), cfg.model.seq_len, spe, plan.global_batch, plan.micro_batch, plan.accum, rt.world_size)
        log.info("data: %s", summary(fingerprint, cfg.data.loss_on, run.unigram_entropy))
    return run


def start_from_weights(cfg: Config, rt: runtime.Runtime, run: Run, resumed: Resumed | None, protocol: Protocol) -> None:
    """model.init_from: a fresh run loads the weights (every rank reads and checks them, and they
    agree); a resumed run has them in its checkpoint and never reads the source again."""
    if cfg.train.lora.rank:
        return start_lora(cfg, rt, run, resumed, protocol)
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
    record, whole = [], MiniMindLM(cfg.model) if run.sharded else run.model  # sharded: a whole model, then its shards
    protocol.agree("model.init_from", attempt(lambda: record.append(weights.init_from(whole, cfg.model.init_from))))
    if run.sharded:
        runtime.sharding.load_full(run.model, whole.state_dict())
    run.ckpt.meta.init_from = record[0]
    if rt.is_main:
        log.info("model.init_from: %s weights from %s (sha256 %s); optimizer, LR schedule and data start fresh",
                 record[0]["format"], record[0]["path"], record[0]["sha256"][:12])


def start_lora(cfg: Config, rt: runtime.Runtime, run: Run, resumed: Resumed | None, protocol: Protocol) -> None:
    """train.lora: the frozen base (model.init_from, else the seeded init) into the model on every
    rank, on a resume checked against the hash its adapters were trained over; a fresh run's
    adapters from train.lora.init_from, or as drawn (docs/lora.md)."""
    lora, base = cfg.train.lora, run.ckpt.meta.base
    path = cfg.model.init_from or (((base or {}).get("init_from") or {}).get("path", "") if resumed else "")
    got = []
    read = lambda: got.append(weights.lora_start(cfg.model, cfg.seed, lora, path, base if resumed else None,  # noqa: E731
                                                 resumed and resumed.path, run.model.state_dict()))
    protocol.agree("train.lora's base", attempt(read))
    state, record, source, pinned = got[0]
    (runtime.sharding.load_full if run.sharded else type(run.model).load_state_dict)(run.model, state, strict=False)
    if not resumed:
        run.ckpt.meta.init_from, run.ckpt.meta.base = record, {**pinned, "init_from": record, "adapters_from": source}
    if rt.is_main:
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        log.info("train.lora: rank %d (scale %g) on %s: %s of %s parameters train; the base (%s, weights sha256 %s) frozen%s%s",
                 lora.rank, lora.scale, lora.targets, f"{trainable:,}", f"{run.model.num_parameters():,}", path or "the seeded init",
                 pinned["sha256"][:12], ", verified" if resumed else "", f"; adapters from {source['path']}" if source else "")


def resume(cfg: Config, rt: runtime.Runtime, run: Run, protocol: Protocol) -> Metrics:
    """Load the newest valid checkpoint (or start fresh), then on rank 0 truncate the log to it,
    write config.yaml and open the log and the tracker; every rank agrees on the outcome."""
    resumed = run.ckpt.load(run.states)
    start_from_weights(cfg, rt, run, resumed, protocol)
    run.objective.start(cfg, rt, run.ckpt.meta, resumed, protocol.agree, run.ckpt.meta.files)
    start, out = run.train_state.step, folder.local_dir(cfg.out_dir)
    opened = []

    def on_rank_0() -> None:  # after the load: a run that cannot resume leaves the folder as it found it
        truncate(out / folder.METRICS, start, shared=bool(cfg.ft.lighthouse))  # live recovery: the writer group's (run/live.py)
        source = run.ckpt.meta.init_from
        head = f"# model.init_from: {source['path']} (sha256 {source['sha256']}, {source['format']})\n" if source else ""
        resolved = to_dict(cfg)
        resolved["model"]["init_from"] = source["path"] if source else ""  # the source this run used, not what the key says now
        atomic_write(out / folder.CONFIG, head + yaml.safe_dump(resolved, sort_keys=False))
        # Watching does not touch training (docs/design.md I15): the tracker starts after the load, with the run id.
        tracker = tracking.open_tracker(cfg.log.tracker, out, cfg.log.project, run.ckpt.meta.run_id, start, to_dict(cfg))
        opened.append((LiveMetrics if cfg.ft.lighthouse else Metrics)(out / folder.METRICS, tracker, cfg.train.steps, start, cfg.log.every,
                              run.plan.global_batch * cfg.model.seq_len, cfg.log.progress))

    protocol.agree("resume", attempt(on_rank_0) if rt.is_main else None)
    return opened[0] if opened else Metrics(None, tracking.Tracker(), cfg.train.steps, start, cfg.log.every, 1, False)


def train_step(cfg: Config, rt: runtime.Runtime, run: Run, reducer, micro_batches: list, epoch: int, s: int) -> float:
    """Forward/backward over this rank's micro-batches, reduce, clip, optimizer step; the step's global-batch loss."""
    # Under fsdp the precision is FSDP's mixed-precision policy (runtime/sharding.py), not autocast.
    autocast = contextlib.nullcontext() if run.sharded else runtime.autocast(rt.device, cfg.train.dtype)
    rng_devices = [rt.device.index] if rt.device.type == "cuda" else []
    scaler = run.scaler
    for j, batch in enumerate(micro_batches):
        i = reducer.index(j)  # this micro-batch's index in the step, whatever W or group (docs/design.md I4)
        # In-step randomness (dropout) is a function of (seed, epoch, step, i), on whichever rank (docs/design.md I6).
        with torch.random.fork_rng(devices=rng_devices), reducer.no_sync(j):
            torch.manual_seed(derive_seed(cfg.seed, epoch, s, i))
            with autocast:
                loss = run.objective.loss(reducer.net, batch, rt.device, i)
            reducer.backward(loss, j, scaler.scale if scaler else None)
    if (loss := reducer.reduce()) is None:  # live recovery: a peer failed, the step is not committed and is done again
        return None
    # PPO after its early stop steps no optimizer (MiniMind's)
    optimizer_step(run.opt, scaler, reducer, cfg.train.grad_clip, skip=run.objective.skip_update)
    return loss


def train(cfg: Config, rt: runtime.Runtime, stop: StopFlag, protocol: Protocol) -> tuple[str, int]:
    """The run, from build to the last save. Returns how it ended (finished, halted, stopped) and its step."""
    run = build(cfg, rt, protocol)
    try:
        return loop(cfg, rt, stop, protocol, run)
    finally:
        run.ckpt.close()  # its thread and process group, also when the run fails


def loop(cfg: Config, rt: runtime.Runtime, stop: StopFlag, protocol: Protocol, run: Run) -> tuple[str, int]:
    """Resume, then the steps until the run ends (finished, halted or stopped, saved), and the closing line."""
    protocol.phase = "resume"
    metrics = resume(cfg, rt, run, protocol)
    step = start = run.train_state.step
    sampler, (epoch, first) = make_sampler(run.dataset, run.plan, rt, cfg.seed, cfg.data.order, run.train_state, run.ckpt)
    live = cfg.ft.lighthouse and Live(to_dict(cfg), cfg.ft, rt, run, metrics, cfg.model.architecture())  # docs/fault_tolerance.md
    reducer = live.reducer if live else runtime.make_reducer(cfg.dist.strategy, cfg.dist.reduce, run.model, rt, run.plan.accum,
                                                             lambda m: model_sha256(m.state_dict(), cfg.model.architecture()), step)
    halted = 0 < cfg.train.halt_at <= start
    if halted:
        log.warning("train.halt_at=%d is not after the resumed step %d: nothing to do", cfg.train.halt_at, start)
    batches = () if start >= cfg.train.steps or halted else live.batches(run.dataset, sampler, cfg.train.steps) if live else \
        step_batches(run.dataset, sampler, epoch, first, cfg.data.num_workers, cfg.seed, rt.device.type == "cuda", ignore_stop_signals)
    end = "halted" if halted else "finished"
    run.model.train()
    stop.under_way()  # set-up is over: a signal from here on is voted on at the step boundary
    protocol.phase = "training"
    for epoch, s, micro_batches in batches:
        t0, step = time.perf_counter(), run.train_state.step  # the step a heal may have moved (run/live.py)
        lr = lr_at(step, cfg.train)
        for group in run.opt.param_groups:
            group["lr"] = lr
        indices = sampler.step_indices(s)
        run.objective.begin_step(indices, step)
        if run.objective.prepare(run.model, micro_batches, rt, protocol.agree, stop) == "stopped":  # GRPO's rollout, agreed
            end = "stopped"  # a signal inside the rollout, abandoned on every rank: the state is the last boundary's, saved
            protocol.agree("metrics", attempt(metrics.flush))  # the lines that wait for a log step, before the checkpoint
            run.ckpt.after_step(step, run.states, end)
            break
        if (loss := train_step(cfg, rt, run, reducer, micro_batches, epoch, s)) is None:
            continue  # not committed (live recovery): the quorum again, then the step
        step += 1
        seconds = time.perf_counter() - t0
        # The state a checkpoint holds: taken after optimizer.step(), with no gradient pending (docs/design.md I7).
        run.train_state.step, run.train_state.epoch, run.train_state.samples_seen = step, epoch, (s + 1) * run.plan.global_batch
        record = {"step": step, "epoch": epoch, "loss": loss, "lr": lr, "samples_seen": run.train_state.samples_seen,
                  **run.objective.step_metrics(rt)}
        if cfg.eval.interval and (step % cfg.eval.interval == 0 or step == cfg.train.steps):
            if run.val_dataset is not None:
                record.update(validation(run.model, run.val_dataset, cfg.train.micro_batch, cfg.eval.samples, rt,
                                         runtime.autocast(rt.device, cfg.train.dtype), run.sharded))
            record.update(run.tasks(run.model, rt, runtime.autocast(rt.device, cfg.train.dtype), run.sharded))  # docs/eval.md
        if cfg.log.sample_ids:
            record["sample_ids"] = indices
        # Rank-local work fails into the boundary's vote, so that every rank learns of it together (docs/design.md I9).
        failed = (run.compiled and attempt(run.compiled.after_step, step, rt.is_main)) or \
            attempt(metrics.step, record, seconds, run.ckpt.due(step)) or run.ckpt.failure()
        stopping = protocol.boundary(stop.poll(), failed)
        # A stop signal at the run's last step (or its halt) changes nothing: that end is saved and said.
        reason = "halted" if step == cfg.train.halt_at else "finished" if step == cfg.train.steps else "stopped" if stopping else None
        if reason:  # the lines that wait for a log step (no device read inside a step: run/metrics.py), before the checkpoint
            protocol.agree("metrics", attempt(metrics.flush))
        run.ckpt.after_step(step, run.states, reason)
        if reason:
            end = reason
            break
    metrics.close()
    if end == "stopped" and stop.poll():  # this rank was signalled: it knows when
        (log.info if rt.is_main else log.warning)("stopped on %s at step %d: checkpoint published %.2fs after the signal; exit %d "
                                                  "(resume me)", stop.signal, step, time.monotonic() - stop.received_at, exit_code("stopped"))
    elif end == "stopped" and rt.is_main:
        log.info("stopped on a signal to another rank at step %d: checkpoint published; exit %d (resume me)", step, exit_code("stopped"))
    elif rt.is_main:
        metrics.report(end, step, run.unigram_entropy)
    return end, step


def main(argv: list[str] | None = None) -> int:
    reproducible_kernels()  # before the first matmul (common/kernels.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="keys (key=value overrides the YAML):\n" + describe())
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML file (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. train.lr=3e-4")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        say_refusal(f"error: {e}")  # every rank refuses alike: said once
        return exit_code("bad_input")
    stop = StopFlag()  # first: a signal during set-up ends the launch with 75 (run/stop.py)
    rt = lock = protocol = message = None
    outcome, step, clean = "failed", None, False
    try:
        rt = runtime.setup(cfg)
        runtime.setup_logging(rt)
        protocol = Protocol(rt)
        lock = folder.take(cfg.out_dir, cfg.checkpoint.lock_timeout_s, rt, folder.group_lock(cfg.ft.group if cfg.ft.lighthouse else None))
        outcome, step = train(cfg, rt, stop, protocol)
        if outcome != "stopped" and stop.poll():  # the signal came during the final save: the run is complete, and stopped
            log.info("%s arrived during the final save: the checkpoint of step %d is published; exit %d as for any stop "
                     "(a resume has nothing left to do)", stop.signal, step, exit_code("stopped"))
            outcome = "stopped"
        clean = True
    except BaseException as e:
        stop.settled()
        outcome, message = protocol.conclude(e, stop.signal) if protocol else (outcome_of(e), f"error: {describe_error(e)}")
        level = logging.WARNING if outcome == "stopped" else logging.ERROR
        if rt is None:
            say(message)
        else:
            log.log(level, "%s; exit %d%s", message, exit_code(outcome), " (resume me)" if outcome == "stopped" else "")
    finally:
        stop.settled()
        try:
            if lock:
                folder.finish(lock, outcome, step, message if not clean else None)  # a refused fresh folder: taken back
        finally:
            if rt is not None:
                runtime.teardown(rt, clean)
            if lock:
                lock.release()
            WORKER.close()  # the user code this run pinned ends with it (objectives/worker.py)
            stop.restore()
    return exit_code(outcome)


if __name__ == "__main__":
    exit_now(main())
