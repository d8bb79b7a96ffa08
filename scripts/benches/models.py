"""MiniMind-3's MoE against a dense model of the same active parameters, and minimind3_small against minimind2_small."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import section
from .helpers import SMALL, launch, step_median, vocab_6400


def models_rows(work: Path, steps: int) -> list[dict]:
    """MiniMind-3's MoE against a dense model with the same active parameters (4 experts, top-1,
    each expert the dense FFN's width), and minimind3_small against minimind2_small: step time and
    tokens per second at batch 8 x 256, 1 process."""
    tok = vocab_6400(work)
    common = [f"data.tokenizer={tok}", "train.global_batch=8", "train.micro_batch=8", f"train.steps={steps}", "checkpoint.interval=0",
              "log.progress=false", "model.seq_len=256", f"data.cache_dir={work / 'c-cache'}"]
    t = {}
    for name, args in (("dense", ["--config", "configs/tiny.yaml", *SMALL]),
                       ("moe", ["--config", "configs/tiny.yaml", *SMALL, "model.moe.experts=4", "model.moe.top_k=1"]),
                       ("minimind2_small", ["--config", "configs/minimind2_small.yaml"]),
                       ("minimind3_small", ["--config", "configs/minimind3_small.yaml"])):
        out = work / f"m-{name}"
        launch([*args, *common, f"out_dir={out}"], work / "models.log")
        t[name] = step_median(out, 2)
    return [
        {"row": "MoE (4 experts, top-1) vs dense, the same active parameters, 26M shape, batch 8 x 256", "what": "MoE / dense, step time",
         "value": t["moe"] / t["dense"], "detail": f"{t['moe']:.2f} s / {t['dense']:.2f} s (the router, the experts' token dispatch, "
                                                   f"and four experts' weights for one's arithmetic)"},
        {"row": "configs/minimind3_small.yaml vs configs/minimind2_small.yaml, batch 8 x 256", "what": "tokens per second, 3 / 2",
         "value": t["minimind2_small"] / t["minimind3_small"],
         "detail": f"{8 * 256 / t['minimind3_small']:,.0f} / {8 * 256 / t['minimind2_small']:,.0f} tok/s"},
    ]


@section("models", order=60)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return models_rows(work, 4 if q else 6)
