"""TRL's GRPO family: each loss variant's step time against CISPO's on 2 processes."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from run import folder as runfolder

from . import section
from .helpers import launch


def grpo_family_rows(work: Path, steps: int) -> list[dict]:
    """TRL's GRPO family (issue 45): a variant's step time against CISPO's (the default) on 2 processes,
    where its global-batch figures are gathered."""
    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-arith", "data.format=prompts", "train.objective=grpo",
            "train.global_batch=24", "train.micro_batch=6", "train.grpo.max_new_tokens=16", f"train.steps={steps}",
            "checkpoint.interval=0", "log.progress=false", "dist.reduce=canonical", f"data.cache_dir={work / 'family-cache'}"]
    variants = {"cispo": [], "dapo": ["train.grpo.loss=dapo", "train.grpo.scale_rewards=batch", "train.grpo.mask_truncated=true"],
                "gspo": ["train.grpo.loss=grpo", "train.grpo.importance_sampling=sequence"]}
    step = {}
    for name, extra in variants.items():
        out = work / f"family-{name}"
        launch([*base, *extra, f"out_dir={out}"], work / "family.log", nproc=2)
        step[name] = statistics.median(r["step_s"] for r in runfolder.read_metrics(out)[1:])
    return [
        {"row": "GRPO family, tiny shape, 4 prompts x 6 completions of 16 tokens, 2 processes", "what": "dapo + batch std + mask_truncated / cispo step time",
         "value": step["dapo"] / step["cispo"], "detail": f"{step['dapo']:.2f} s / {step['cispo']:.2f} s (median of {steps - 1} steps; "
                                                          "the global token count and rewards gathered once a rollout)"},
        {"row": "GRPO family, tiny shape, 4 prompts x 6 completions of 16 tokens, 2 processes", "what": "GSPO (sequence-level grpo) / cispo step time",
         "value": step["gspo"] / step["cispo"], "detail": f"{step['gspo']:.2f} s / {step['cispo']:.2f} s (median of {steps - 1} steps)"},
    ]


@section("grpo_family", order=180)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return grpo_family_rows(work, 4 if q else 8)
