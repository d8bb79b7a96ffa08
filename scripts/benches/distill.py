"""Distillation's step time and memory with a live teacher, and a precomputed top-32 teacher against the live one."""
from __future__ import annotations

import argparse
from pathlib import Path

from configs import load_config
from model import MiniMindLM

from . import section
from .helpers import ROOT, launch, run_rss, step_median


AIMS = {
    "distill, top-32 precomputed / live teacher, step time": ("<=", 0.6),
}


def distill_rows(work: Path, steps: int) -> list[dict]:
    """Distillation on the built-in chats at the tiny shape (seq_len 256, batch 16 rows, 1 process):
    step time with a live teacher of twice the student's width against next-token training of the
    student alone, and their peak RSS; the teacher's top 32 precomputed against the live teacher;
    the table's bytes per taught position; under fsdp the teacher's bytes per rank (it is
    replicated) against the student's shard."""
    import numpy as np

    from objectives.tables import TableFiles, read_verified

    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-chat", "data.format=chat", "model.seq_len=256", "train.global_batch=16",
            "train.micro_batch=4", f"train.steps={steps}", "checkpoint.interval=0", "log.progress=false",
            f"data.cache_dir={work / 'distill-cache'}"]
    wide = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=4"]  # the default's heads of 32 at twice the width
    launch([*base, *wide, "train.steps=1", f"out_dir={work / 'distill-teacher'}"], work / "distill.log")
    distill = ["train.objective=distill", f"train.distill.teacher={work / 'distill-teacher'}"]
    t, rss = {}, {}
    for name, extra in (("student", []), ("live", distill), ("top32", [*distill, "train.distill.top_k=32"])):
        out = work / f"distill-{name}"
        rss[name], _ = run_rss([*base, *extra, f"out_dir={out}"], work)
        t[name] = step_median(out, 2)
    (table,) = (p for p in (work / "distill-cache").rglob("*.teacher-*-K32-*") if p.is_dir())
    empty = {"logits": np.zeros((0, 32), np.float32), "ids": np.zeros((0, 32), np.uint16)}
    positions = sum(len(item["ids"]) for item in read_verified(TableFiles(table), empty, str(table))[0].values())
    size = sum(p.stat().st_size for p in table.iterdir())
    teacher, student = (load_config(ROOT / "configs" / "tiny.yaml", [*base[2:], *w]).model for w in (wide, []))
    tb, sb = (MiniMindLM(c).num_parameters() * 4 for c in (teacher, student))
    return [{"row": "distillation, tiny shape at seq_len 256, batch 16 chat rows, 1 process, a live teacher of 2x width (dim 256)",
             "what": "distill (live teacher) / next-token, step time", "value": t["live"] / t["student"],
             "detail": f"{t['live'] * 1e3:.0f} ms / {t['student'] * 1e3:.0f} ms (the teacher: one forward per row, no graph)"},
            {"row": "distillation, the same runs", "what": "distill (live teacher) / next-token, peak RSS", "value": rss["live"] / rss["student"],
             "detail": f"{rss['live'] / 2**20:.0f} MiB / {rss['student'] / 2**20:.0f} MiB (VmHWM of the whole process)"},
            {"row": "distillation, the teacher's top 32 precomputed before training", "what": "distill, top-32 precomputed / live teacher, step time",
             "value": t["top32"] / t["live"], "aim": "distill, top-32 precomputed / live teacher, step time",
             "detail": f"{t['top32'] * 1e3:.0f} ms / {t['live'] * 1e3:.0f} ms"},
            {"row": "distillation's top-32 table", "what": "bytes per taught position", "value": size / positions,
             "detail": f"{size / 2**20:.2f} MiB for {positions:,} taught positions (32 fp32 logits + 32 uint16 ids each)"},
            {"row": "distillation under fsdp, 2 processes (from the parameter counts)", "what": "teacher bytes per rank / student's shard",
             "value": tb / (sb / 2), "detail": f"{tb / 2**20:.2f} MiB (replicated: every rank holds the whole fp32 teacher) / "
                                                f"{sb / 2 / 2**20:.2f} MiB (half the student's fp32 parameters)"}]


@section("distill", order=160, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return distill_rows(work, 6 if q else 12)
