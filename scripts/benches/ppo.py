"""PPO's step against GRPO's at the same completions and updates, and the critic's bytes per rank."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from configs import load_config
from model import MiniMindLM
from run import folder as runfolder

from . import section
from .helpers import ROOT, launch


def ppo_rows(work: Path, steps: int) -> list[dict]:
    """PPO's step against GRPO's at the same completions and updates a rollout (1 process); the critic's bytes per rank."""
    from model.critic import Critic

    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-arith", "data.format=prompts", "train.global_batch=24",
            "train.micro_batch=6", "train.grpo.max_new_tokens=16", f"train.steps={steps}", "checkpoint.interval=0", "log.progress=false",
            "dist.reduce=canonical", f"data.cache_dir={work / 'ppo-cache'}"]
    runs = {"grpo": ["train.objective=grpo", "train.grpo.updates_per_rollout=2"],
            "ppo": ["train.objective=ppo", "train.ppo.updates_per_rollout=2", "train.ppo.early_stop_kl=1e9"]}
    step = {}
    for name, extra in runs.items():
        out = work / f"ppo-{name}"
        launch([*base, *extra, f"out_dir={out}"], work / "ppo.log", nproc=0)
        step[name] = statistics.median(r["step_s"] for r in runfolder.read_metrics(out)[1:])
    cfg = load_config(ROOT / "configs" / "tiny.yaml").model
    critic = Critic(cfg)
    n = sum(p.numel() for p in critic.parameters())
    policy = sum(p.numel() for p in MiniMindLM(cfg).parameters())
    return [
        {"row": "PPO / GRPO (cispo) step, tiny shape, 4 prompts x 6 completions of 16 tokens, 2 updates a rollout, 1 process",
         "what": "step time", "value": step["ppo"] / step["grpo"],
         "detail": f"{step['ppo']:.2f} s / {step['grpo']:.2f} s (median of {steps - 1} steps: the critic's forwards and backward, "
                   "its optimizer step, the early stop's forward)"},
        {"row": "PPO critic, tiny shape (model/critic.py: the policy's body and a value head)", "what": "critic bytes per rank / policy's",
         "value": 3 * n / policy, "detail": f"{3 * n * 4 / 2**20:.2f} MiB: fp32 weights and AdamW's two moments, replicated on every rank, "
                                            f"against the policy's {policy * 4 / 2**20:.2f} MiB of fp32 weights"},
    ]


@section("ppo", order=190)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return ppo_rows(work, 4 if q else 8)
