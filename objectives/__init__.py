"""What training optimizes: each objective is one module that registers what it is made of (spec.py: its
config section, data formats, factory, batch plan, refusals, pins, the keys it honours) behind one protocol
the loop calls (a micro-batch in, its loss out; a step's metrics; `start`, after the resume, for what it
needs beside the model; `prepare`, before a step's forwards; `states`, what it adds to a checkpoint), and
the optimizer with its learning-rate schedule (optim.py). Next-token prediction (pretraining and SFT) is
next_token.py, DPO over preference pairs dpo.py, GRPO and CISPO over prompts grpo.py (and over multi-turn
episodes with tools agent.py, its tools tools.py), PPO ppo.py, knowledge distillation from a frozen teacher
distill.py. What a run is measured by beside its loss: benchmark tasks scored as lm-evaluation-harness
scores them (benchmark.py)."""
import importlib
import pkgutil

from data import BatchPlan

from .next_token import NextToken, evaluate, validation
from .optim import lr_at, make_optimizer, optimizer_step
from .spec import Context, Objective, ObjectiveSpec, spec_for, spec_of, specs

for _module in pkgutil.iter_modules(__path__):  # each objective's module registers itself (spec.register)
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")


def make_plan(cfg, world_size: int) -> BatchPlan:
    """The run's batch geometry in dataset samples, the objective's plan (GRPO's counts prompts: train.global_batch
    and train.micro_batch count completions, and each global batch serves updates_per_rollout steps)."""
    plan = spec_for(cfg.train.objective, cfg.data.format).plan
    if plan is None:
        return BatchPlan(cfg.train.global_batch, cfg.train.micro_batch, world_size)
    global_batch, micro_batch, serves = plan(cfg)
    return BatchPlan(global_batch, micro_batch, world_size, serves)


def make_objective(cfg, dataset, micro_batches: int, model, tok, rt) -> Objective:
    """train.objective's objective for the run's (training) dataset, from its registered factory."""
    return spec_for(cfg.train.objective, cfg.data.format).build(Context(cfg, dataset, micro_batches, model, tok, rt))


__all__ = ["Context", "NextToken", "Objective", "ObjectiveSpec", "evaluate", "lr_at", "make_objective", "make_optimizer", "make_plan", "optimizer_step",
           "spec_for", "spec_of", "specs", "validation"]
