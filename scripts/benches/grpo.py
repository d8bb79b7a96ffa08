"""GRPO's rollout with the KV cache against recomputing, the share of a step spent generating, and 2 processes against 1."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from configs import load_config
from model import MiniMindLM
from run import folder as runfolder

from . import section
from .helpers import ROOT, launch


def grpo_rows(work: Path, steps: int) -> list[dict]:
    """GRPO on the built-in sums at the tiny shape: a group's rollout with the KV cache against
    recomputing the sequence per token; the share of a step spent generating; 2 processes / 1."""
    from model.generate import generate_group

    cfg = load_config(ROOT / "configs" / "tiny.yaml").model
    torch.manual_seed(0)
    model = MiniMindLM(cfg).eval()
    prompt = list(range(1, 41))
    gens = lambda: [torch.Generator().manual_seed(k) for k in range(6)]  # noqa: E731
    t = {}
    for cached in (True, False):
        t0 = time.perf_counter()
        out = generate_group(model, prompt, gens(), 64, use_cache=cached)
        t[cached] = time.perf_counter() - t0
        t[(cached, "ids")] = out
    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-arith", "data.format=prompts", "train.objective=grpo",
            "train.global_batch=24", "train.micro_batch=6", "train.grpo.max_new_tokens=16", f"train.steps={steps}",
            "checkpoint.interval=0", "log.progress=false", "dist.reduce=canonical", f"data.cache_dir={work / 'grpo-cache'}"]
    step = {}
    for n in (1, 2):
        out = work / f"grpo-{n}"
        launch([*base, f"out_dir={out}"], work / "grpo.log", nproc=n if n > 1 else 0)
        rows = runfolder.read_metrics(out)[1:]
        step[n] = (statistics.median(r["step_s"] for r in rows), statistics.median(r["rollout_s"] / r["step_s"] for r in rows))
    return [
        {"row": "GRPO rollout, tiny shape, a group of 6 x 64 new tokens after 40", "what": "KV cache / recompute (tokens/s)",
         "value": t[False] / t[True], "detail": f"{6 * 64 / t[True]:.0f} / {6 * 64 / t[False]:.0f} tok/s; the same ids: "
                                                 f"{'yes' if torch.equal(t[(True, 'ids')], t[(False, 'ids')]) else 'NO'}"},
        {"row": "GRPO step, tiny shape, 4 prompts x 6 completions of 16 tokens, 1 process", "what": "generation / step time",
         "value": step[1][1], "detail": f"median of {steps - 1} steps of {step[1][0]:.2f} s"},
        {"row": "GRPO step, tiny shape, 4 prompts x 6 completions", "what": "step time, 2 processes / 1", "value": step[2][0] / step[1][0],
         "detail": f"{step[2][0]:.2f} s / {step[1][0]:.2f} s (each rank generates its own groups)"},
    ]


@section("grpo", order=90)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return grpo_rows(work, 4 if q else 8)
