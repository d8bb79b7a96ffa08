"""What training optimizes: each objective is one module behind one interface the loop calls (a
micro-batch in, its loss out; a step's metrics; `start`, after the resume, for what it needs beside
the model; `prepare`, before a step's forwards; `states`, what it adds to a checkpoint), and the
optimizer with its learning-rate schedule (optim.py). Next-token prediction (pretraining and SFT) is
next_token.py, DPO over preference pairs dpo.py, GRPO and CISPO over prompts grpo.py, PPO ppo.py, knowledge
distillation from a frozen teacher distill.py, GRPO over multi-turn episodes with tools agent.py (its tools
tools.py). What a run is measured by beside its loss: benchmark
tasks scored as lm-evaluation-harness scores them (benchmark.py)."""
from data import BatchPlan

from .distill import Distill, DistillConfig
from .dpo import DPO, DPOConfig
from .grpo import GRPO, GRPOConfig
from .next_token import NextToken, evaluate, validation
from .ppo import PPO, PPOConfig
from .optim import lr_at, make_optimizer, optimizer_step


def make_plan(cfg, world_size: int) -> BatchPlan:
    """The run's batch geometry in dataset samples: for GRPO, train.global_batch and train.micro_batch
    count completions (generations per prompt), and each global batch of prompts serves
    updates_per_rollout optimizer steps."""
    if cfg.train.objective in ("grpo", "ppo"):
        g = cfg.train.grpo.generations
        upr = cfg.train.grpo.updates_per_rollout if cfg.train.objective == "grpo" else cfg.train.ppo.updates_per_rollout
        return BatchPlan(cfg.train.global_batch // g, cfg.train.micro_batch // g, world_size, upr)
    return BatchPlan(cfg.train.global_batch, cfg.train.micro_batch, world_size)


def make_objective(cfg, dataset, micro_batches: int, model, tok, rt):
    """train.objective's objective for the run's (training) dataset."""
    if cfg.train.objective == "dpo":
        return DPO(dataset, micro_batches, cfg.train.micro_batch, cfg.train.dpo, model)
    if cfg.train.objective == "distill":
        return Distill(dataset, micro_batches, cfg.train.micro_batch, cfg.data.format == "chat", cfg.train.distill, model)
    if cfg.train.objective == "grpo" and cfg.data.format == "agent":
        from .agent import Agent

        return Agent(dataset, micro_batches, cfg.train.global_batch, cfg.train.grpo, cfg.train.agent, cfg.seed, tok, rt, model)
    if cfg.train.objective == "grpo":
        return GRPO(dataset, micro_batches, cfg.train.global_batch, cfg.train.grpo, cfg.seed, tok, rt, model)
    if cfg.train.objective == "ppo":
        return PPO(dataset, micro_batches, cfg.train.global_batch, cfg.train.grpo, cfg.train.ppo, cfg.train, cfg.seed, tok, rt, model)
    return NextToken(dataset, micro_batches, cfg.data.format == "chat", model)


__all__ = ["DPO", "DPOConfig", "Distill", "DistillConfig", "GRPO", "GRPOConfig", "NextToken", "PPO", "PPOConfig", "evaluate", "lr_at", "validation", "make_objective", "make_optimizer", "optimizer_step",
           "make_plan"]
