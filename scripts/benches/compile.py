"""train.compile against eager, and activation checkpointing against none, at the 26M shape."""
from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from . import section
from .helpers import SMALL, launch, run_rss, step_median, vocab_6400


AIMS = {
    "compiled / eager tokens per second": (">=", 1.1),
    "activation checkpointing / none, peak RSS": ("<=", 0.7),
}


def compile_rows(work: Path, short: int, long: int) -> list[dict]:
    """train.compile at the 26M shape on CPU: tokens/s compiled / eager (per step from two run
    lengths, the compile cache warm), and the first step's time with a cold cache (the compile)."""
    tok = vocab_6400(work)
    base = ["--config", "configs/tiny.yaml", *SMALL, f"data.tokenizer={tok}", "train.global_batch=8", "train.micro_batch=8",
            "checkpoint.interval=0", "log.progress=false", "train.warmup_steps=2", f"data.cache_dir={work / 'c-cache'}"]
    cold = work / "inductor-cold"
    _, err = launch([*base, "train.steps=2", "train.compile=true", f"out_dir={work / 'c-cold'}"], work / "compile.log",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(cold)})
    first = float(re.search(r"the first step took ([\d.]+) s", err).group(1))
    per = {}
    for compiled in (False, True):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cold)}
        t = [launch([*base, f"train.steps={n}", f"train.compile={str(compiled).lower()}", f"out_dir={work / f'c-{compiled}-{n}'}"],
                    work / "compile.log", env=env)[0] for n in (short, long)]
        per[compiled] = (t[1] - t[0]) / (long - short)
    _, err = launch([*base, "train.steps=2", "train.compile=true", f"out_dir={work / 'c-warm'}"], work / "compile.log",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(cold)})
    warm = float(re.search(r"the first step took ([\d.]+) s", err).group(1))
    shutil.rmtree(cold, ignore_errors=True)
    return [
        {"row": "train.compile, 26M shape (MiniMind's), batch 8 x 256, CPU, 1 process", "what": "compiled / eager tokens per second",
         "value": per[False] / per[True], "aim": "compiled / eager tokens per second",
         "detail": f"{per[True]:.2f} s / {per[False]:.2f} s per step (from {short}- and {long}-step runs, the compile cache warm)"},
        {"row": "train.compile, 26M shape, the first step", "what": "cold cache / warm cache, seconds", "value": first / warm,
         "detail": f"{first:.1f} s with an empty TORCHINDUCTOR_CACHE_DIR (the compile) / {warm:.1f} s reading it"},
    ]


def checkpointing_rows(work: Path, steps: int) -> list[dict]:
    """train.activation_checkpointing=full against none at the 26M shape, batch 8 x 256: the
    process's peak RSS and the step time (fresh processes)."""
    tok = vocab_6400(work)
    base = ["--config", "configs/tiny.yaml", *SMALL, f"data.tokenizer={tok}", "train.global_batch=8", "train.micro_batch=8",
            f"train.steps={steps}", "checkpoint.interval=0", "log.progress=false", f"data.cache_dir={work / 'c-cache'}"]
    got = {}
    for mode in ("none", "full"):
        out = work / f"ac-{mode}"
        rss, _ = run_rss([*base, f"train.activation_checkpointing={mode}", f"out_dir={out}"], work)
        got[mode] = (rss, step_median(out, 1))
    (rn, tn), (rf, tf) = got["none"], got["full"]
    return [
        {"row": "activation checkpointing, 26M shape, batch 8 x 256, CPU", "what": "activation checkpointing / none, peak RSS",
         "value": rf / rn, "aim": "activation checkpointing / none, peak RSS",
         "detail": f"{rf / 2**20:.0f} MiB / {rn / 2**20:.0f} MiB (the whole process's peak: weights, AdamW, activations)"},
        {"row": "activation checkpointing, 26M shape, batch 8 x 256, CPU", "what": "full / none, step time", "value": tf / tn,
         "detail": f"{tf:.2f} s / {tn:.2f} s (each block's forward runs again in the backward)"},
    ]


@section("compile", order=50, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return [*compile_rows(work, 3 if q else 5, 8 if q else 25), *checkpointing_rows(work, 3 if q else 5)]
