"""Agentic RL: the share of a step spent in the episodes and the ids they generate per second."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from run import folder as runfolder

from . import section
from .helpers import launch


def agent_rows(work: Path, steps: int) -> list[dict]:
    """Agentic RL (data.format=agent, objectives/agent.py) at the agent recipe's shape over the seeded init, 1 process:
    the share of a step spent in the episodes (generated one at a time, batch 1 per turn, a KV cache each) and the
    model's ids those episodes generate per second."""
    out = work / "agent-1"
    launch(["--config", "configs/agent_tiny.yaml", "model.init_from=", "train.grpo.max_new_tokens=32", f"train.steps={steps}",
            "checkpoint.interval=0", "log.progress=false", "log.every=1", "dist.reduce=canonical", f"data.cache_dir={work / 'agent-cache'}",
            f"out_dir={out}"], work / "agent.log")
    rows = runfolder.read_metrics(out)[1:]
    share = statistics.median(r["rollout_s"] / r["step_s"] for r in rows)
    tok_s = statistics.median(r["completion_length"] * 24 / r["rollout_s"] for r in rows)
    step_s = statistics.median(r["step_s"] for r in rows)
    turns = statistics.mean(r["agent/turns"] for r in rows)
    return [
        {"row": "Agent step, tiny shape, 4 prompts x 6 episodes of up to 3 turns x 32 new tokens, 1 process",
         "what": "episodes / step time", "value": share, "detail": f"median of {len(rows)} steps of {step_s:.2f} s, "
                                                                    f"{turns:.2f} turns per episode (seeded init)"},
        {"row": "Agent episodes, tiny shape, batch 1 per turn with a KV cache", "what": "model ids generated per second",
         "value": tok_s, "detail": f"median over {len(rows)} rollouts (GRPO's group of 6: see the GRPO rows)"},
    ]


@section("agent", order=200)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return agent_rows(work, 4 if q else 8)
